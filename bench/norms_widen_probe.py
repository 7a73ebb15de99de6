"""Norms: does a bf16 widening of one instruction per element, in place of two, move the tuned winners?

A bf16 is the upper half of the f32 of the same value. Written as `mov.b32 {lo, hi}` and two `cvt.f32.bf16`,
ptxas spends a PRMT and a shift on each upper half; written as `shl.b32` (the lower half) and `and.b32` with
0xffff0000 (the upper), one instruction each. The results are the same bits. At the d = 8192 rows the layer
norm's winner issues 672 instructions per thread in place of 768, RMSNorm's 248 in place of 272 (cuobjdump -sass).
A row's arithmetic is issued while none of its bytes are in flight, and the layer norm, with the most of it,
sits furthest from the copy (norms.json, NOTES.md norms §8–§11).

Each shape of bench/norms.py, both ops, with and without the residual: the stored winner's config rendered as
it was tuned (`cvt`: the text whose hash tuned/ records, checked here) and as the templates render it now
(`bits`), each gated, then timed hot and cold, interleaved, on one copy of the inputs beside the copy of the
same bytes. Writes bench/results/<gpu>/norms_widen_probe.json.

    python bench/norms_widen_probe.py
"""
import dataclasses
import json
import re
import sys

sys.path.insert(0, "bench")
from _common import write_result
from _copy import FLOOR, copy_subjects, settle

from mage_gen import gpu
from mage_gen.census import take_census
from mage_gen.compile import compile_source
from mage_gen.dtypes import dtype
from mage_gen.measure import Bench, interleave
from mage_gen.ops import get_op
from mage_gen.peers import on_gpu
from mage_gen.store import entry_key, shape_entries
from mage_gen.variants import Variant, build

SHAPES = ((4096, 768), (4096, 4096), (4096, 8192), (65536, 768), (32768, 4096), (16384, 8192))
_BITS = re.compile(r'asm( volatile)?\("shl\.b32 %0, %2, 16; and\.b32 %1, %2, 0xffff0000; // bf16x2 widened"')
_CVT = (r'asm\1("{ .reg .b16 %%half_lo, %%half_hi; mov.b32 { %%half_lo, %%half_hi }, %2; '
        r'cvt.f32.bf16 %0, %%half_lo; cvt.f32.bf16 %1, %%half_hi; }"')


def as_tuned(variant: Variant, entry: dict, arch: str) -> Variant:
    """The variant with its bf16 widening written as it was when tuned/ recorded it: the same text, by hash."""
    source = dataclasses.replace(variant.source, text=_BITS.sub(_CVT, variant.source.text))
    if source.source_hash != entry["source_hash"]:
        raise SystemExit(f"{variant.source.kernel_name}: the cvt form does not render the tuned text "
                         f"({source.source_hash}, tuned/ has {entry['source_hash']})")
    compiled = compile_source(source, arch)
    return Variant(params=variant.params, source=source, compiled=compiled, census=take_census(compiled))


def probe(device, op, m: int, d: int, residual: bool) -> dict:
    shape, run = op.shape(d=d, dtype="bf16", residual=residual), {"m": m}
    entry = shape_entries(op, shape, device.name)[entry_key(op, shape, run)]
    bits = build(op, shape, op.params_from_dict(entry["params"]), device.arch)
    variants = {"cvt": as_tuned(bits, entry, device.arch), "bits": bits}
    bench = Bench(op, shape, run, seed=m + d)
    label = f"{op.name}{'+res' if residual else ''} {m}x{d}"
    subjects, kernels = [], []
    row = {"op": op.name, "residual": residual, "m": m, "d": d, "kernel": bits.source.kernel_name, "gates": {},
           "census": {n: {"registers": v.census.registers, "spill_bytes": v.census.spill_bytes,
                          "half_widen": v.census.half_widen} for n, v in variants.items()}}
    try:
        for name, variant in variants.items():
            kernel = bench.load(variant)
            kernels.append(kernel)
            subject, checked = bench.checked_subject(variant, kernel, name=name, share_inputs=True)
            row["gates"][name] = checked.to_dict()
            if subject is None:
                print(f"{label} {name}: failed the gate: {checked.reason}", flush=True)
            else:
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
    if {"cvt", "bits"} <= set(names):
        row["bits_over_cvt"] = {meth: t["bits"].median_us / t["cvt"].median_us for meth, t in (("hot", hot), ("cold", cold))}
        line += f"  bits/cvt {row['bits_over_cvt']['hot']:.3f} / {row['bits_over_cvt']['cold']:.3f}"
    print(line + f"  copy {hot[FLOOR].median_us:8.2f} / {cold[FLOOR].median_us:8.2f}", flush=True)
    return row


def main() -> None:
    device = gpu.open_device()
    rows = [probe(device, get_op(name), m, d, residual)
            for name in ("layernorm", "rmsnorm") for residual in (False, True) for m, d in SHAPES]
    doc = {"what": __doc__.split("\n\n")[0], "dtype": "bfloat16", "rows": rows}
    write_result(device, "norms_widen_probe.json", json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
