#!/usr/bin/env bash
# Nsight Compute's speed-of-light, occupancy, launch, warp-state and memory sections for one bf16 norm kernel
# at 16384×8192 (bench/ncu/norm_target.py), as CSV under $RESULTS (default bench/results/h200/ncu). Clocks
# are left alone. Run from the repository root on the GPU machine:
#
#     bench/ncu/norm.sh ln_t256 ours layernorm '{"template": "row", "threads": 256, "vector": 16}'
#     bench/ncu/norm.sh tri_ln_w8 triton layernorm 8
set -euo pipefail
NAME="$1"; shift
RESULTS="${RESULTS:-bench/results/h200/ncu}"
mkdir -p "$RESULTS"
ncu --clock-control none --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
    --section MemoryWorkloadAnalysis -k regex:norm -s 3 -c 1 --csv --page details \
    python3 -m bench.ncu.norm_target "$@" > "$RESULTS/norm_16384x8192_bf16_$NAME.csv"
