"""Norms: does a bf16 widening of one instruction per element, in place of two, move the tuned winners?

A bf16 is the upper half of the f32 of the same value. Written as `mov.b32 {lo, hi}` and two `cvt.f32.bf16`,
ptxas spends a PRMT and a shift on each upper half; written as `shl.b32` (the lower half) and `and.b32` with
0xffff0000 (the upper), one instruction each. The results are the same bits. At the d = 8192 rows the layer
norm's winner issues 672 instructions per thread in place of 768, RMSNorm's 248 in place of 272 (cuobjdump -sass).
A row's arithmetic is issued while none of its bytes are in flight, and the layer norm, with the most of it,
sits furthest from the copy (norms.json, NOTES.md norms §8–§11).

Each shape of bench/norms.py, both ops, with and without the residual: the stored winner's config with its
widenings written as `cvt` and as the templates render them now (`bits`), each gated, then timed hot and cold,
interleaved, on one copy of the inputs beside the copy of the same bytes; each row says which of the two texts
tuned/ holds (`tuned_text`: the first run, at the commit that made `bits`, had `cvt` tuned at every shape).
Writes bench/results/<gpu>/norms_widen_probe.json.

    python bench/norms_widen_probe.py
"""
import dataclasses
import json
import re
import sys

sys.path.insert(0, "bench")
from _beside_copy import time_beside_copy
from _common import write_result

from mage_gen import gpu
from mage_gen.census import take_census
from mage_gen.compile import compile_source
from mage_gen.ops import get_op
from mage_gen.store import entry_key, shape_entries
from mage_gen.variants import Variant, build

SHAPES = ((4096, 768), (4096, 4096), (4096, 8192), (65536, 768), (32768, 4096), (16384, 8192))
_BITS = re.compile(r'asm( volatile)?\("shl\.b32 %0, %2, 16; and\.b32 %1, %2, 0xffff0000; // bf16x2 widened"')
_CVT = (r'asm\1("{ .reg .b16 %%half_lo, %%half_hi; mov.b32 { %%half_lo, %%half_hi }, %2; '
        r'cvt.f32.bf16 %0, %%half_lo; cvt.f32.bf16 %1, %%half_hi; }"')


def as_cvt(variant: Variant, arch: str) -> Variant:
    """The variant with its bf16 widenings written as mov {lo, hi} and two cvt.f32.bf16."""
    text, count = _BITS.subn(_CVT, variant.source.text)
    if not count:
        raise SystemExit(f"{variant.source.kernel_name}: no bf16 widening to write as cvt")
    source = dataclasses.replace(variant.source, text=text)
    compiled = compile_source(source, arch)
    return Variant(params=variant.params, source=source, compiled=compiled, census=take_census(compiled))


def probe(device, op, m: int, d: int, residual: bool) -> dict:
    shape, run = op.shape(d=d, dtype="bf16", residual=residual), {"m": m}
    entry = shape_entries(op, shape, device.name)[entry_key(op, shape, run)]
    bits = build(op, shape, op.params_from_dict(entry["params"]), device.arch)
    variants = {"cvt": as_cvt(bits, device.arch), "bits": bits}
    tuned = [n for n, v in variants.items() if v.source.source_hash == entry.get("source_hash")]
    label = f"{op.name}{'+res' if residual else ''} {m}x{d}"
    row = {"op": op.name, "residual": residual, "m": m, "d": d, "kernel": bits.source.kernel_name,
           "tuned_text": tuned[0] if tuned else "neither",
           "census": {n: {"registers": v.census.registers, "spill_bytes": v.census.spill_bytes,
                          "half_widen": v.census.half_widen} for n, v in variants.items()},
           **time_beside_copy(op, shape, run, variants, label, seed=m + d)}
    if {"cvt", "bits"} <= set(row["fraction_of_copy"]):
        row["bits_over_cvt"] = {meth: row["timings"]["bits"][meth]["median_us"] / row["timings"]["cvt"][meth]["median_us"]
                                for meth in ("hot", "cold")}
        print(f"{label:24} bits/cvt {row['bits_over_cvt']['hot']:.3f} hot, {row['bits_over_cvt']['cold']:.3f} cold", flush=True)
    return row


def main() -> None:
    device = gpu.open_device()
    rows = [probe(device, get_op(name), m, d, residual)
            for name in ("layernorm", "rmsnorm") for residual in (False, True) for m, d in SHAPES]
    doc = {"what": __doc__.split("\n\n")[0], "dtype": "bfloat16", "rows": rows}
    write_result(device, "norms_widen_probe.json", json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
