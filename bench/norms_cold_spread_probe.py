"""How the cold samples of the two rows that tie Inductor cold are spread: bench/norms.py's comparison at twice its
rounds, every sample kept with its round and its place among the round's launches.

In bench/norms.py's sweeps the stored kernels at RMSNorm 16384×8192 and with the residual at 4096×4096 lead Inductor
hot and tie it cold, and their cold samples spread wider than Inductor's (interquartile range 1.91 against 0.99 µs,
1.18 against 0.43: bench/NOTES.md, norms §25). A wider spread about a like median is a kernel whose cold launches
differ from one another: some slow launches among fast ones (which place in the round, which placement), or one
broad spread. The weights read late (no bulk prefetch of w by the first block) run beside the stored kernel in the
same rounds. Writes bench/results/<gpu>/norms_cold_spread_probe.json.

    python bench/norms_cold_spread_probe.py
"""
import dataclasses
import json
import sys

import numpy as np

sys.path.insert(0, "bench")
from _common import provenance, stored_case, write_result
from norms import PER_ROUND, PLACEMENTS, ROUNDS, bench_shape

ROWS = (("rmsnorm", False, 16384, 8192), ("rmsnorm", True, 4096, 4096))
PROBE_ROUNDS = 2 * ROUNDS
SHOWN = ("mage-gen", "weights late", "inductor", "triton", "floor:copy")


def spread(samples_by_round: list[dict[str, list[float]]], name: str) -> dict:
    every = np.array([v for by in samples_by_round for v in by[name]])
    by_place = np.array([by[name] for by in samples_by_round])  # rounds × the round's launches
    return {"percentiles_5_25_50_75_95": [round(float(v), 3) for v in np.percentile(every, [5, 25, 50, 75, 95])],
            "median_by_launch_in_round": [round(float(v), 3) for v in np.median(by_place, axis=0)],
            "median_by_placement": [round(float(np.median(by_place[p::PLACEMENTS])), 3) for p in range(PLACEMENTS)],
            "round_medians": [round(float(v), 3) for v in np.median(by_place, axis=1)]}


def main() -> None:
    doc, device = {"what": __doc__.split("\n\n")[0], "rounds": PROBE_ROUNDS, "per_round": PER_ROUND,
                   "placements": PLACEMENTS, "rows": {}}, None
    for op_name, residual, m, d in ROWS:
        device, op, shape, _, stored = stored_case(op_name, m, d, residual=residual)
        label = f"{op_name}{'+res' if residual else ''}:{m}x{d}"
        contenders = {}
        if stored.weights != "late":
            contenders["weights late"] = dataclasses.replace(stored, weights="late")
        row = bench_shape(op, shape, m, stored, device, contenders=contenders, rounds=PROBE_ROUNDS, keep_samples=True)
        if "timings" not in row:
            print(f"{label}: the stored kernel failed its gate: {row['gate']['reason']}", flush=True)
            doc["rows"][label] = {"gate": row["gate"]}
            continue
        doc["rows"][label] = {
            "kernel": row["kernel"], "contenders": row.get("contenders"),
            "cold_round_ratio_to_best_peer": row["cold_round_ratio_to_best_peer"],
            "cold": {name: spread(row["samples"]["cold"], name) for name in SHOWN if name in row["timings"]},
            "hot": {name: spread(row["samples"]["hot"], name) for name in SHOWN if name in row["timings"]},
            "cold_samples": {name: [by[name] for by in row["samples"]["cold"]] for name in SHOWN
                             if name in row["timings"]},
        }
        for name, s in doc["rows"][label]["cold"].items():
            print(f"{label:22} {name:13} cold p5/25/50/75/95 {s['percentiles_5_25_50_75_95']} by launch in round "
                  f"{s['median_by_launch_in_round']} by placement {s['median_by_placement']}", flush=True)
        print(f"{label:22} cold rounds' ratio to the best peer {row['cold_round_ratio_to_best_peer']}", flush=True)
    doc.update(provenance(device))
    write_result(device, "norms_cold_spread_probe.json", json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
