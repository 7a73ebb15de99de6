"""The program bench/ncu/matmul.sh profiles: one matmul config (params as JSON) built at M,N,K, gated and
timed once (so launched a few times); or, with `cublas` in place of the JSON, torch.matmul. A third argument,
a precision (bf16, tf32, fp32x3), makes it the tensor-core op matmul_tc, and `winner` in place of the JSON
takes this GPU's tuned winner for that shape; cuBLAS then runs at that precision (fp32x3: SGEMM, TF32 off).
`--op gemm_sm90` takes the Hopper GEMM instead (bf16, B as an nn.Linear weight, N×K; `winner`: the entry that
serves the shape, dispatch.CLASS_RULE), and cuBLAS as F.linear computes it.

    python -m bench.ncu.matmul_target 2048,2048,2048 '{"bm": 128, "bn": 128, ...}'
    python -m bench.ncu.matmul_target 4096,4096,4096 winner bf16
    python -m bench.ncu.matmul_target 4096,4096,4096 cublas bf16
    python -m bench.ncu.matmul_target 16,4096,4096 winner --op gemm_sm90
"""

from __future__ import annotations

import argparse
import json

from mage_gen import dispatch, gpu
from mage_gen.measure import Bench
from mage_gen.ops import get_op
from mage_gen.store import load_winner, tuned_shapes
from mage_gen.variants import build

SM90 = "gemm_sm90"


def run_cublas(m: int, n: int, k: int, precision: str | None, op_name: str) -> None:
    import torch
    torch.backends.cuda.matmul.allow_tf32 = precision == "tf32"
    dtype = torch.bfloat16 if precision == "bf16" or op_name == SM90 else torch.float32
    a = torch.randn(m, k, device="cuda", dtype=dtype)
    b = torch.randn(n, k, device="cuda", dtype=dtype) if op_name == SM90 else torch.randn(k, n, device="cuda",
                                                                                          dtype=dtype)
    for _ in range(5):
        torch.nn.functional.linear(a, b) if op_name == SM90 else a @ b
    torch.cuda.synchronize()


def _params(op, shape, params_json: str, device):
    if params_json != "winner":
        return op.params_from_dict(json.loads(params_json))
    if op.class_dims:
        served = dispatch.choose_class(op, shape, tuned_shapes(op, device.name))
        if served is None:
            raise SystemExit(f"ncu: no tuned {op.name} entry serves {vars(shape)}; give params as JSON")
        return served[1]
    return load_winner(op, shape, device.name, None, l2_bytes=device.l2_bytes).params


def run_config(m: int, n: int, k: int, params_json: str, precision: str | None, op_name: str) -> None:
    op = get_op(op_name)
    shape = op.shape(m=m, n=n, k=k, precision=precision) if precision else op.shape(m=m, n=n, k=k)
    device = gpu.open_device()
    variant = build(op, shape, _params(op, shape, params_json, device), device.arch)
    ev = Bench(op, shape, {}, seed=1).evaluate(variant, hot_replays=1, cold_count=1)
    print(variant.source.kernel_name, variant.census.registers, ev.gate.passed, ev.hot.median_us if ev.hot else None)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="one matmul config, or cuBLAS, for bench/ncu/matmul.sh to profile")
    parser.add_argument("shape", help="M,N,K")
    parser.add_argument("params", help="the config as JSON, winner, or cublas")
    parser.add_argument("precision", nargs="?", help="matmul_tc's precision (gemm_sm90: bf16 or e4m3)")
    parser.add_argument("--op", help="gemm_sm90; else matmul_tc where a precision is given, matmul where not")
    args = parser.parse_args()
    dims = [int(x) for x in args.shape.split(",")]
    op_name = args.op or ("matmul_tc" if args.precision else "matmul")
    if args.params == "cublas":
        run_cublas(*dims, args.precision, op_name)
    else:
        run_config(*dims, args.params, args.precision, op_name)
