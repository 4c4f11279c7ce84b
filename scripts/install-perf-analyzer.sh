#!/usr/bin/env bash
# Installs Triton's perf_analyzer 2.51.0 into .tools/perf_analyzer (idempotent).
#
# The binary ships inside the manylinux wheel of tritonclient 2.51.0 (later wheels need a newer
# glibc or ship none). That release pins numpy<2 and protobuf<5, so it goes into its own folder
# with --no-deps, beside the CUDA runtime library it links against (no GPU needed), and libb64
# from Debian. Run it with scripts/perf_analyzer, which sets the library path.
set -euo pipefail
cd "$(dirname "$0")/.."
dest=.tools/perf_analyzer
python=${PYTHON:-python3}
[ -x .venv/bin/python ] && python=.venv/bin/python

if [ -x "$dest/bin/perf_analyzer" ] && scripts/perf_analyzer --version >/dev/null 2>&1; then
  exit 0
fi
if ! ldconfig -p | grep -q libb64.so.0d; then
  # `make test` runs this beside the native builds, which may use apt too: one at a time.
  apt_lock=(flock "${TMPDIR:-/tmp}/batchgate-apt.lock")
  if [ "$(id -u)" = 0 ]; then
    "${apt_lock[@]}" apt-get update -qq >/dev/null \
      && DEBIAN_FRONTEND=noninteractive "${apt_lock[@]}" apt-get install -y -qq libb64-0d >/dev/null
  else
    "${apt_lock[@]}" sudo -n apt-get install -y -qq libb64-0d >/dev/null
  fi
fi
rm -rf "$dest"
"$python" -m pip install --quiet --no-deps --target "$dest" \
  tritonclient==2.51.0 nvidia-cuda-runtime-cu12 --only-binary=:all: \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --python-version 3.11 \
  2>&1 | grep -v "WARNING: Location" || true
scripts/perf_analyzer --version >/dev/null 2>&1 || { echo "perf_analyzer does not run" >&2; exit 1; }
echo "perf_analyzer installed in $dest"
