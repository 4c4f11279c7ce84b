#!/usr/bin/env bash
# Download the wheels scripts/gpu-check.sh installs on a GPU machine without network: every pin
# of scripts/gpu-check-requirements.txt, for CPython 3.12 and 3.11 on manylinux x86_64, into
# .whl/ (or the folder given), which is in .gitignore: it travels with the checkout only when
# carried. Run it here, where PyPI is reachable; it refuses a set over 64 MiB.
#
#   scripts/gpu-check-wheels.sh [FOLDER]
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
dest=${1:-$root/.whl}
python=${PYTHON:-python3}
limit_mib=64
mkdir -p "$dest"
for version in 3.12 3.11; do
    abi="cp${version/./}"
    "$python" -m pip download --quiet --disable-pip-version-check --no-deps \
        --only-binary=:all: --python-version "$version" --implementation cp \
        --abi "$abi" --abi abi3 --abi none \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any \
        -d "$dest" -r "$root/scripts/gpu-check-requirements.txt" 2>&1 | grep -v "^WARNING: Location" || true
done
# Each Python must find every pin there (glibc 2.28: what numpy's wheels need at least).
"$python" - "$root" "$dest" <<'PY'
import sys
from pathlib import Path
sys.path.insert(0, sys.argv[1] + "/scripts")
import install_wheels as w
pins = w.read_pins(Path(sys.argv[1]) / "scripts" / "gpu-check-requirements.txt")
for version in ((3, 12), (3, 11)):
    missing = [f"{n}=={v}" for n, v, _ in pins
               if w.wheel_for(Path(sys.argv[2]), n, v, (version, "x86_64", (2, 28))) is None]
    if missing:
        raise SystemExit(f"gpu-check-wheels: no wheel for Python {version} of {missing}")
PY
total=$(du -sm "$dest" | cut -f1)
ls -1 "$dest"
echo "gpu-check-wheels: $(ls -1 "$dest"/*.whl | wc -l) wheels, ${total} MiB in $dest"
if (( total > limit_mib )); then
    echo "gpu-check-wheels: over ${limit_mib} MiB, more than a device run may carry" >&2
    exit 1
fi
