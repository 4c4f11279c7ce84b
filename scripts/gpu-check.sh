#!/usr/bin/env bash
# The GPU check in one command, from a checkout, on a machine that has a CUDA torch and no
# network (python -m batchgate.bench.gpu_check; docs/benchmarks.md):
#
#   scripts/gpu-check.sh OUTDIR [gpu_check flags]        on the GPU machine
#   scripts/gpu-check.sh --cpu OUTDIR [gpu_check flags]  the same recipe, the harness on the CPU
#
# It installs the wheels of scripts/gpu-check-requirements.txt from .whl/ (downloaded
# beforehand by scripts/gpu-check-wheels.sh; $GPU_CHECK_WHEELS names another folder) into a
# private folder first on the path, then runs the check from this checkout, which resolves
# batchgate.* itself, with `pytest -m cuda` as its last section, in one call under 8 minutes.
# OUTDIR receives gpu_check.txt (everything printed, the table last), gpu_check.json (every
# figure) and gpu_check.stderr. $PYTHON picks the interpreter (default python3). Exit status:
# the check's (0; 1 when a correctness check failed; 3 when it ran past its limit), 2 on usage.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
python=${PYTHON:-python3}
wheels=${GPU_CHECK_WHEELS:-$root/.whl}
# The check stops itself at 450 s (bench/gpu_check/report.py); this only catches a hang before.
limit_s=470

usage() {
    sed -n '2,15p' "$0" | sed 's/^# \{0,1\}//' >&2
    exit 2
}

mode=()
if [[ ${1:-} == --cpu ]]; then
    mode=(--cpu --pytest)  # the cuda tests then skip, saying why: pytest's setup is proven
    shift
fi
[[ $# -ge 1 && ${1:-} != -* ]] || usage
out=$1
shift
mkdir -p "$out"
out=$(cd "$out" && pwd)

if ! "$python" -c 'import torch' 2>/dev/null; then
    echo "gpu-check: $python cannot import torch; this check runs with the machine's own torch" >&2
    exit 1
fi

site=$(mktemp -d "${TMPDIR:-/tmp}/batchgate-gpu-check.XXXXXX")
trap 'rm -rf "$site"' EXIT
echo "gpu-check: installing the wheels of scripts/gpu-check-requirements.txt into $site"
"$python" "$root/scripts/install_wheels.py" "$root/scripts/gpu-check-requirements.txt" \
    "$wheels" "$site"

cd "$root"
export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
"$python" -c 'import platform, torch
print(f"gpu-check: Python {platform.python_version()}, torch {torch.__version__} (CUDA "
      f"{torch.version.cuda}), {torch.cuda.device_count()} CUDA device(s)")'
runner=()
command -v timeout >/dev/null && runner=(timeout --kill-after=10 "$limit_s")
set +e
${runner[@]+"${runner[@]}"} "$python" -m batchgate.bench.gpu_check --json "$out/gpu_check.json" \
    ${mode[@]+"${mode[@]}"} "$@" 2>"$out/gpu_check.stderr" | tee "$out/gpu_check.txt"
status=${PIPESTATUS[0]}
set -e
echo "gpu-check: exit $status; $out/gpu_check.txt, gpu_check.json, gpu_check.stderr"
exit "$status"
