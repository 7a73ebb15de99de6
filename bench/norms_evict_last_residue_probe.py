"""Norms: do rows asked of L2 at evict-last priority stay there after the kernel, and after a cold flush?

norms_cache_policy_probe.json found one prefetch per block at evict-last priority (`ahead_priority` last) faster
hot and cold at every shape it timed, by 0.4–1.6 µs cold. If a read with the default policy does not set a line
back to normal, a kernel that prefetches at evict-last leaves x in L2 at that priority,
and a flush of normal writes may not evict it: then 'cold' is not cold, for the kernel and for whatever reads x
next. Here, for the RMSNorm 16384×8192 bf16 stored winner at each priority: the kernel once, then one copy of x
untimed (every line of x read with the default policy) and one timed (a read of x that finds it in L2 is
faster); the kernel, the flush every cold timing uses, then one copy of x timed; the same with the context's
persisting lines reset (cuCtxResetPersistingL2Cache) after the flush; each also with no kernel before it. The
committed json was recorded before a block gave its rows normal priority again once read: its 'last' is the
kernel this script now builds as 'last, unreleased'.
Writes bench/results/<gpu>/norms_evict_last_residue_probe.json.

    python bench/norms_evict_last_residue_probe.py
"""
import dataclasses
import json
import statistics
import sys

import torch
from cuda.bindings import driver as cu

sys.path.insert(0, "bench")
from _common import prepared, write_result

from mage_gen import gpu
from mage_gen.census import take_census
from mage_gen.compile import compile_source
from mage_gen.measure import flush_buffer
from mage_gen.ops import get_op
from mage_gen.store import entry_key, shape_entries
from mage_gen.variants import Variant, build

REPEATS = 15


def unreleased(variant: Variant, arch: str) -> Variant:
    """The variant without the loop that gives its block's rows normal priority again once read."""
    text = variant.source.text
    start, end = text.index("    // This block's rows, read, back to normal priority"), text.rindex("}")
    source = dataclasses.replace(variant.source, text=text[:start] + text[end:])
    compiled = compile_source(source, arch)
    return Variant(params=variant.params, source=source, compiled=compiled, census=take_census(compiled))


def main() -> None:
    device = gpu.open_device()
    op = get_op("rmsnorm")
    shape, run = op.shape(d=8192, dtype="bf16"), {"m": 16384}
    stored = op.params_from_dict(shape_entries(op, shape, device.name)[entry_key(op, shape, run)]["params"])
    x = torch.randn(run["m"], shape.d, device="cuda", dtype=torch.bfloat16)
    y, w, dst = torch.empty_like(x), torch.ones(shape.d, device="cuda", dtype=torch.bfloat16), torch.empty_like(x)
    flush = flush_buffer()
    stream = torch.cuda.current_stream().cuda_stream
    launches = {}
    for priority in ("normal", "last", "last, unreleased"):
        params = dataclasses.replace(stored, ahead_priority=priority.split(",")[0])
        variant = build(op, shape, params, device.arch)
        if priority == "last, unreleased":
            variant = unreleased(variant, device.arch)
        fixed = prepared(op, shape, variant, run)
        launches[priority] = (variant.source.kernel_name, fixed)
        # what is timed is a copy, but a kernel that computed the wrong rows may have read the wrong lines too
        y.fill_(float("nan"))
        fixed.launch([y.data_ptr(), x.data_ptr(), w.data_ptr(), run["m"], 1e-6], stream)
        want = torch.nn.functional.rms_norm(x.double(), (shape.d,), w.double(), 1e-6)
        error = float(torch.linalg.norm(y.double() - want) / torch.linalg.norm(want))
        if not error < 2 ** -8:  # NaN fails too
            raise SystemExit(f"{priority}: y is off by {error:.3g} in relative norm; nothing timed")

    def copy_us(before, reset: bool, between: str = "flush") -> float:
        times = []
        for _ in range(REPEATS):
            if before is not None:
                before.launch([y.data_ptr(), x.data_ptr(), w.data_ptr(), run["m"], 1e-6], stream)
            if between == "flush":
                flush.fill32(0x1234, cu.CUstream(stream))
            else:  # one untimed copy of x first: a read of every line with the default policy, and as many writes
                dst.copy_(x)
            if reset:
                torch.cuda.synchronize()
                gpu.check(cu.cuCtxResetPersistingL2Cache(), "cuCtxResetPersistingL2Cache")
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(x)
            stop.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(stop) * 1e3)
        return statistics.median(times)

    rows = {}
    for name, before in (("no kernel", None), *((p, launches[p][1]) for p in launches)):
        label = f"{name}, then a copy of x"
        rows[label] = copy_us(before, False, "copy")
        print(f"copy of x after {label:32} {rows[label]:8.2f} µs", flush=True)
    for reset in (False, True):
        for name, before in (("no kernel", None), *((p, launches[p][1]) for p in launches)):
            label = f"{name}{' +reset' if reset else ''}"
            rows[label] = copy_us(before, reset)
            print(f"copy of x after {label:22} {rows[label]:8.2f} µs", flush=True)
    doc = {"what": __doc__.split("\n\n")[0], "shape": "rmsnorm 16384x8192 bf16",
           "kernels": {p: k for p, (k, _) in launches.items()}, "repeats": REPEATS,
           "copy_of_x_median_us": rows}
    write_result(device, "norms_evict_last_residue_probe.json", json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
