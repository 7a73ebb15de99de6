"""Norms: how far ahead should a block ask L2 for rows, at the shapes still short of the copy or a peer?

NOTES.md norms §13 tried one prefetch per block 2, 6 and 16 MB of x ahead and found 2 MB best; the search space
holds 1, 2 and 3 MB. The shapes that bench/norms.py still finds short of the copy (cold) or of a peer (hot) are the
shortest DRAM-bound launches (4096 rows of d = 8192, about 35 µs) and the layer norm of 65536×768, whose whole
launch asks for rows only a few blocks ahead of one another: each stored winner with l2_ahead 0, 256 KB to 3 MB,
and, beside them, a few configs of other block shapes with the prefetch, each gated, then timed hot and cold,
interleaved, on one copy of the inputs beside the copy of the same bytes. Writes
bench/results/<gpu>/norms_ahead_sweep_probe.json.

    python bench/norms_ahead_sweep_probe.py
"""
import dataclasses
import json
import sys

sys.path.insert(0, "bench")
from _beside_copy import build_named, time_beside_copy
from _common import write_result

from mage_gen import gpu
from mage_gen.ops import get_op
from mage_gen.store import entry_key, shape_entries

AHEAD_KB = (0, 256, 512, 1024, 1536, 2048, 3072)
# (op, residual, m, d): other block shapes, as overrides of the stored winner's params
SHAPES = {
    ("layernorm", False, 4096, 8192): {
        "t256 shifted b4": dict(threads=256, stats="shifted", min_blocks=4, l2_ahead=2048),
        "t128 packed b6": dict(threads=128, hold="packed", min_blocks=6, l2_ahead=2048),
        "t128 early": dict(weights="early", l2_ahead=2048),
        "t256 packed b4 early": dict(threads=256, hold="packed", min_blocks=4, weights="early", l2_ahead=2048),
    },
    ("rmsnorm", False, 4096, 8192): {
        "t256 b4": dict(threads=256, min_blocks=4, l2_ahead=2048),
        "t128 packed b8": dict(threads=128, hold="packed", min_blocks=8, l2_ahead=2048),
        "t512 hint none": dict(hint="none", l2_ahead=2048),
    },
    ("layernorm", False, 65536, 768): {},
    ("rmsnorm", False, 16384, 8192): {},
}


def probe(device, key: tuple, others: dict) -> dict:
    op_name, residual, m, d = key
    op = get_op(op_name)
    shape, run = op.shape(d=d, dtype="bf16", residual=residual), {"m": m}
    entry = shape_entries(op, shape, device.name)[entry_key(op, shape, run)]
    stored = op.params_from_dict(entry["params"])
    label = f"{op.name}{'+res' if residual else ''} {m}x{d}"
    configs = {f"ahead{kb}": dataclasses.replace(stored, l2_ahead=kb) for kb in AHEAD_KB}
    configs.update({name: dataclasses.replace(stored, **changes) for name, changes in others.items()})
    variants = build_named(op, shape, configs, device.arch, label)
    row = {"op": op_name, "residual": residual, "m": m, "d": d, "stored": entry["params"],
           "configs": {n: dataclasses.asdict(v.params) for n, v in variants.items()},
           "census": {n: {"registers": v.census.registers, "spill_bytes": v.census.spill_bytes} for n, v in variants.items()},
           **time_beside_copy(op, shape, run, variants, label, seed=m + d)}
    return row


def main() -> None:
    device = gpu.open_device()
    rows = [probe(device, key, others) for key, others in SHAPES.items()]
    doc = {"what": __doc__.split("\n\n")[0], "dtype": "bfloat16", "ahead_kb": AHEAD_KB, "rows": rows}
    write_result(device, "norms_ahead_sweep_probe.json", json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
