"""Where the matmul search space is fast on this GPU: every config of a preset (or a sample of it), gated and
timed hot and cold at each shape, then the five fastest re-timed interleaved with cuBLAS and Triton.

For choosing presets and template parameters, not for the targets (bench/matmul.py holds those).
Writes bench/results/<gpu>/matmul_sweep.json.

    python -m bench.probes.matmul_sweep --preset explore --shapes 1024,1024,1024 2048,2048,2048
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time

from mage_gen import gpu
from mage_gen.measure import Bench, interleave
from mage_gen.ops import get_op
from mage_gen.peers import make_peers
from mage_gen.space import expand, load_space
from mage_gen.variants import build_all

from bench._common import provenance, write_result

FINALISTS = 5


def sweep_shape(op, dims: tuple[int, int, int], preset: str, limit: int, device) -> dict:
    m, n, k = dims
    shape = op.shape(m=m, n=n, k=k)
    valid, _ = expand(op, shape, load_space(op, preset))
    if len(valid) > limit:
        valid = random.Random(m * n * k).sample(valid, limit)
    started = time.monotonic()
    variants = build_all(op, shape, valid, device.arch)
    compile_s = time.monotonic() - started
    bench = Bench(op, shape, {}, seed=m + n + k)
    rows = []
    for v in variants:
        ev = bench.evaluate(v)
        rows.append({"kernel": v.source.kernel_name, "label": v.params.label(), "params": op.params_to_dict(v.params),
                     "registers": v.census.registers, "spill_bytes": v.census.spill_bytes, **ev.to_dict()})
        hot = ev.hot.median_us if ev.hot else float("nan")
        print(f"{m}x{n}x{k} {hot:9.1f} µs  {v.census.registers:3d} regs  {v.params.label()}"
              + ("" if ev.gate.passed else f"  FAILED {ev.gate.reason}"), file=sys.stderr, flush=True)
    timed = sorted((r for r in rows if r["hot"]), key=lambda r: r["hot"]["median_us"])
    by_kernel = {v.source.kernel_name: v for v in variants}
    subjects, kernels = [], []
    for r in timed[:FINALISTS]:
        kernel = bench.load(by_kernel[r["kernel"]])
        kernels.append(kernel)
        subjects.append(bench.subject(by_kernel[r["kernel"]], kernel, name=r["label"]))
    inputs = subjects[0].bound.inputs if subjects else op.make_inputs(shape, {}, bench.rng)
    peers, missing = make_peers(op, shape, {}, inputs, op.reference(shape, inputs, {}))
    everyone = [*subjects, *peers]
    hot = interleave(everyone, "hot", 5, 6)
    cold = interleave(everyone, "cold", 5, 6)
    for s in subjects:
        s.close()
    for kernel in kernels:
        kernel.unload()
    final = {s.name: {"hot": hot[s.name].to_dict(), "cold": cold[s.name].to_dict()} for s in everyone}
    for name, t in final.items():
        print(f"{m}x{n}x{k} final {t['hot']['median_us']:9.1f} µs hot {t['cold']['median_us']:9.1f} µs cold  {name}",
              file=sys.stderr, flush=True)
    return {"m": m, "n": n, "k": k, "preset": preset, "configs": len(rows), "compile_s": compile_s, "rows": rows,
            "final": final, "peer_configs": {p.name: p.config for p in peers}, "peers_missing": missing}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="quick")
    parser.add_argument("--limit", type=int, default=64, help="at most this many configs per shape (a sample)")
    parser.add_argument("--shapes", nargs="+", default=["1024,1024,1024", "2048,2048,2048"], metavar="M,N,K")
    parser.add_argument("--out", default="matmul_sweep.json")
    args = parser.parse_args()
    op = get_op("matmul")
    device = gpu.open_device()
    shapes = [tuple(int(x) for x in s.split(",")) for s in args.shapes]
    results = [sweep_shape(op, dims, args.preset, args.limit, device) for dims in shapes]
    doc = {"what": "matmul configs of one preset, each gated then timed alone; the fastest five re-timed "
                   "interleaved with the peers (recorded by bench/probes/matmul_sweep.py)",
           "method": {"trial": "measure.Bench.evaluate: gate, then hot (20-launch graph × 10 replays, median) "
                               "and cold (256 MB flush before each of 10 launches)",
                      "final": "5 rounds × 6, interleaved with cuBLAS (TF32 off) and Triton ieee at its best config"},
           **provenance(device), "shapes": results}
    print(f"wrote {write_result(device, args.out, json.dumps(doc, indent=1) + chr(10))}", file=sys.stderr)


if __name__ == "__main__":
    main()
