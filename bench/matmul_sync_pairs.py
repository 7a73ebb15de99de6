"""One barrier per K tile against two, and 16-wide thread tiles: the quick preset under both syncs plus
128×128 tiles of 8×16 and 16×8 per thread, each gated and timed alone at each shape; the six fastest
re-timed interleaved with cuBLAS and Triton. Writes the JSON named first (run from the repository root):

    python bench/matmul_sync_pairs.py bench/results/h200/matmul_sync_pairs.json 1024,1024,1024 2048,2048,2048
"""

from __future__ import annotations

import itertools
import json
import sys
import time
from pathlib import Path

from mage_gen import gpu
from mage_gen.errors import ConfigError
from mage_gen.measure import Bench, interleave
from mage_gen.ops import get_op
from mage_gen.peers import make_peers
from mage_gen.store import write_atomic
from mage_gen.variants import build_all

FINALISTS = 6
OP = get_op("matmul")
Params = OP.params_type


def configs(shape) -> list:
    """The quick preset as of the recorded run (tm 8, one 16-byte B copy, A padded by 4, lanes 2, split) under
    both syncs, then 128×128 tiles of 8×16 and 16×8 per thread."""
    candidates = [
        Params(bm=bm, bn=bn, bk=bk, tm=8, tn=tn, buffers=buffers, a_layout=layout, a_width=a_width, b_width=16,
               a_pad=4, lanes_m=2, split=True, sync=sync)
        for bm, bn, bk, tn, buffers, layout, a_width, sync in itertools.product(
            [64, 128], [64, 128], [16, 32], [4, 8], [2, 3], ["transposed", "direct"], [4, 16], ["two", "one"])
    ] + [
        Params(bm=128, bn=128, bk=bk, tm=tm, tn=tn, buffers=buffers,
               a_layout="transposed" if a_width == 4 else "direct", a_width=a_width, b_width=16, a_pad=4,
               lanes_m=lanes, split=True, sync=sync)
        for bk, (tm, tn), buffers, a_width, lanes, sync in itertools.product(
            [8, 16], [(8, 16), (16, 8)], [2, 3], [4, 16], [2, 4], ["two", "one"])
    ]
    valid = []
    for params in dict.fromkeys(candidates):
        try:
            OP.validate(shape, params)
        except ConfigError:
            continue
        valid.append(params)
    return valid


def sweep(m: int, n: int, k: int, device) -> dict:
    shape = OP.shape(m=m, n=n, k=k)
    started = time.time()
    variants = build_all(OP, shape, configs(shape), device.arch)
    print("built", len(variants), time.time() - started, flush=True)
    bench = Bench(OP, shape, {}, seed=m + n + k)
    rows = []
    for v in variants:
        ev = bench.evaluate(v)
        hot = ev.hot.median_us if ev.hot else float("nan")
        rows.append(dict(label=v.params.label(), params=OP.params_to_dict(v.params), regs=v.census.registers,
                         spill=v.census.spill_bytes, hot=hot, passed=ev.gate.passed, reason=ev.gate.reason))
        print(f"{m}x{n}x{k} {hot:9.1f} {v.census.registers:3d} {v.params.label()}"
              + ("" if ev.gate.passed else " FAIL " + ev.gate.reason[:80]), flush=True)
    passed = sorted((r for r in rows if r["passed"]), key=lambda r: r["hot"])
    by_label = {v.params.label(): v for v in variants}
    kernels, subjects = [], []
    for r in passed[:FINALISTS]:
        kernels.append(bench.load(by_label[r["label"]]))
        subjects.append(bench.subject(by_label[r["label"]], kernels[-1], name=r["label"]))
    inputs = subjects[0].bound.inputs if subjects else OP.make_inputs(shape, {}, bench.rng)  # peers alone
    peers, _ = make_peers(OP, shape, {}, inputs, OP.reference(shape, inputs, {}))
    everyone = [*subjects, *peers]
    hot = interleave(everyone, "hot", 5, 6)
    cold = interleave(everyone, "cold", 3, 4)
    for s in everyone:
        print(f"{m}x{n}x{k} FINAL {hot[s.name].median_us:9.2f} ±{hot[s.name].spread_us:.2f} "
              f"cold {cold[s.name].median_us:9.2f} {s.name}", flush=True)
    for s in subjects:
        s.close()
    for kernel in kernels:
        kernel.unload()
    return dict(shape=[m, n, k], rows=rows,
                final={s.name: dict(hot=hot[s.name].to_dict(), cold=cold[s.name].to_dict()) for s in everyone})


def main() -> None:
    out = Path(sys.argv[1])
    device = gpu.open_device()
    doc = []
    for dims in sys.argv[2:]:
        doc.append(sweep(*(int(x) for x in dims.split(",")), device))
        write_atomic(out, (json.dumps(doc, indent=1)).encode())  # each shape as soon as it is done


if __name__ == "__main__":
    main()
