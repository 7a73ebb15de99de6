"""Norms: do rows fetched into L2 ahead of the blocks that will read them bring the DRAM-bound shapes to the copy?

A row kernel holds its row in registers: its loads are in flight only until the row has arrived, and while the
block reduces and stores, none of its bytes are. §6–§11 of NOTES.md (norms) found that more blocks per SM,
rows staged in shared memory, one reduction instead of two and fewer instructions each moved these shapes by
tenths of a percent; the copy of the same bytes never waits on a row. An L2 prefetch asks DRAM for bytes
without a register to land in: each block, as it starts, asks for the rows a block some distance behind it will
read, so DRAM has requests queued while the blocks on the SMs reduce.

Each DRAM-bound bf16 shape where a norm sits furthest from the copy: the stored winner (a grid of one row group
per block) without a prefetch (`tuned`), and with one prefetch per block of the rows `ahead` bytes further on, as
one `cp.async.bulk.prefetch.L2` from thread 0 (bulk: the l2_ahead parameter, which this probe led to; its first
run, the committed json, wrote the same instruction into the winner's text by hand) or as one
`prefetch.global.L2` per 128-byte line spread over the block's threads (lines); each gated, then timed hot and
cold, interleaved, on one copy of the inputs beside the copy of the same bytes. Writes
bench/results/<gpu>/norms_l2_ahead_probe.json.

    python bench/norms_l2_ahead_probe.py
"""
import dataclasses
import json
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

# (op, residual, m, d): under or near 97% of the copy, cold, in norms.json
SHAPES = (("layernorm", False, 4096, 8192), ("layernorm", False, 16384, 8192), ("layernorm", False, 65536, 768),
          ("layernorm", True, 4096, 4096), ("layernorm", True, 4096, 8192), ("layernorm", False, 32768, 4096),
          ("rmsnorm", False, 4096, 8192), ("rmsnorm", True, 4096, 4096), ("rmsnorm", False, 32768, 4096))
AHEAD_MB = {"bulk2": ("bulk", 2), "bulk6": ("bulk", 6), "bulk16": ("bulk", 16), "lines6": ("lines", 6)}


def with_lines(variant: Variant, shape, arch: str, ahead_bytes: int) -> Variant:
    """The variant with its block's prefetch of the row group `ahead_bytes` on, one prefetch.global.L2 per
    128-byte line spread over the block's threads, before its own rows' loads."""
    rows = variant.params.rows_per_block
    row_bytes = shape.d * 2
    ahead_blocks = max(1, ahead_bytes // (rows * row_bytes))
    anchor = f"    const Row r = locate(x, y, {'residual, residual_out, ' if shape.residual else ''}(long long)blockIdx.x * {rows} + row_in_block, M);\n"
    text = variant.source.text
    if text.count(anchor) != 1:
        raise SystemExit(f"{variant.source.kernel_name}: not a one-group-per-block kernel of the expected text")
    tensors = ["x"] + (["residual"] if shape.residual else [])
    asks = " ".join(f'asm volatile("prefetch.global.L2 [%0];" :: "l"((const char*)({t} + first_ * {shape.d}) + line_ * 128) : "memory");'
                    for t in tensors)
    body = (f"    {{ const long long first_ = ((long long)blockIdx.x + {ahead_blocks}) * {rows};\n"
            f"      const long long bytes_ = first_ < M ? min((long long){rows}, M - first_) * {row_bytes} : 0;\n"
            f"      for (long long line_ = threadIdx.x; line_ * 128 < bytes_; line_ += blockDim.x) {{ {asks} }} }}\n")
    source = dataclasses.replace(variant.source, text=text.replace(anchor, body + anchor))
    compiled = compile_source(source, arch)
    return Variant(params=variant.params, source=source, compiled=compiled, census=take_census(compiled))


def ahead(op, shape, base: Variant, arch: str, form: str, mb: int) -> Variant:
    if form == "bulk":
        return build(op, shape, dataclasses.replace(base.params, l2_ahead=mb << 10), arch)
    return with_lines(base, shape, arch, mb << 20)


def probe(device, op_name: str, residual: bool, m: int, d: int) -> dict:
    op = get_op(op_name)
    shape, run = op.shape(d=d, dtype="bf16", residual=residual), {"m": m}
    entry = shape_entries(op, shape, device.name)[entry_key(op, shape, run)]
    stored = op.params_from_dict(entry["params"])
    tuned = build(op, shape, dataclasses.replace(stored, l2_ahead=0), device.arch)
    label = f"{op.name}{'+res' if residual else ''} {m}x{d}"
    if tuned.params.grid_cap:
        print(f"{label}: the winner is a persistent grid; left out", flush=True)
        return {"op": op_name, "residual": residual, "m": m, "d": d, "kernel": tuned.source.kernel_name,
                "skipped": "persistent grid"}
    variants = {"tuned": tuned, **{name: ahead(op, shape, tuned, device.arch, form, mb)
                                   for name, (form, mb) in AHEAD_MB.items()}}
    row = {"op": op_name, "residual": residual, "m": m, "d": d, "kernel": tuned.source.kernel_name,
           "stored_l2_ahead": stored.l2_ahead,
           "census": {n: {"registers": v.census.registers, "spill_bytes": v.census.spill_bytes} for n, v in variants.items()},
           **time_beside_copy(op, shape, run, variants, label, seed=m + d)}
    times = row["timings"]
    if "tuned" in times:
        row["over_tuned"] = {n: {meth: times[n][meth]["median_us"] / times["tuned"][meth]["median_us"] for meth in ("hot", "cold")}
                             for n in variants if n in times}
    return row


def main() -> None:
    device = gpu.open_device()
    rows = [probe(device, *s) for s in SHAPES]
    doc = {"what": __doc__.split("\n\n")[0], "dtype": "bfloat16", "ahead": {n: {"form": f, "mb": mb} for n, (f, mb) in AHEAD_MB.items()},
           "rows": rows}
    write_result(device, "norms_l2_ahead_probe.json", json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
