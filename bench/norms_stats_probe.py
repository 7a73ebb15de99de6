"""Norms: does one row-wide reduction (stats 'shifted') beat the two of the layer norm's winners?

Each bf16 layer-norm shape of bench/norms.py, with and without the residual: the tuned winner and the same config
with stats 'shifted' (sums of x − k and (x − k)² about the row's first element, one barrier), each gated, then
timed hot and cold, interleaved, on one copy of the inputs beside the copy of the same x. RMSNorm, one
statistic and one reduction already, is the yardstick: at the d = 8192 rows the layer norm sits 2–4% further
from the copy than RMSNorm does (norms_tail_probe.json). Writes bench/results/<gpu>/norms_stats_probe.json.

    python bench/norms_stats_probe.py
"""
import dataclasses
import json
import sys

sys.path.insert(0, "bench")
from _common import write_result
from _copy import FLOOR, copy_subjects, settle

from mage_gen import gpu
from mage_gen.dtypes import dtype
from mage_gen.errors import ConfigError
from mage_gen.measure import Bench, interleave
from mage_gen.ops import get_op
from mage_gen.peers import on_gpu
from mage_gen.store import load_winner
from mage_gen.variants import build

SHAPES = ((4096, 768), (4096, 4096), (4096, 8192), (65536, 768), (32768, 4096), (16384, 8192))


def probe(device, op, m: int, d: int, residual: bool) -> dict:
    shape, run = op.shape(d=d, dtype="bf16", residual=residual), {"m": m}
    winner = load_winner(op, shape, device.name, run, l2_bytes=device.l2_bytes).params
    configs = {"winner": winner}
    try:
        shifted = dataclasses.replace(winner, stats="shifted")
        op.validate(shape, shifted)
        configs["shifted"] = shifted
    except ConfigError as exc:
        print(f"{op.name} {m}x{d}: no shifted form of the winner ({exc})", flush=True)
    bench = Bench(op, shape, run, seed=m + d)
    label = f"{op.name}{'+res' if residual else ''} {m}x{d}"
    subjects, kernels, row = [], [], {"op": op.name, "residual": residual, "m": m, "d": d, "kernels": {}, "gates": {}}
    try:
        for name, params in configs.items():
            variant = build(op, shape, params, device.arch)
            kernel = bench.load(variant)
            kernels.append(kernel)
            subject, checked = bench.checked_subject(variant, kernel, name=name, share_inputs=True)
            row["kernels"][name], row["gates"][name] = variant.source.kernel_name, checked.to_dict()
            if subject is not None:
                subjects.append(subject)
        sources = tuple(on_gpu(bench.timing_buffers()[t].ptr, (m, d), dtype("bf16"))
                        for t in ("x", "residual") if t in bench.timing_buffers())
        copies = copy_subjects(op.bytes_moved(shape, run), sources)
        hot = interleave([*subjects, *copies], "hot", 4, 5)
        cold = interleave([*subjects, *copies], "cold", 4, 5)
        settle(copies, hot, cold)
    finally:
        for s in subjects:
            s.close()
        for k in kernels:
            k.unload()
    if bench.inputs_changed():
        raise SystemExit(f"{label}: a kernel or a copy wrote into its inputs")
    names = [s.name for s in subjects] + [FLOOR]
    row["timings"] = {n: {"hot": hot[n].to_dict(), "cold": cold[n].to_dict()} for n in names}
    line = f"{label:24}"
    for n in names[:-1]:
        row[f"{n}_fraction_of_copy"] = {meth: t[FLOOR].median_us / t[n].median_us for meth, t in (("hot", hot), ("cold", cold))}
        line += f" {n} {hot[n].median_us:8.2f}±{hot[n].spread_us:.2f} / {cold[n].median_us:8.2f}±{cold[n].spread_us:.2f} µs"
    print(line + f"  copy {hot[FLOOR].median_us:8.2f} / {cold[FLOOR].median_us:8.2f}", flush=True)
    return row


device = gpu.open_device()
op = get_op("layernorm")
rows = [probe(device, op, m, d, residual) for residual in (False, True) for m, d in SHAPES]
doc = {"what": __doc__.split("\n\n")[0], "dtype": "bfloat16", "rows": rows}
write_result(device, "norms_stats_probe.json", json.dumps(doc, indent=1) + "\n")
