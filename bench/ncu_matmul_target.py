"""The program bench/ncu_matmul.sh profiles: one matmul config (params as JSON) built at M,N,K, gated and
timed once (so launched a few times); or, with `cublas` in place of the JSON, torch.matmul with TF32 off.

    python bench/ncu_matmul_target.py 2048,2048,2048 '{"bm": 128, "bn": 128, ...}'
"""

from __future__ import annotations

import json
import sys

from mage_gen import gpu
from mage_gen.measure import Bench
from mage_gen.ops import get_op
from mage_gen.variants import build


def run_cublas(m: int, n: int, k: int) -> None:
    import torch
    torch.backends.cuda.matmul.allow_tf32 = False
    a = torch.randn(m, k, device="cuda")
    b = torch.randn(k, n, device="cuda")
    for _ in range(5):
        a @ b
    torch.cuda.synchronize()


def run_config(m: int, n: int, k: int, params_json: str) -> None:
    op = get_op("matmul")
    shape = op.shape(m=m, n=n, k=k)
    device = gpu.open_device()
    params = op.params_from_dict(json.loads(params_json))
    variant = build(op, shape, params, device.arch)
    ev = Bench(op, shape, {}, seed=1).evaluate(variant, hot_replays=1, cold_count=1)
    print(params.label(), variant.census.registers, ev.gate.passed, ev.hot.median_us if ev.hot else None)


if __name__ == "__main__":
    dims = [int(x) for x in sys.argv[1].split(",")]
    if sys.argv[2] == "cublas":
        run_cublas(*dims)
    else:
        run_config(*dims, sys.argv[2])
