"""Norms: at the shapes where a peer is still faster hot, the stored winner against configs shaped like that peer.

norms.json (§13) leaves RMSNorm 4096×8192 hot at 1.023× Triton (num_warps 8: 256 threads a row, four 16-byte
loads a thread, plain loads, no prefetch, ptxas free with registers) and the layer norm 65536×768 hot at 1.004×
Inductor; the layer norm 4096×8192 is the other short launch at d = 8192. For each, the stored winner and configs
of the same template closer to the peer's kernel (its threads a row, plain loads, no launch bounds, with and
without the prefetch), gated, then timed hot and cold, interleaved with torch, Inductor and Triton (each gated on
the same inputs) on one copy of the inputs, beside the copy of the same bytes.
Writes bench/results/<gpu>/norms_peer_shape_probe.json.

    python bench/norms_peer_shape_probe.py
"""
import dataclasses
import json
import sys

sys.path.insert(0, "bench")
from _beside_copy import build_named, time_beside_copy
from _common import winner_params, write_result

from mage_gen import gpu
from mage_gen.ops import get_op

TRITON_ROW = dict(threads=256, hint="none", min_blocks=1, l2_ahead=0)
# (op, residual, m, d): overrides of the stored winner's params, by name
SHAPES = {
    ("rmsnorm", False, 4096, 8192): {
        "t256 plain": TRITON_ROW,
        "t256 plain ahead": {**TRITON_ROW, "l2_ahead": 2048},
        "t256 nc b4 ahead": dict(threads=256, min_blocks=4, l2_ahead=2048),
        "t512 plain b1": dict(hint="none", min_blocks=1, l2_ahead=0),
    },
    ("layernorm", False, 4096, 8192): {
        "t256 plain": TRITON_ROW,
        "t256 plain ahead": {**TRITON_ROW, "l2_ahead": 2048},
        "t256 nc b4 ahead": dict(threads=256, min_blocks=4, l2_ahead=2048),
    },
    ("layernorm", False, 65536, 768): {
        "ahead0": dict(l2_ahead=0),
        "plain": dict(hint="none"),
        "row t32": dict(template="row", rows_per_block=1),
        "row t64": dict(template="row", rows_per_block=1, threads=64),
    },
}


def probe(device, key: tuple, others: dict) -> dict:
    op_name, residual, m, d = key
    op = get_op(op_name)
    shape, run = op.shape(d=d, dtype="bf16", residual=residual), {"m": m}
    stored = winner_params(op, shape, device, False, [], run=run)
    label = f"{op.name}{'+res' if residual else ''} {m}x{d}"
    configs = {"stored": stored, **{name: dataclasses.replace(stored, **changes) for name, changes in others.items()}}
    variants = build_named(op, shape, configs, device.arch, label)
    return {"op": op_name, "residual": residual, "m": m, "d": d,
            "configs": {n: op.params_to_dict(v.params) for n, v in variants.items()},
            "kernels": {n: v.source.kernel_name for n, v in variants.items()},
            "census": {n: {"registers": v.census.registers, "spill_bytes": v.census.spill_bytes}
                       for n, v in variants.items()},
            **time_beside_copy(op, shape, run, variants, label, seed=m + d, peers=True)}


def main() -> None:
    device = gpu.open_device()
    rows = [probe(device, key, others) for key, others in SHAPES.items()]
    doc = {"what": __doc__.split("\n\n")[0], "dtype": "bfloat16", "rows": rows}
    write_result(device, "norms_peer_shape_probe.json", json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
