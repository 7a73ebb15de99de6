"""One barrier per K tile against two, and 16-wide thread tiles: the quick preset under both syncs plus
128×128 tiles of 8×16 and 16×8 per thread, each gated and timed alone at each shape; the six fastest
re-timed interleaved with cuBLAS and Triton. Writes the JSON named first (run from the repository root):

    python bench/matmul_sync_pairs.py bench/results/h200/matmul_sync_pairs.json 1024,1024,1024 2048,2048,2048
"""
import itertools, json, sys, time, dataclasses
from mage_gen import gpu
from mage_gen.measure import Bench, interleave
from mage_gen.ops import get_op
from mage_gen.peers import make_peers
from mage_gen.variants import build_all
from mage_gen.errors import ConfigError

op = get_op("matmul"); P = op.params_type
out = sys.argv[1]; shapes = [tuple(map(int, s.split(","))) for s in sys.argv[2:]]
dev = gpu.open_device()

def configs(shape):
    """The quick preset as of the recorded run (tm 8, one 16-byte B copy, A padded by 4, lanes 2, split) under
    both syncs, then 128×128 tiles of 8×16 and 16×8 per thread."""
    cs = []
    for bm, bn, bk, tn, buf, layout, aw, sync in itertools.product(
            [64, 128], [64, 128], [16, 32], [4, 8], [2, 3], ["transposed", "direct"], [4, 16], ["two", "one"]):
        cs.append(P(bm=bm, bn=bn, bk=bk, tm=8, tn=tn, buffers=buf, a_layout=layout, a_width=aw, b_width=16,
                    a_pad=4, lanes_m=2, split=True, sync=sync))
    for bm, bn, bk, (tm, tn), buf, aw, lanes, sync in itertools.product(
            [128], [128], [8, 16], [(8, 16), (16, 8)], [2, 3], [4, 16], [2, 4], ["two", "one"]):
        cs.append(P(bm=bm, bn=bn, bk=bk, tm=tm, tn=tn, buffers=buf, a_layout="transposed" if aw == 4 else "direct",
                    a_width=aw, b_width=16, a_pad=4, lanes_m=lanes, split=True, sync=sync))
    valid = []
    for p in dict.fromkeys(cs):
        try:
            op.validate(shape, p); valid.append(p)
        except ConfigError:
            pass
    return valid

doc = []
for m, n, k in shapes:
    shape = op.shape(m=m, n=n, k=k)
    cs = configs(shape)
    t = time.time(); vs = build_all(op, shape, cs, dev.arch); print("built", len(vs), time.time() - t, flush=True)
    bench = Bench(op, shape, {}, seed=m + n + k)
    rows = []
    for v in vs:
        ev = bench.evaluate(v)
        hot = ev.hot.median_us if ev.hot else float("nan")
        rows.append(dict(label=v.params.label(), params=op.params_to_dict(v.params), regs=v.census.registers,
                         spill=v.census.spill_bytes, hot=hot, passed=ev.gate.passed, reason=ev.gate.reason))
        print(f"{m}x{n}x{k} {hot:9.1f} {v.census.registers:3d} {v.params.label()}" + ("" if ev.gate.passed else " FAIL " + ev.gate.reason[:80]), flush=True)
    ok = sorted((r for r in rows if r["passed"]), key=lambda r: r["hot"])
    by = {v.params.label(): v for v in vs}
    subs, ks = [], []
    for r in ok[:6]:
        kk = bench.load(by[r["label"]]); ks.append(kk); subs.append(bench.subject(by[r["label"]], kk, name=r["label"]))
    inputs = subs[0].bound.inputs
    peers, missing = make_peers(op, shape, {}, inputs, op.reference(shape, inputs, {}))
    every = [*subs, *peers]
    hot = interleave(every, "hot", 5, 6); cold = interleave(every, "cold", 3, 4)
    for s in every:
        print(f"{m}x{n}x{k} FINAL {hot[s.name].median_us:9.2f} ±{hot[s.name].spread_us:.2f} cold {cold[s.name].median_us:9.2f} {s.name}", flush=True)
    for s in subs: s.close()
    doc.append(dict(shape=[m, n, k], rows=rows, final={s.name: dict(hot=hot[s.name].to_dict(), cold=cold[s.name].to_dict()) for s in every}))
    json.dump(doc, open(out, "w"), indent=1)
