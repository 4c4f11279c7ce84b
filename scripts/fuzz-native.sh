#!/usr/bin/env bash
# Builds the native front end's libFuzzer targets (scripts/build-native.sh --fuzz: clang, ASan,
# UBSan) and runs each for SECONDS (default 60) from its seed corpus
# (server/native/fuzz/corpus/<target>/, committed; what a run finds goes to
# build/native-fuzz/corpus/<target>/, never into the repository's).
#
#   scripts/fuzz-native.sh            # each target 60 s
#   scripts/fuzz-native.sh 600        # each target 10 minutes
#   FUZZ_TARGETS="request" scripts/fuzz-native.sh 30
#
# Exits 0 when no target crashed, 1 with the crashing input kept under
# build/native-fuzz/crashes/<target>/ and its report on stderr, 3 when the targets could not
# be built (the line above says why).
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
seconds="${1:-60}"
targets="${FUZZ_TARGETS:-request reply frame}"
case "$seconds" in
  ''|*[!0-9]*) echo "fuzz-native.sh: SECONDS must be a whole number, got '$seconds'" >&2; exit 2 ;;
esac

bash "$root/scripts/build-native.sh" --fuzz >&2 || exit 3
build="$root/build/native-fuzz"
failed=0
for target in $targets; do
  corpus="$build/corpus/$target"
  crashes="$build/crashes/$target"
  mkdir -p "$corpus" "$crashes"
  # -rss_limit_mb: a request's cost must stay small; -max_len: past the targets' bounds.
  if ! "$build/fuzz-$target" "$corpus" "$root/server/native/fuzz/corpus/$target" \
      -max_total_time="$seconds" -rss_limit_mb=2048 -max_len=65536 -timeout=10 \
      -print_final_stats=1 -artifact_prefix="$crashes/" 2>"$build/fuzz-$target.log"; then
    tail -n 60 "$build/fuzz-$target.log" >&2
    echo "fuzz-native.sh: fuzz-$target crashed; its input is in $crashes/" >&2
    failed=1
  else
    runs="$(grep -o 'stat::number_of_executed_units: [0-9]*' "$build/fuzz-$target.log" | grep -o '[0-9]*$' || true)"
    echo "fuzz-$target: ${runs:-?} inputs in ${seconds} s, no crash"
  fi
done
exit "$failed"
