#!/usr/bin/env bash
# Every committed winner in tuned/<gpu>/ gated once under each of compute-sanitizer's checkers:
# memcheck (out-of-bounds and misaligned accesses), racecheck (shared-memory races), synccheck (barriers
# misused) and initcheck (reads of device memory never written). Each tool's output goes to
# $RESULTS/sanitizer_<tool>.txt; one summary line per tool follows. Arguments go to bench/sanitize.py
# (run as `python -m bench.sanitize` from the repository root):
#
#     bench/sanitize.sh                      # every winner, every tool
#     bench/sanitize.sh --op layernorm --limit 2
#     TOOLS="memcheck racecheck" bench/sanitize.sh
#
# Exits non-zero when any tool found an error or any gate failed.
set -u -o pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"  # `python -m` puts the root first on the path: bench and mage_gen from this checkout
PYTHON="${PYTHON:-python3}"
RESULTS="${RESULTS:-bench/results/h200}"
read -r -a TOOL_LIST <<< "${TOOLS:-memcheck racecheck synccheck initcheck}"

SANITIZER="$(command -v compute-sanitizer || true)"
if [[ -z "$SANITIZER" && -x /usr/local/cuda/bin/compute-sanitizer ]]; then
    SANITIZER=/usr/local/cuda/bin/compute-sanitizer
fi
if [[ -z "$SANITIZER" ]]; then
    echo "sanitize.sh: compute-sanitizer is not on PATH (it comes with the CUDA toolkit)" >&2
    exit 2
fi
mkdir -p "$RESULTS"

summaries=()
worst=0
for tool in "${TOOL_LIST[@]}"; do
    log="$RESULTS/sanitizer_$tool.txt"
    echo "== $tool: $SANITIZER --tool $tool --error-exitcode 1 $PYTHON -m bench.sanitize ${*@Q}"
    "$SANITIZER" --tool "$tool" --error-exitcode 1 "$PYTHON" -m bench.sanitize "$@" 2>&1 | tee "$log"
    code=${PIPESTATUS[0]}
    # The tool's own verdict and the gate's, so that exit code 1 (tool error or failed gate) can be told apart.
    errors="$(grep -oE '(ERROR|RACECHECK) SUMMARY: .*' "$log" | tail -n 1)"
    gates="$(grep '^sanitize: ' "$log" | tail -n 1)"
    summaries+=("$tool: exit $code; ${errors:-no ERROR SUMMARY line}; ${gates:-no gate summary line} ($log)")
    (( code > worst )) && worst=$code
done

echo "== summary"
printf '%s\n' "${summaries[@]}"
exit "$worst"
