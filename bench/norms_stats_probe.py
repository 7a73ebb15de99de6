"""Norms: does one row-wide reduction (stats 'shifted') beat the two of the layer norm's winners?

Each bf16 layer-norm shape of bench/norms.py, with and without the residual: the tuned winner and the same config
with stats 'shifted' (sums of x − k and (x − k)² about the row's first element, one barrier), each gated, then
timed hot and cold, interleaved, on one copy of the inputs beside the copy of the same x. RMSNorm, one
statistic and one reduction already, is the yardstick: at the d = 8192 rows the layer norm sits 2–4% further
from the copy than RMSNorm does (norms_tail_probe.json). Writes bench/results/<gpu>/norms_stats_probe.json.

    python bench/norms_stats_probe.py
"""
import dataclasses
import json
import sys

sys.path.insert(0, "bench")
from _beside_copy import time_beside_copy
from _common import write_result

from mage_gen import gpu
from mage_gen.errors import ConfigError
from mage_gen.ops import get_op
from mage_gen.store import load_winner
from mage_gen.variants import build

SHAPES = ((4096, 768), (4096, 4096), (4096, 8192), (65536, 768), (32768, 4096), (16384, 8192))


def probe(device, op, m: int, d: int, residual: bool) -> dict:
    shape, run = op.shape(d=d, dtype="bf16", residual=residual), {"m": m}
    winner = load_winner(op, shape, device.name, run, l2_bytes=device.l2_bytes).params
    configs = {"winner": winner}
    try:
        shifted = dataclasses.replace(winner, stats="shifted")
        op.validate(shape, shifted)
        configs["shifted"] = shifted
    except ConfigError as exc:
        print(f"{op.name} {m}x{d}: no shifted form of the winner ({exc})", flush=True)
    variants = {name: build(op, shape, params, device.arch) for name, params in configs.items()}
    label = f"{op.name}{'+res' if residual else ''} {m}x{d}"
    return {"op": op.name, "residual": residual, "m": m, "d": d,
            "kernels": {name: v.source.kernel_name for name, v in variants.items()},
            **time_beside_copy(op, shape, run, variants, label, seed=m + d)}


if __name__ == "__main__":
    device = gpu.open_device()
    op = get_op("layernorm")
    rows = [probe(device, op, m, d, residual) for residual in (False, True) for m, d in SHAPES]
    doc = {"what": __doc__.split("\n\n")[0], "dtype": "bfloat16", "rows": rows}
    write_result(device, "norms_stats_probe.json", json.dumps(doc, indent=1) + "\n")
