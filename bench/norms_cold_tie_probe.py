"""RMSNorm rows where the stored kernel and Inductor tie cold: the same comparison as bench/norms.py, at four times
the rounds its runs of norms §23 took (as many as it takes since), with other kernels timed beside the stored one.

In bench/norms.py's runs the stored kernels lead Inductor hot by 0.1-0.5% at RMSNorm 16384×8192 and with the
residual at 32768×4096 and 16384×8192, while their cold ratios land either side of 1.000 from run to run (1.0016,
0.998; 1.0003, 0.998; 0.999, 1.0003: bench/NOTES.md, norms §23), each of the 20 samples a kernel takes per method
spread over four placements. Here every subject takes 80 per method (20 at each placement), so that a cold ratio's
draw is half as wide, and the kernels the tuner's finalists were drawn from run beside the stored one in the same
rounds: Inductor's shape at the other thread count, the weights read late or asked of L2, `row` (the row read once,
held in registers) asking 1-3 MB ahead. Each kernel gated at every placement before it is timed. Writes
bench/results/<gpu>/norms_cold_tie_probe.json. The set `outside`: shapes of `wide` and `row` the long preset does
not hold (8-byte accesses, 1024 threads, 3 blocks per SM), to norms_cold_tie_outside_probe.json.

    python bench/norms_cold_tie_probe.py
    python bench/norms_cold_tie_probe.py outside
"""
import dataclasses
import json
import sys

sys.path.insert(0, "bench")
from _common import provenance, stored_case, write_result
from norms import PLACEMENTS, ROUNDS, bench_shape

from mage_gen.errors import ConfigError

WIDE = {"template": "wide", "vector": 16, "hint": "keep_unreleased", "min_blocks": 4, "hold": "float",
        "l2_ahead": 0, "grid_cap": 0, "rows_per_block": 1}
ROW = {"template": "row", "threads": 512, "vector": 16, "hint": "nc", "weights": "l2", "min_blocks": 1,
       "hold": "float", "grid_cap": 0, "rows_per_block": 1}
def _wide(threads: int, vector: int = 16, blocks: int = 4, weights: str = "l2", ahead_kb: int = 0) -> dict:
    return {**WIDE, "threads": threads, "vector": vector, "min_blocks": blocks, "weights": weights,
            "l2_ahead": ahead_kb}


# (op, residual, rows, d, contenders as full changes to the stored winner's params)
FIRST = (
    ("rmsnorm", False, 16384, 8192, {
        "wide t512 wl2": _wide(512),
        "wide t256 late": _wide(256, weights="late"),
        "wide t256 wl2 ahead1024k": _wide(256, ahead_kb=1024),
        "row t512 wl2 ahead2048k": {**ROW, "l2_ahead": 2048},
    }),
    ("rmsnorm", True, 32768, 4096, {
        "wide t512 wl2": _wide(512),
        "wide t256 wl2": _wide(256),
        "row t512 wl2 ahead1024k": {**ROW, "l2_ahead": 1024},
        "row t512 wl2 ahead2048k": {**ROW, "l2_ahead": 2048},
    }),
    ("rmsnorm", True, 16384, 8192, {
        "wide t512 wl2": _wide(512),
        "wide t256 wl2": _wide(256),
        "row t512 wl2 ahead1024k": {**ROW, "l2_ahead": 1024},
        "row t512 wl2 ahead3072k": {**ROW, "l2_ahead": 3072},
    }),
)


