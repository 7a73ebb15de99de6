"""Norms: the prefetch at evict-last, as the template builds it (rows released once read), at every DRAM-bound class.

norms_cache_policy_probe.json found the prefetch at evict-last faster at every shape it timed; those kernels left
what they asked for at evict-last in L2, past the cold flush (norms_evict_last_residue_probe.json), so their cold
gains were not measured fairly. The template's `ahead_priority` last gives every line of a block's rows normal
priority again after its output. For each DRAM-bound shape of bench/norms.py, the stored winner that serves it
(prefetch at l2_ahead as stored, or 2 MB where it has none) at ahead_priority normal and last: gated, then timed
hot and cold, interleaved, on one copy of the inputs beside the copy of the same bytes.
Writes bench/results/<gpu>/norms_ahead_priority_probe.json.

    python bench/norms_ahead_priority_probe.py
"""
import dataclasses
import json
import sys

sys.path.insert(0, "bench")
from _beside_copy import time_beside_copy
from _common import geomean, winner_params, write_result
from norms import DRAM_L2S, DTYPE, OPS, SHAPES

from mage_gen import gpu
from mage_gen.ops import get_op
from mage_gen.variants import build

AHEAD_KB_WHERE_NONE = 2048


def probe(device, op, shape, m: int) -> dict:
    run = {"m": m}
    stored = winner_params(op, shape, device, False, [], run=run)
    base = stored if stored.l2_ahead else dataclasses.replace(stored, l2_ahead=AHEAD_KB_WHERE_NONE)
    label = f"{op.name}{'+res' if shape.residual else ''} {m}x{shape.d}"
    variants = {p: build(op, shape, dataclasses.replace(base, ahead_priority=p), device.arch)
                for p in ("normal", "last")}
    row = {"op": op.name, "residual": shape.residual, "m": m, "d": shape.d,
           "stored": op.params_to_dict(stored), "l2_ahead_kb": base.l2_ahead,
           "kernels": {p: v.source.kernel_name for p, v in variants.items()},
           **time_beside_copy(op, shape, run, variants, label, seed=m + shape.d)}
    t = row["timings"]
    if "normal" in t and "last" in t:
        row["last_over_normal"] = {meth: t["last"][meth]["median_us"] / t["normal"][meth]["median_us"]
                                   for meth in ("hot", "cold")}
    return row


def main() -> None:
    device = gpu.open_device()
    rows = []
    for name in OPS:
        op = get_op(name)
        for residual in (False, True):
            for m, d in SHAPES:
                shape = op.shape(d=d, dtype=DTYPE, residual=residual)
                if op.bytes_moved(shape, {"m": m}) >= DRAM_L2S * device.l2_bytes:
                    rows.append(probe(device, op, shape, m))
    paired = [r["last_over_normal"] for r in rows if "last_over_normal" in r]
    doc = {"what": __doc__.split("\n\n")[0], "dtype": DTYPE, "rows": rows,
           "geomean_last_over_normal": {meth: geomean([p[meth] for p in paired]) for meth in ("hot", "cold")}}
    print(f"last over normal, geomean: {doc['geomean_last_over_normal']}", flush=True)
    write_result(device, "norms_ahead_priority_probe.json", json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
