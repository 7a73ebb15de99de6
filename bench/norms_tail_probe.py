"""Norms: is what keeps the d = 8192 rows from the copy's time the launch's tail?

At 4096×8192 the bf16 norms reach 91.7% (layer norm) and 96.7% (RMSNorm) of the copy of the same bytes, cold, and
at 16384×8192 96.7% and 97.4% (norms.json, NOTES.md norms §10). A tail of about one block's life on an emptying
GPU would cost a share that falls as 1/M. Here one config per op (the 4096-row class's winner) runs at M = 4096,
8192 and 16384, each M on one copy of its inputs beside the copy of that same x, hot and cold, interleaved; if
the tail is what is left, the kernel's share of the copy climbs with M by about the block's life over the
launch's time. The same bytes as half-length rows (the d = 4096, 32768-row class's winner at 8192 rows) and the 16384-row
class's winner at 4096 rows ride along: a shorter block life should close the gap if the tail is the cause.
Writes bench/results/<gpu>/norms_tail_probe.json. `sweep`: the layer norm's two d = 8192 classes' winners from 2048
to 32768 rows, so that the kernel's time less the copy's, against M, says what is a fixed cost of a launch and what
grows with the rows (norms_tail_sweep_probe.json).

    python bench/norms_tail_probe.py
    python bench/norms_tail_probe.py sweep
"""
import json
import sys

sys.path.insert(0, "bench")
from _common import write_result
from _copy import FLOOR, copy_subjects, settle

from mage_gen import gpu
from mage_gen.dtypes import dtype
from mage_gen.measure import Bench, interleave
from mage_gen.ops import get_op
from mage_gen.peers import on_gpu
from mage_gen.store import load_winner
from mage_gen.variants import build

# (d, rows of the tuned class whose winner runs, rows timed)
CASES = ((8192, 4096, 4096), (8192, 4096, 8192), (8192, 4096, 16384), (8192, 16384, 4096), (4096, 32768, 8192))
SWEEP = tuple((8192, config_rows, m) for config_rows in (4096, 16384) for m in (2048, 4096, 8192, 16384, 32768))


def probe(device, op_name: str, d: int, config_rows: int, m: int, params) -> dict:
    op = get_op(op_name)
    shape, run = op.shape(d=d, dtype="bf16"), {"m": m}
    variant = build(op, shape, params, device.arch)
    bench = Bench(op, shape, run, seed=m + d)
    kernel = bench.load(variant)
    try:
        subject, checked = bench.checked_subject(variant, kernel, name="mage-gen", share_inputs=True)
        if subject is None:
            return {"op": op_name, "d": d, "m": m, "gate": checked.to_dict()}
        x = on_gpu(bench.timing_buffers()["x"].ptr, (m, d), dtype("bf16"))
        copies = copy_subjects(op.bytes_moved(shape, run), (x,))
        hot = interleave([subject, *copies], "hot", 4, 5)
        cold = interleave([subject, *copies], "cold", 4, 5)
        subject.close()
        settle(copies, hot, cold)
    finally:
        kernel.unload()
    if bench.inputs_changed():
        raise SystemExit(f"{op_name} {m}x{d}: the kernel or a copy wrote into its inputs")
    row = {"op": op_name, "d": d, "m": m, "config_of_rows": config_rows, "kernel": variant.source.kernel_name,
           "timings": {name: {"hot": hot[name].to_dict(), "cold": cold[name].to_dict()} for name in ("mage-gen", FLOOR)},
           **{f"{method}_fraction_of_copy": table[FLOOR].median_us / table["mage-gen"].median_us
              for method, table in (("hot", hot), ("cold", cold))}}
    print(f"{op_name:9} {m:>5}x{d} (class m={config_rows:<5}) {variant.source.kernel_name:56} hot {row['hot_fraction_of_copy']:.3f} "
          f"cold {row['cold_fraction_of_copy']:.3f} of the copy", flush=True)
    return row


sweep = sys.argv[1:] == ["sweep"]
cases, names = (SWEEP, ("layernorm",)) if sweep else (CASES, ("layernorm", "rmsnorm"))
device = gpu.open_device()
rows = []
for name in names:
    op = get_op(name)
    for d, config_rows, m in cases:
        shape = op.shape(d=d, dtype="bf16")
        params = load_winner(op, shape, device.name, {"m": config_rows}, l2_bytes=device.l2_bytes).params
        rows.append(probe(device, name, d, config_rows, m, params))
doc = {"what": __doc__.split("\n\n")[0], "dtype": "bfloat16", "cases": cases, "rows": rows}
write_result(device, "norms_tail_sweep_probe.json" if sweep else "norms_tail_probe.json", json.dumps(doc, indent=1) + "\n")
