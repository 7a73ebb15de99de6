"""The two modes of a cold sample: how far apart, how often the slow one, against how long the launch runs.

bench/NOTES.md, norms §25: at the norms' DRAM-bound rows every subject's cold samples, the copy of the same bytes
among them, fall in a fast mode and one 1.0-2.5 µs slower that a third to a half of them land in, and a median of
such samples moves with the share it drew. Here the copy alone (torch's `copy_`, as the floor times it, the same
cold sample as every subject: persisting lines reset, a hold, 256 MB written, the launch) of buffers of 8 to 512 MB
moved, interleaved in rounds, every sample kept. A stall of its own length that comes at a steady rate shows as a
distance between the modes that stays put while the slow share grows with the launch's length; a cost of the
launch's own work, as a distance that grows with it. Writes bench/results/<gpu>/cold_modes_probe.json.

    python bench/cold_modes_probe.py
    python bench/cold_modes_probe.py --of bench/results/h200/norms_cold_spread_probe.json   # its samples' modes
"""
import json
import sys

import numpy as np
import torch

sys.path.insert(0, "bench")
from _common import provenance, write_result

from mage_gen import gpu
from mage_gen.measure import interleave_rounds
from mage_gen.peers import TorchSubject

MOVED_MB = (8, 16, 32, 64, 128, 256, 512)  # read and written, half each
ROUNDS, PER_ROUND = 100, 5
BIN_US = 0.25
SEPARATION = 4.0


def modes(samples: np.ndarray) -> dict:
    """The samples over their 5th percentile, binned, and split in two where the split leaves the least spread
    within the two parts (Otsu's threshold); a split counts as two modes where their medians lie more than
    SEPARATION times the wider part's standard deviation apart."""
    base = float(np.percentile(samples, 5))
    excess = np.sort(samples - base)
    counts, edges = np.histogram(excess, bins=np.arange(-2 * BIN_US, excess.max() + 2 * BIN_US, BIN_US))
    best, split = -1.0, None
    for i in range(max(1, len(excess) // 20), len(excess) - max(1, len(excess) // 20)):
        low, high = excess[:i], excess[i:]
        between = len(low) * len(high) * (high.mean() - low.mean()) ** 2
        if between > best:
            best, split = between, i
    fast, slow = excess[:split], excess[split:]
    apart = float(np.median(slow) - np.median(fast)) > SEPARATION * max(fast.std(), slow.std())
    if not apart:
        fast, slow = excess, excess[:0]
    return {"p5_us": round(base, 3), "histogram_over_p5": {"bin_us": BIN_US, "first_edge_us": float(edges[0]),
                                                           "counts": counts.tolist()},
            "two_modes": bool(apart), "slow_share": round(len(slow) / len(samples), 3),
            "fast_median_over_p5_us": round(float(np.median(fast)), 3),
            "slow_median_over_p5_us": round(float(np.median(slow)), 3) if len(slow) else None}


def modes_of(path: str) -> None:
    """The modes of the cold samples a norms_cold_spread_probe.json kept (no GPU)."""
    for label, row in json.loads(open(path).read())["rows"].items():
        for name, rounds in row.get("cold_samples", {}).items():
            r = modes(np.array([v for by in rounds for v in by]))
            print(f"{label:22} {name:13} p5 {r['p5_us']:8.2f} two modes {r['two_modes']!s:5} slow share "
                  f"{r['slow_share']:.2f} fast / slow mode over p5 {r['fast_median_over_p5_us']:.2f} / "
                  f"{r['slow_median_over_p5_us']}")


def main() -> None:
    if sys.argv[1:2] == ["--of"]:
        return modes_of(sys.argv[2])
    device = gpu.open_device()
    subjects = []
    for mb in MOVED_MB:
        n = (mb << 20) // 2 // 4
        src, dst = torch.randn(n, device="cuda"), torch.empty(n, device="cuda")
        subjects.append(TorchSubject(f"copy {mb} MB", lambda s=src, d=dst: d.copy_(s), {"moved_mb": mb}))
    for s in subjects:
        s.cold(2)  # first launches out of the way
    taken = interleave_rounds([subjects], "cold", ROUNDS, PER_ROUND)
    rows = {}
    for s in subjects:
        values = np.array([v for by in taken for v in by[s.name]])
        rows[s.name] = {"samples": len(values), "median_us": round(float(np.median(values)), 3), **modes(values),
                        "samples_us": [round(float(v), 3) for v in values]}
        r = rows[s.name]
        print(f"{s.name:12} median {r['median_us']:8.2f} p5 {r['p5_us']:8.2f} slow share {r['slow_share']:.2f} "
              f"fast / slow mode over p5 {r['fast_median_over_p5_us']:.2f} / {r['slow_median_over_p5_us']} "
              f"histogram {r['histogram_over_p5']['counts']}", flush=True)
    doc = {"what": __doc__.split("\n\n")[0], "rounds": ROUNDS, "per_round": PER_ROUND, "copies": rows,
           **provenance(device)}
    write_result(device, "cold_modes_probe.json", json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
