#!/usr/bin/env bash
# Nsight Compute's full set for one matmul kernel at 2048³ and for cuBLAS's, raw metrics as CSV under
# $RESULTS (default bench/results/h200/ncu); `python -m bench.ncu.summary` reads them. Clocks are left alone
# (--clock-control none). Run from the repository root on the GPU machine:
#
#     bench/ncu/matmul.sh NAME '{"bm": 128, "bn": 128, "bk": 16, "tm": 16, "tn": 8, ...}'
#     bench/ncu/matmul.sh cublas_2048 cublas
#     SHAPE=4096,4096,4096 bench/ncu/matmul.sh tc_bf16_4096 winner bf16     (the tensor-core op's tuned winner)
#     SHAPE=4096,4096,4096 bench/ncu/matmul.sh cublas_bf16_4096 cublas bf16
#     OP=gemm_sm90 SHAPE=16,4096,4096 bench/ncu/matmul.sh sm90_m16 winner       (the Hopper GEMM's serving entry)
#     OP=gemm_sm90 SHAPE=16,4096,4096 KERNELS=2 bench/ncu/matmul.sh cublas_m16 cublas   (F.linear's kernels)
# KERNELS: how many kernels to profile (cuBLAS may follow a split-K product with a kernel that sums it).
set -euo pipefail
NAME="$1"; PARAMS="$2"; PRECISION="${3:-}"; SHAPE="${SHAPE:-2048,2048,2048}"; OP="${OP:-}"
RESULTS="${RESULTS:-bench/results/h200/ncu}"
mkdir -p "$RESULTS"
if [[ "$PARAMS" == cublas && -n "$OP" ]]; then
    FILTER=(-k "regex:nvjet|gemm|splitK|reduce" -s 2)
elif [[ -n "$OP" ]]; then
    FILTER=(-k "regex:$OP" -s 1)
elif [[ "$PARAMS" == cublas && -z "$PRECISION" ]]; then
    FILTER=(-k regex:Kernel2 -s 2)  # cuBLAS names its FP32 kernel Kernel2<cutlass_80_simt_sgemm_...>
elif [[ "$PARAMS" == cublas ]]; then
    FILTER=(-k "regex:nvjet|gemm" -s 2)  # its tensor-core kernels: nvjet_sm90_... (bf16 at 4096³) or ..._gemm_...
elif [[ -n "$PRECISION" ]]; then
    FILTER=(-k regex:matmul_tc -s 1)
else
    FILTER=(-k regex:matmul_m -s 1)
fi
ncu --clock-control none --set full -c "${KERNELS:-1}" "${FILTER[@]}" --export "$RESULTS/$NAME" \
    python3 -m bench.ncu.matmul_target "$SHAPE" "$PARAMS" $PRECISION ${OP:+--op "$OP"}
ncu -i "$RESULTS/$NAME.ncu-rep" --page raw --csv > "$RESULTS/$NAME.csv"
rm -f "$RESULTS/$NAME.ncu-rep"
