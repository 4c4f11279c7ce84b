#!/usr/bin/env bash
# Builds the native front end (server/native) into build/native/batchgate-frontend (idempotent:
# nothing is rebuilt when nothing changed). Installs Debian's / Ubuntu's build packages first if
# any is missing (gRPC C++ 1.51, protobuf 3.21: what Debian 12 and Ubuntu 24.04 both ship).
#
#   scripts/build-native.sh              # release build: build/native/
#   scripts/build-native.sh --sanitize   # AddressSanitizer + UBSan: build/native-asan/
#   BATCHGATE_SANITIZE=1 scripts/build-native.sh   # the same
#   scripts/build-native.sh --fuzz       # libFuzzer targets with clang (+ ASan, UBSan):
#                                        # build/native-fuzz/fuzz-* (scripts/fuzz-native.sh)
#
# On failure it ends with one line on stderr saying what could not be done.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
sanitize="${BATCHGATE_SANITIZE:-0}"
fuzz=0
for arg in "$@"; do
  case "$arg" in
    --sanitize) sanitize=1 ;;
    --fuzz) fuzz=1 ;;
    -h|--help) sed -n '2,12p' "$0"; exit 0 ;;
    *) echo "build-native.sh: unknown argument '$arg' (expected --sanitize or --fuzz)" >&2; exit 2 ;;
  esac
done

fail() { echo "build-native.sh: $*" >&2; exit 1; }

packages=(cmake make g++ pkg-config protobuf-compiler protobuf-compiler-grpc libprotobuf-dev
          libgrpc++-dev)
if [ "$fuzz" = 1 ]; then
  # clang, and the runtime libraries -fsanitize=fuzzer links (libclang-rt-14-dev on Debian 12).
  packages+=(clang libclang-rt-dev)
fi
missing=()
for package in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$package")
  fi
done
if [ "${#missing[@]}" -gt 0 ]; then
  command -v apt-get >/dev/null 2>&1 \
    || fail "missing build packages (${missing[*]}) and no apt-get to install them"
  sudo=""
  if [ "$(id -u)" != 0 ]; then
    sudo="sudo -n"
  fi
  export DEBIAN_FRONTEND=noninteractive
  # `make test` runs the three builds side by side: one apt at a time (flock, util-linux).
  apt_lock=(flock "${TMPDIR:-/tmp}/batchgate-apt.lock")
  "${apt_lock[@]}" $sudo apt-get update -qq >/dev/null 2>&1 \
    || fail "apt-get update failed (needed for: ${missing[*]})"
  "${apt_lock[@]}" $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" \
    >/dev/null 2>&1 \
    || fail "could not install the build packages: ${missing[*]}"
fi

configure_env=()
if [ "$fuzz" = 1 ]; then
  build="$root/build/native-fuzz"
  options=(-DBATCHGATE_FUZZ=ON -DCMAKE_BUILD_TYPE=RelWithDebInfo)
  configure_env=(CC=clang CXX=clang++)
elif [ "$sanitize" = 1 ]; then
  build="$root/build/native-asan"
  # Warnings are errors here: CI builds this one, so our code stays -Wall -Wextra clean.
  options=(-DBATCHGATE_SANITIZE=ON -DBATCHGATE_WERROR=ON -DCMAKE_BUILD_TYPE=RelWithDebInfo)
else
  build="$root/build/native"
  options=(-DBATCHGATE_SANITIZE=OFF -DCMAKE_BUILD_TYPE=Release)
fi

mkdir -p "$root/build"
# Configure once; afterwards the generated build files re-run CMake themselves when a
# CMakeLists.txt changes.
if [ ! -f "$build/CMakeCache.txt" ]; then
  env "${configure_env[@]}" cmake -S "$root/server/native" -B "$build" "${options[@]}" \
    >"$build.configure.log" 2>&1 \
    || { cat "$build.configure.log" >&2; fail "cmake could not configure server/native (log above)"; }
fi
jobs="$(nproc 2>/dev/null || echo 2)"
targets=()
if [ "$fuzz" = 1 ]; then
  # Only the fuzz targets: the front end and its unit tests are the other two builds' job.
  targets=(--target fuzz-request fuzz-reply fuzz-frame)
fi
cmake --build "$build" --parallel "$jobs" "${targets[@]}" -- --no-print-directory \
  || fail "the build of server/native failed (compiler output above)"
if [ "$fuzz" = 1 ]; then
  echo "built $build/fuzz-request, fuzz-reply, fuzz-frame"
else
  echo "built $build/batchgate-frontend"
fi
