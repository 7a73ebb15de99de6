"""RMSNorm d = 8192 bf16, hot: the stored winner against neighbours of it in hint, prefetch distance and block
shape, at both M its class serves in norms.py (4096 and 16384 rows), each at two placements of the inputs.

bench/norms.py leaves these two shapes slower than the best peer hot alone (Triton at 4096 rows, Inductor at
16384), by 1–2%, while the winner ties or beats them cold; §14's hot study found hint `stream` faster hot and
slower cold. Each config is gated, then timed hot and cold interleaved with torch, Inductor and Triton (Triton
writing the stored winner's y, as in norms.py) beside the copy of the same bytes; every shape twice, each time
on inputs allocated anew. Writes bench/results/<gpu>/norms_d8192_hot_probe.json.

    python bench/norms_d8192_hot_probe.py
"""
import dataclasses
import json
import sys

sys.path.insert(0, "bench")
from _beside_copy import build_named, time_beside_copy
from _common import provenance, winner_params, write_result

from mage_gen import gpu
from mage_gen.ops import get_op

D, ROWS, PLACEMENTS = 8192, (4096, 16384), 2
# overrides of the stored winner's params (t512, 16-byte loads, nc, 4 blocks per SM, 2 MB ahead), by name
NEIGHBOURS = {
    "plain": dict(hint="none"),
    "stream": dict(hint="stream"),
    "plain ahead0": dict(hint="none", l2_ahead=0),
    "ahead1024": dict(l2_ahead=1024),
    "plain ahead1024": dict(hint="none", l2_ahead=1024),
    "t256 plain": dict(threads=256, hint="none"),
    "t1024 b2": dict(threads=1024, min_blocks=2),
}


def main() -> None:
    device = gpu.open_device()
    op = get_op("rmsnorm")
    shape = op.shape(d=D, dtype="bf16")
    rows = []
    for m in ROWS:
        run = {"m": m}
        stored = winner_params(op, shape, device, False, [], run=run)
        configs = {"stored": stored, **{n: dataclasses.replace(stored, **c) for n, c in NEIGHBOURS.items()}}
        label = f"rmsnorm {m}x{D}"
        variants = build_named(op, shape, configs, device.arch, label)
        for placement in range(PLACEMENTS):
            rows.append({"m": m, "d": D, "placement": placement,
                         "configs": {n: op.params_to_dict(v.params) for n, v in variants.items()},
                         "kernels": {n: v.source.kernel_name for n, v in variants.items()},
                         "census": {n: {"registers": v.census.registers, "spill_bytes": v.census.spill_bytes}
                                    for n, v in variants.items()},
                         **time_beside_copy(op, shape, run, variants, f"{label} p{placement}",
                                            seed=m + D + placement, peers=True, share_outputs=True)})
    doc = {"what": __doc__.split("\n\n")[0], "dtype": "bfloat16", **provenance(device), "rows": rows}
    write_result(device, "norms_d8192_hot_probe.json", json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
