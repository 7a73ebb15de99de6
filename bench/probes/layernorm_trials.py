"""Gate and time every variant of a layer-norm preset at one size, with the peers, on this GPU.

Writes bench/results/<gpu>/layernorm_trials_d<d>_m<m>.json: per variant its params, census, gate and
hot/cold timings; the peers' timings from the same process. The tuner's CPU tests replay this file.

    python -m bench.probes.layernorm_trials --d 768 --m 4096 --preset quick
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path

from mage_gen import __version__, gpu
from mage_gen.compile import nvrtc_version
from mage_gen.measure import Bench, interleave
from mage_gen.ops import get_op
from mage_gen.peers import make_peers
from mage_gen.space import expand, load_space
from mage_gen.store import gpu_slug, write_atomic
from mage_gen.variants import build_all


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--d", type=int, default=768)
    parser.add_argument("--m", type=int, default=4096)
    parser.add_argument("--preset", default="quick")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    op = get_op("layernorm")
    shape, run = op.shape(d=args.d), {"m": args.m}
    device = gpu.open_device()
    valid, rejected = expand(op, shape, load_space(op, args.preset, sms=device.sms))
    started = time.perf_counter()
    variants = build_all(op, shape, valid, device.arch)
    compile_s = time.perf_counter() - started
    bench = Bench(op, shape, run, seed=0)
    records = []
    for v in variants:
        ev = bench.evaluate(v, hot_replays=20, cold_count=20)
        records.append({"params": op.params_to_dict(v.params), "kernel": v.source.kernel_name,
                        "census": v.census.to_dict(), **ev.to_dict()})
        hot = f"{ev.hot.median_us:8.2f}" if ev.hot else "  failed"
        print(f"{v.params.label():40s} {hot}  {ev.gate.reason}", flush=True)

    inputs = op.make_inputs(shape, run, bench.rng)
    peers, missing = make_peers(op, shape, run, inputs, op.reference(shape, inputs, op.scalars(shape, run)))
    peer_hot = interleave(peers, "hot", rounds=5, per_round=6)
    peer_cold = interleave(peers, "cold", rounds=5, per_round=6)
    doc = {
        "what": "every variant of a preset gated and timed on one GPU; recorded by bench/probes/layernorm_trials.py",
        "method": {"hot": "20 launches per CUDA graph, 20 replays, median per launch, inputs L2-warm",
                   "cold": "256 MB written before each of 20 timed launches", "gate": "fresh inputs, NaN-poisoned fenced output, rows 1, 37 and m"},
        "op": op.name, "shape": {"d": args.d}, "run": run, "preset": args.preset,
        "gpu": device.to_dict(), "nvrtc": nvrtc_version(), "mage_gen": __version__,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "compile_seconds": compile_s, "rejected": len(rejected),
        "variants": records,
        "peers": {p.name: {"hot": peer_hot[p.name].to_dict(), "cold": peer_cold[p.name].to_dict(), "config": p.config}
                  for p in peers},
        "peers_missing": missing,
    }
    out = args.out or Path("bench/results") / gpu_slug(device.name) / f"layernorm_trials_d{args.d}_m{args.m}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(out, json.dumps(doc, indent=1).encode())
    passed = [r for r in records if r["hot"]]
    best = sorted(passed, key=lambda r: r["hot"]["median_us"])[:8]
    print(f"\n{len(passed)}/{len(records)} variants passed the gate; compile {compile_s:.1f}s")
    for r in best:
        print(f"  {r['kernel']:55s} hot {r['hot']['median_us']:7.2f} ±{r['hot']['spread_us']:.2f}  cold {r['cold']['median_us']:7.2f}")
    for name, timing in peer_hot.items():
        print(f"  peer {name:50s} hot {timing.median_us:7.2f} ±{timing.spread_us:.2f}  cold {peer_cold[name].median_us:7.2f}")
    print(f"wrote {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
