"""Norms: the tuned winner of a few bf16 shapes against the same config with plain loads (hint none, as
Triton's kernels read x) and with stream, and against rows shaped as Triton's kernel (256 threads, 4 rows an
SM), beside Triton, Inductor and the copy, hot and cold, in one process; the SM and memory clocks read before
and after each shape. Writes bench/results/<gpu>/norms_hint_probe.json.

    python bench/norms_hint_probe.py
"""
import dataclasses
import json
import subprocess
import sys

sys.path.insert(0, "bench")
from mage_gen import gpu  # noqa: E402
from mage_gen.measure import Bench, interleave  # noqa: E402
from mage_gen.ops import get_op  # noqa: E402
from mage_gen.peers import make_peers  # noqa: E402
from mage_gen.store import load_winner  # noqa: E402
from mage_gen.variants import build  # noqa: E402

from _common import write_result  # noqa: E402  (bench/_common.py)
from _copy import copy_subjects, settle  # noqa: E402

CASES = [("rmsnorm", 4096, 8192), ("layernorm", 16384, 8192), ("rmsnorm", 4096, 4096), ("layernorm", 4096, 8192)]

ROW = dict(template="row", rows_per_block=1, grid_cap=0, vector=16)
EXTRAS = {
    ("rmsnorm", 4096, 8192): [dict(ROW, threads=256, hint="none", hold="packed", min_blocks=4),
                              dict(ROW, threads=256, hint="none", hold="float", min_blocks=4),
                              dict(ROW, threads=512, hint="none", hold="float", min_blocks=2),
                              dict(ROW, threads=256, hint="nc", hold="packed", min_blocks=4)],
    ("layernorm", 16384, 8192): [dict(ROW, threads=256, hint="none", hold="packed", min_blocks=1),
                                 dict(ROW, threads=256, hint="nc", hold="float", min_blocks=4),
                                 dict(ROW, threads=512, hint="none", hold="float", min_blocks=1),
                                 dict(ROW, threads=256, hint="none", hold="float", min_blocks=4)],
}


def clocks() -> str:
    done = subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm,clocks.mem,power.draw,temperature.gpu",
                           "--format=csv,noheader"], capture_output=True, text=True)
    return done.stdout.strip()


device = gpu.open_device()
rows = []
for name, m, d in CASES:
    op = get_op(name)
    shape = op.shape(d=d, dtype="bf16")
    run = {"m": m}
    winner = load_winner(op, shape, device.name, run, l2_bytes=device.l2_bytes).params
    variants = {f"winner {winner.hint}": winner}
    for hint in ("none", "nc", "stream"):
        if hint != winner.hint:
            variants[f"hint {hint}"] = dataclasses.replace(winner, hint=hint)
    for extra in EXTRAS.get((name, m, d), []):  # shaped as Triton's kernel: plain loads, 4 rows an SM
        variants[" ".join(f"{k}={v}" for k, v in extra.items())] = dataclasses.replace(winner, **extra)
    bench = Bench(op, shape, run, seed=7)
    subjects, kernels = [], []
    for label, params in variants.items():
        try:
            v = build(op, shape, params, device.arch)
        except Exception as e:  # a shape the rules refuse
            print(label, "refused:", e)
            continue
        kernels.append(bench.load(v))
        subject, checked = bench.checked_subject(v, kernels[-1], name=label)
        if subject is not None:
            subjects.append(subject)
        else:
            print(label, "failed the gate:", checked.reason)
    peers, missing = make_peers(op, shape, run, bench.timing_inputs(), None, check=bench.check_tensor, inductor=True)
    copies = copy_subjects(op.bytes_moved(shape, run))
    before = clocks()
    everyone = [*subjects, *peers, *copies]
    hot, cold = interleave(everyone, "hot", 4, 5), interleave(everyone, "cold", 4, 5)
    settle(copies, hot, cold)
    after = clocks()
    row = {"op": name, "m": m, "d": d, "params": {k: dataclasses.asdict(p) for k, p in variants.items()},
           "clocks_before": before, "clocks_after": after, "missing": missing,
           "hot": {k: t.to_dict() for k, t in hot.items()}, "cold": {k: t.to_dict() for k, t in cold.items()}}
    rows.append(row)
    print(name, m, d, before, "->", after)
    for k in hot:
        if not k.startswith("floor:copy/"):
            print(f"   {k:28} hot {hot[k].median_us:8.2f} ±{hot[k].spread_us:5.2f}  cold {cold[k].median_us:8.2f}")
    for s in subjects:
        s.close()
    for k in kernels:
        k.unload()
write_result(device, "norms_hint_probe.json", json.dumps(rows, indent=1) + "\n")
