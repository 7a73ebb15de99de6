"""Norms: is RMSNorm 4096×8192 slower than Triton hot at every placement of its inputs, or at some?

Between runs of bench/norms.py, and between a tune's final round and the bench, the same kernels and peers at
this shape move by 2–4% (norms §15): Triton's hot time 33.44–35.06 µs, the stored winner's 34.25–34.40, the
Triton-shaped config (256 threads, plain loads, no prefetch) 33.81–35.06. §10 found that the same bytes read from
another allocation take a few percent more or less. Here, in one process, the stored winner, the Triton-shaped
config and the peers, gated, then timed hot and cold, interleaved, beside the copy, on one copy of the inputs,
again for each of several placements of the inputs (a buffer of a different size held before they are
allocated). Writes bench/results/<gpu>/norms_placement_peer_probe.json.

    python bench/norms_placement_peer_probe.py
"""
import json
import sys

import torch

sys.path.insert(0, "bench")
from _beside_copy import time_beside_copy
from _common import winner_params, write_result

from mage_gen import gpu
from mage_gen.ops import get_op
from mage_gen.variants import build

PLACEMENTS_MB = (0, 37, 101, 263)  # a buffer of this size allocated, and held, before each set of inputs
TRITON_SHAPED = {"template": "row", "threads": 256, "vector": 16, "hint": "none"}


def main() -> None:
    device = gpu.open_device()
    op = get_op("rmsnorm")
    shape, run = op.shape(d=8192, dtype="bf16"), {"m": 4096}
    variants = {"stored": build(op, shape, winner_params(op, shape, device, False, [], run=run), device.arch),
                "t256 plain": build(op, shape, op.params_from_dict(TRITON_SHAPED), device.arch)}
    held, rows = [], []
    for mb in PLACEMENTS_MB:
        held.append(torch.empty(mb * 2 ** 20 + 256, dtype=torch.uint8, device="cuda"))
        row = time_beside_copy(op, shape, run, variants, f"rmsnorm 4096x8192 +{mb}MB", seed=mb + 1, peers=True)
        rows.append({"held_mb": mb, "kernels": {n: v.source.kernel_name for n, v in variants.items()}, **row})
    doc = {"what": __doc__.split("\n\n")[0], "dtype": "bfloat16", "placements_mb": PLACEMENTS_MB, "rows": rows}
    write_result(device, "norms_placement_peer_probe.json", json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