# Shapes of `wide` outside the long preset (16-byte accesses, at most 512 threads): 8-byte accesses (Inductor's
# 2048-element chunks over 16 warps are 4 elements a thread), 1024 threads, 3 blocks per SM, where at 4 blocks of 512
# threads the residual form's row of 8192 spills; and `row`'s 512 threads held packed or 1024 threads
OUTSIDE = (
    ("rmsnorm", False, 16384, 8192, {
        "wide t512 v8 b4": _wide(512, 8),
        "wide t1024 v16 b2": _wide(1024, blocks=2),
    }),
    ("rmsnorm", True, 32768, 4096, {
        "wide t512 wl2": _wide(512),
        "wide t512 v8 b4": _wide(512, 8),
        "wide t512 b3": _wide(512, blocks=3),
        "wide t1024 v8 b2": _wide(1024, 8, 2),
        "wide t384 b4": _wide(384),
    }),
    ("rmsnorm", True, 16384, 8192, {
        "wide t1024 v16 b2": _wide(1024, blocks=2),
        "wide t1024 v8 b2": _wide(1024, 8, 2),
        "wide t512 b3": _wide(512, blocks=3),
        "wide t512 v8 b3": _wide(512, 8, 3),
        "wide t384 v8 b4": _wide(384, 8),
        "row t512 packed b3": {**ROW, "hold": "packed", "min_blocks": 3, "l2_ahead": 2048},
        "row t1024 b2": {**ROW, "threads": 1024, "min_blocks": 2, "l2_ahead": 2048},
    }),
)
SETS = {"first": (FIRST, "norms_cold_tie_probe.json"), "outside": (OUTSIDE, "norms_cold_tie_outside_probe.json")}


def ratios_to(row: dict, peer: str) -> dict:
    """Each kernel's median over the peer's, pooled and at each placement, per method."""
    times, placed = row["timings"], row["by_placement"]
    kernels = ["mage-gen", *(n for n in row.get("contenders", {}) if n in times)]
    return {name: {method: {"pooled": times[name][method]["median_us"] / times[peer][method]["median_us"],
                            "by_placement": [a / b for a, b in zip(placed[name][method], placed[peer][method])]}
                   for method in ("hot", "cold")} for name in kernels}


def main() -> None:
    cases, filename = SETS[sys.argv[1] if len(sys.argv) > 1 else "first"]
    doc, device = {"what": __doc__.split("\n\n")[0], "rounds": ROUNDS, "placements": PLACEMENTS, "rows": {}}, None
    for op_name, residual, m, d, changes in cases:
        device, op, shape, _, stored = stored_case(op_name, m, d, residual=residual)
        label = f"{op_name}{'+res' if residual else ''}:{m}x{d}"
        contenders = {}
        for name, change in changes.items():
            params = dataclasses.replace(stored, **change)
            try:
                op.validate(shape, params)
            except ConfigError as e:
                print(f"{label} {name}: {e}", flush=True)
                continue
            if params != stored and params not in contenders.values():
                contenders[name] = params
        row = bench_shape(op, shape, m, stored, device, contenders=contenders, rounds=ROUNDS)
        if "timings" not in row:
            print(f"{label}: the stored kernel failed its gate: {row['gate']['reason']}", flush=True)
            doc["rows"][label] = row
            continue
        row["ratio_to_inductor"] = ratios_to(row, "inductor") if "inductor" in row["timings"] else None
        doc["rows"][label] = row
        t = row["timings"]
        for name in ["mage-gen", *row.get("contenders", {})]:
            if name not in t:
                print(f"{label:22} {name:26} not timed: {row['contenders'][name].get('failed', 'missing')}", flush=True)
                continue
            r = row["ratio_to_inductor"][name] if row["ratio_to_inductor"] else None
            print(f"{label:22} {name:26} hot {t[name]['hot']['median_us']:7.2f}±{t[name]['hot']['spread_us']:.2f} "
                  f"cold {t[name]['cold']['median_us']:7.2f}±{t[name]['cold']['spread_us']:.2f}"
                  + (f"  × Inductor hot {r['hot']['pooled']:.4f} cold {r['cold']['pooled']:.4f} (at the placements "
                     + " ".join(f"{v:.4f}" for v in r['cold']['by_placement']) + ")" if r else ""), flush=True)
        for peer in ("inductor", "triton", "torch", "floor:copy"):
            if peer in t:
                print(f"{label:22} {peer:26} hot {t[peer]['hot']['median_us']:7.2f}±{t[peer]['hot']['spread_us']:.2f} "
                      f"cold {t[peer]['cold']['median_us']:7.2f}±{t[peer]['cold']['spread_us']:.2f}", flush=True)
    doc.update(provenance(device))
    write_result(device, filename, json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
