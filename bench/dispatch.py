"""The dispatch table's regret: for d in {768, 1024, 4096} and M from 1 row to 262144 (where x fits in a
gigabyte), every tuned size class of d timed at that M beside the one mage_gen.dispatch picks, Triton at
its best num_warps and torch, hot and cold, interleaved. regret = dispatched / best tuned class at that M
(hot and cold each); a dispatched class within the best one's spread is a tie. Classes whose winners are one
kernel are timed once, as that kernel: the same launch twice would only measure the noise between them.
Writes bench/results/<gpu>/dispatch.json.

    python -m bench.dispatch
"""

from __future__ import annotations

import json
import sys

from mage_gen import gpu
from mage_gen.dispatch import RULE, regime
from mage_gen.measure import Bench, interleave
from mage_gen.ops import get_op
from mage_gen.peers import make_peers
from mage_gen.store import load_winner, load_winners
from mage_gen.variants import build

from bench._common import provenance, timing_method, write_result

DS = (768, 1024, 4096)
MS = (1, 37, 512, 4096, 16384, 65536, 262144)
MAX_ELEMENTS = 1 << 28  # x of at most 1 GB: the float64 reference of the timing inputs is built on the CPU
ROUNDS, PER_ROUND = 12, 6  # more than the other benches: cold launches of a few rows are noisy


def bench_point(op, d: int, m: int, device) -> dict:
    shape, run = op.shape(d=d), {"m": m}
    winners = load_winners(op, shape, device.name)
    dispatched = load_winner(op, shape, device.name, run, l2_bytes=device.l2_bytes)
    bench = Bench(op, shape, run, seed=m * 7 + d)
    subjects, kernels, failed = [], [], {}
    variants = {w.key: build(op, shape, w.params, device.arch) for w in winners}
    kernel_of = {key: v.source.kernel_name for key, v in variants.items()}
    if len({v.source.text for v in variants.values()}) != len(set(kernel_of.values())):
        raise SystemExit(f"d={d}: two tuned classes differ in source but share a kernel name: {kernel_of}")
    try:
        for variant in {v.source.kernel_name: v for v in variants.values()}.values():
            kernel = bench.load(variant)
            kernels.append(kernel)
            subject, checked = bench.checked_subject(variant, kernel, name=f"kernel:{variant.source.kernel_name}")
            if subject is None:
                failed[variant.source.kernel_name] = checked.reason
            else:
                subjects.append(subject)
        peers, missing = make_peers(op, shape, run, bench.timing_inputs(), None, check=bench.check_tensor)
        everyone = [*subjects, *peers]
        hot = interleave(everyone, "hot", ROUNDS, PER_ROUND)
        cold = interleave(everyone, "cold", ROUNDS, PER_ROUND)
    finally:
        for s in subjects:
            s.close()
        for k in kernels:
            k.unload()
    point = {"m": m, "d": d, "regime": regime(op, shape, run, device.l2_bytes), "dispatched": dispatched.key,
             "classes": {w.key: {"kernel": kernel_of[w.key], "tuned_at": w.run} for w in winners},
             "failed": failed, "peers_missing": missing, "peer_configs": {p.name: p.config for p in peers},
             "timings": {name: {"hot": hot[name].to_dict(), "cold": cold[name].to_dict()} for name in hot}}
    mine = f"kernel:{kernel_of[dispatched.key]}"
    for method, table in (("hot", hot), ("cold", cold)):
        tuned = {name: t for name, t in table.items() if name.startswith("kernel:")}
        if mine not in tuned:
            continue
        best = min(tuned, key=lambda name: tuned[name].median_us)
        point[f"{method}_best_kernel"] = best.removeprefix("kernel:")
        point[f"{method}_best_classes"] = [key for key, name in kernel_of.items() if f"kernel:{name}" == best]
        point[f"{method}_regret"] = tuned[mine].median_us / tuned[best].median_us
        point[f"{method}_regret_tie"] = tuned[mine].ties_with(tuned[best])
        point[f"{method}_ratio"] = {p.name: tuned[mine].median_us / table[p.name].median_us for p in peers}
    return point


def main() -> None:
    op = get_op("layernorm")
    device = gpu.open_device()
    points = [bench_point(op, d, m, device) for d in DS for m in MS if m * d <= MAX_ELEMENTS]
    regrets = [p[f"{k}_regret"] for p in points for k in ("hot", "cold") if f"{k}_regret" in p]
    doc = {
        "what": "layer norm size-class dispatch: the dispatched tuned class against every tuned class of d at "
                "each M, and the peers, fp32, recorded by bench/dispatch.py",
        "method": {"rule": RULE, "regret": "dispatched class median / fastest tuned class median at that M, "
                                           "hot and cold each; *_regret_tie: within the larger spread; "
                                           "classes sharing a kernel are timed once, as that kernel",
                   "gate": "every class and peer checked at M rows of the timing inputs (on the GPU) before it "
                           "is timed; classes also gated on fresh inputs at the op's gate sizes",
                   **timing_method(ROUNDS, PER_ROUND)},
        **provenance(device),
        "points": points,
        "summary": {"max_regret": max(regrets) if regrets else None,
                    "points_over_1_03": [f"{p['m']}x{p['d']} {k}" for p in points for k in ("hot", "cold")
                                         if p.get(f"{k}_regret", 1) > 1.03 and not p.get(f"{k}_regret_tie")]},
    }
    out = write_result(device, "dispatch.json", json.dumps(doc, indent=1) + "\n")
    print(f"{'M×d':>12} {'regime':6} {'dispatched':24} {'hot':>7} {'regret':>6} {'cold':>7} {'regret':>6} "
          f"{'triton':>7} {'torch':>7}")
    for p in points:
        t = p["timings"].get(f"kernel:{p['classes'][p['dispatched']]['kernel']}")
        if t is None:
            print(f"{p['m']:>6}x{p['d']:<5} {p['regime']:6} {p['dispatched']:24} FAILED: {p['failed']}")
            continue
        print(f"{p['m']:>6}x{p['d']:<5} {p['regime']:6} {p['dispatched']:24} {t['hot']['median_us']:7.2f} "
              f"{p['hot_regret']:6.3f} {t['cold']['median_us']:7.2f} {p['cold_regret']:6.3f} "
              f"{p['timings'].get('triton', {}).get('hot', {}).get('median_us', float('nan')):7.2f} "
              f"{p['timings'].get('torch', {}).get('hot', {}).get('median_us', float('nan')):7.2f}")
    print(json.dumps(doc["summary"]))
    print(f"wrote {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
