"""The program bench/ncu/matmul.sh profiles: one matmul config (params as JSON) built at M,N,K, gated and
timed once (so launched a few times); or, with `cublas` in place of the JSON, torch.matmul. A third argument,
a precision (bf16, tf32, fp32x3), makes it the tensor-core op matmul_tc, and `winner` in place of the JSON
takes this GPU's tuned winner for that shape; cuBLAS then runs at that precision (fp32x3: SGEMM, TF32 off).

    python -m bench.ncu.matmul_target 2048,2048,2048 '{"bm": 128, "bn": 128, ...}'
    python -m bench.ncu.matmul_target 4096,4096,4096 winner bf16
    python -m bench.ncu.matmul_target 4096,4096,4096 cublas bf16
"""

from __future__ import annotations

import json
import sys

from mage_gen import gpu
from mage_gen.measure import Bench
from mage_gen.ops import get_op
from mage_gen.store import load_winner
from mage_gen.variants import build


def run_cublas(m: int, n: int, k: int, precision: str | None) -> None:
    import torch
    torch.backends.cuda.matmul.allow_tf32 = precision == "tf32"
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    a = torch.randn(m, k, device="cuda", dtype=dtype)
    b = torch.randn(k, n, device="cuda", dtype=dtype)
    for _ in range(5):
        a @ b
    torch.cuda.synchronize()


def run_config(m: int, n: int, k: int, params_json: str, precision: str | None) -> None:
    op = get_op("matmul_tc" if precision else "matmul")
    shape = op.shape(m=m, n=n, k=k, precision=precision) if precision else op.shape(m=m, n=n, k=k)
    device = gpu.open_device()
    if params_json == "winner":
        params = load_winner(op, shape, device.name, None, l2_bytes=device.l2_bytes).params
    else:
        params = op.params_from_dict(json.loads(params_json))
    variant = build(op, shape, params, device.arch)
    ev = Bench(op, shape, {}, seed=1).evaluate(variant, hot_replays=1, cold_count=1)
    print(variant.source.kernel_name, variant.census.registers, ev.gate.passed, ev.hot.median_us if ev.hot else None)


if __name__ == "__main__":
    dims = [int(x) for x in sys.argv[1].split(",")]
    precision = sys.argv[3] if len(sys.argv) > 3 else None
    if sys.argv[2] == "cublas":
        run_cublas(*dims, precision)
    else:
        run_config(*dims, sys.argv[2], precision)
