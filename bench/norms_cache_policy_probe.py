"""Norms: which lines should L2 let go of first, the rows read, the rows written, or neither?

A tune of the RMSNorm 4096×8192 class for the hot objective (hint `stream`: x read past L1, y written `.cs`,
evict-first) beat its stored winner hot (34.0 against 34.5 µs) and lost to it cold (37.3 against 36.2). With rows
asked of L2 2 MB ahead (l2_ahead), the lines that matter are those prefetched and not yet read; the rows already
read and the rows written are dead to this launch. Each stored winner (its prefetch on) against the same text with
an L2 eviction policy (`createpolicy.fractional`, `.L2::cache_hint`) on the x loads, the y stores, both, or
evict-last on the prefetch, and with the `stream` hint: gated, then timed hot and cold, interleaved, on one copy
of the inputs beside the copy of the same bytes. Writes bench/results/<gpu>/norms_cache_policy_probe.json.

    python bench/norms_cache_policy_probe.py
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

SHAPES = (("layernorm", False, 4096, 8192), ("rmsnorm", False, 4096, 8192), ("rmsnorm", False, 16384, 8192),
          ("layernorm", False, 65536, 768), ("layernorm", False, 16384, 8192))
POLICIES = "  unsigned long long pol_first_, pol_last_;\n" \
           '  asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(pol_first_));\n' \
           '  asm("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(pol_last_));\n'
# name: (x loads, y stores, prefetch): the policy each takes ('' none, 'first', 'last')
EDITS = {"x_first": ("first", "", ""), "y_first": ("", "first", ""), "xy_first": ("first", "first", ""),
         "ahead_last": ("", "", "last"), "ahead_last_y_first": ("", "first", "last")}


def _each_asm(text: str, tag: str, opcode: str, close: str, edit) -> str:
    """The text with every asm statement of `opcode` tagged `tag` edited: edit(statement up to `close`)."""
    out, at = [], 0
    while (found := text.find(f'; // tensor={tag}"', at)) >= 0:
        start = text.rfind(f'asm volatile("{opcode}', 0, found)
        end = text.index(close, found)
        out += [text[at:start], edit(text[start:end])]
        at = end
    return "".join(out) + text[at:]


def _hint_loads(text: str, policy: str) -> str:
    """Every x load with `.L2::cache_hint` and the policy as its last operand."""
    def edit(stmt: str) -> str:
        n = stmt.count('"=r"') + stmt.count('"=f"')
        stmt = stmt.replace(".v4.b32", ".L2::cache_hint.v4.b32", 1).replace(".v2.b32", ".L2::cache_hint.v2.b32", 1)
        return stmt.replace(f"[%{n}];", f"[%{n}], %{n + 1};", 1) + f'), "l"(pol_{policy}_'
    return _each_asm(text, "x", "ld.global", "));", edit)


def _hint_stores(text: str, policy: str) -> str:
    """Every y store likewise."""
    def edit(stmt: str) -> str:
        n = stmt.count('"r"(') + stmt.count('"f"(')
        stmt = stmt.replace("st.global.", "st.global.L2::cache_hint.", 1)
        return stmt.replace("}; // tensor=y", f"}}, %{n + 1}; // tensor=y", 1) + f', "l"(pol_{policy}_)'
    return _each_asm(text, "y", "st.global", ' : "memory");', edit)


def _hint_prefetch(text: str, policy: str) -> str:
    old = 'asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1; // tensor=x.ahead" :: "l"(x + ahead * '
    if text.count(old) != 1:
        raise SystemExit("not a kernel with one prefetch of x")
    new = old.replace(".global [%0], %1;", ".global.L2::cache_hint [%0], %1, %2;")
    i = text.index(old) + len(old)
    j = text.index(' : "memory");', i)
    return text[:text.index(old)] + new + text[i:j] + f', "l"(pol_{policy}_)' + text[j:]


def edited(base: Variant, arch: str, x: str, y: str, ahead: str) -> Variant:
    text = base.source.text
    anchor = "    const int row_in_block"
    if text.count(anchor) != 1:
        raise SystemExit(f"{base.source.kernel_name}: not the expected kernel text")
    text = text.replace(anchor, POLICIES + anchor)
    if x:
        text = _hint_loads(text, x)
    if y:
        text = _hint_stores(text, y)
    if ahead:
        text = _hint_prefetch(text, ahead)
    source = dataclasses.replace(base.source, text=text)
    compiled = compile_source(source, arch)
    return Variant(params=base.params, source=source, compiled=compiled, census=take_census(compiled))


def probe(device, op_name: str, residual: bool, m: int, d: int) -> dict:
    op = get_op(op_name)
    shape, run = op.shape(d=d, dtype="bf16", residual=residual), {"m": m}
    entry = shape_entries(op, shape, device.name)[entry_key(op, shape, run)]
    stored = op.params_from_dict(entry["params"])
    base = build(op, shape, stored, device.arch)
    label = f"{op.name}{'+res' if residual else ''} {m}x{d}"
    variants = {"stored": base, "stream": build(op, shape, dataclasses.replace(stored, hint="stream"), device.arch)}
    variants.update({name: edited(base, device.arch, *policy) for name, policy in EDITS.items()
                     if stored.l2_ahead or not policy[2]})
    return {"op": op_name, "residual": residual, "m": m, "d": d, "kernel": base.source.kernel_name,
            "edits": {n: dict(zip(("x", "y", "ahead"), p)) for n, p in EDITS.items()},
            "census": {n: {"registers": v.census.registers, "spill_bytes": v.census.spill_bytes} for n, v in variants.items()},
            **time_beside_copy(op, shape, run, variants, label, seed=m + d)}


def main() -> None:
    device = gpu.open_device()
    rows = [probe(device, *s) for s in SHAPES]
    doc = {"what": __doc__.split("\n\n")[0], "dtype": "bfloat16", "rows": rows}
    write_result(device, "norms_cache_policy_probe.json", json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
