#!/usr/bin/env bash
# Installs Debian's nginx with gRPC proxying (ngx_http_grpc_module + HTTP/2) for tests/test_nginx.py
# (idempotent). nginx-light is enough: Debian builds the grpc and http_v2 modules into every
# flavour's core binary. The system service is NOT started (nor left running if the package's
# postinst starts it): the tests run their own nginx, with their own config, in a temp dir.
set -euo pipefail

has_grpc() {
  command -v nginx >/dev/null 2>&1 || return 1
  nginx -V 2>&1 | grep -q -- --with-http_v2_module || return 1
  # grpc_pass is compiled in unless --without-http_grpc_module: prove it with a config test.
  local dir
  dir=$(mktemp -d)
  cat > "$dir/t.conf" <<CONF
error_log $dir/error.log;
pid $dir/nginx.pid;
events {}
http {
  upstream u { server 127.0.0.1:1; }
  server { listen 127.0.0.1:1 http2; location / { grpc_pass grpc://u; } }
}
CONF
  local ok=0
  nginx -t -q -e "$dir/error.log" -p "$dir" -c "$dir/t.conf" >/dev/null 2>&1 || ok=1
  rm -rf "$dir"
  return $ok
}

if has_grpc; then
  exit 0
fi

sudo=""
if [ "$(id -u)" != 0 ]; then
  sudo="sudo -n"
fi

# Keep the package's postinst from starting the service, only for this install.
policy=/usr/sbin/policy-rc.d
made_policy=0
if [ ! -e "$policy" ]; then
  printf '#!/bin/sh\nexit 101\n' | $sudo tee "$policy" >/dev/null
  $sudo chmod 755 "$policy"
  made_policy=1
fi
cleanup() { if [ "$made_policy" = 1 ]; then $sudo rm -f "$policy"; fi; }
trap cleanup EXIT

export DEBIAN_FRONTEND=noninteractive
# `make test` runs this beside the native builds, which may use apt too: one at a time.
apt_lock=(flock "${TMPDIR:-/tmp}/batchgate-apt.lock")
"${apt_lock[@]}" $sudo apt-get update -qq >/dev/null
"${apt_lock[@]}" $sudo apt-get install -y -qq nginx-light >/dev/null 2>&1 \
  || "${apt_lock[@]}" $sudo apt-get install -y -qq nginx >/dev/null

# Belt and braces: a system nginx started anyway (no policy-rc.d honoured) is stopped again.
if [ -s /run/nginx.pid ] && kill -0 "$(cat /run/nginx.pid)" 2>/dev/null; then
  $sudo nginx -s quit 2>/dev/null || true
fi

has_grpc || { echo "nginx installed but without gRPC proxying (grpc_pass / http2)" >&2; exit 1; }
echo "nginx installed: $(nginx -v 2>&1)"
