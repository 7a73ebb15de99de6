"""Decode an entry once: every statement becomes an Instr, or an UnknownInstruction naming it."""

from __future__ import annotations

from functools import lru_cache

import numpy as np

from mage_gen.interp import alu, hopper, memops, tensor
from mage_gen.interp.errors import InterpError, UnknownInstruction
from mage_gen.interp.parse import Entry, parse
from mage_gen.interp.program import ARRIVE, BAR, BRA, EXIT, OP, Decoder, Instr, Program

_BUILDERS = {**alu.BUILDERS, **memops.BUILDERS, **tensor.BUILDERS, **hopper.BUILDERS}
# what makes a block keep the asynchronous proxy's state (hopper.AsyncState)
_ASYNC = {"mbarrier", "wgmma", "fence", "stmatrix", "mapa"}


def _control(dec: Decoder, st, parts) -> tuple[int, int]:
    """(kind, branch target) for bra / ret / exit / bar.sync / bar.arrive; raises where the form is not supported."""
    if parts[0] == "bra":
        if parts[1:] not in ([], ["uni"]):
            raise UnknownInstruction(f"bra modifier(s) {parts[1:]}")
        label = st.operands[0].strip()
        if label not in dec.entry.labels:
            raise InterpError(f"line {st.line}: branch to unknown label {label}")
        return BRA, dec.entry.labels[label]
    if parts[0] in ("ret", "exit"):
        if parts[1:] not in ([], ["uni"]):
            raise UnknownInstruction(f"{parts[0]} modifier(s) {parts[1:]}")
        return EXIT, -1
    # bar.sync 0 (every thread of the block), or bar.sync id, count (a named barrier of count threads); bar.arrive
    # id, count: an arrival at it that does not wait
    if parts[0] == "bar" and parts[1:] in (["arrive"], ["arrive", "aligned"]) and len(st.operands) == 2:
        return ARRIVE, -1
    if parts[1:] not in (["sync"], ["sync", "aligned"]) or not 1 <= len(st.operands) <= 2:
        raise UnknownInstruction("only bar.sync id[, count] and bar.arrive id, count are implemented")
    return BAR, -1


def _barrier_operands(dec, st):
    """r -> (barrier id, threads it waits for or None: every thread of the block) of a bar.sync or bar.arrive."""
    ident = dec.src(st.operands[0], np.uint32)
    count = dec.src(st.operands[1], np.uint32) if len(st.operands) > 1 else None
    return lambda r: (ident(r), None if count is None else count(r))


def decode_entry(entry: Entry) -> Program:
    dec = Decoder(entry)
    for st in entry.body:
        parts = st.opcode.split(".")
        guard, neg = -1, False
        try:
            if st.guard:
                neg = st.guard.startswith("!")
                guard = dec.slot(st.guard.lstrip("!"))
            if parts[:2] == ["barrier", "cluster"]:  # a barrier of the cluster's blocks: hopper.py, as an mbarrier's
                dec.prog.async_proxy = True
                ins = Instr(OP, hopper.barrier_cluster(dec, st, parts), guard, neg, -1, st.line, st.text)
            elif parts[0] in ("bra", "ret", "exit", "bar", "barrier"):
                kind, target = _control(dec, st, parts)
                ins = Instr(kind, _barrier_operands(dec, st) if kind in (BAR, ARRIVE) else None, guard, neg, target, st.line,
                            st.text, uni="uni" in parts[1:])
            else:
                builder = _BUILDERS.get(parts[0])
                if builder is None:
                    raise UnknownInstruction("unknown instruction")
                if parts[0] in _ASYNC or parts[:3] == ["cp", "async", "bulk"]:
                    dec.prog.async_proxy = True
                if parts[0] in ("atom", "red", "membar") or (parts[0] == "fence" and parts[-1] in ("gpu", "sys")):
                    dec.prog.cross_block = True
                ins = Instr(OP, builder(dec, st, parts), guard, neg, -1, st.line, st.text)
        except UnknownInstruction as exc:
            raise UnknownInstruction(f"line {st.line}: {st.opcode}: {exc} (in {st.text!r})") from None
        except InterpError as exc:
            raise InterpError(f"line {st.line}: {exc} (in {st.text!r})") from None
        dec.prog.instrs.append(ins)
    dec.prog.instrs.append(Instr(EXIT, None, -1, False, -1, 0, "<end of entry>"))
    return dec.prog


@lru_cache(maxsize=64)
def decode(ptx: str, entry: str) -> Program:
    """The decoded entry, cached by PTX text (a hypothesis run decodes each variant once)."""
    entries = parse(ptx)
    if entry not in entries:
        raise InterpError(f"no entry {entry!r} in the PTX (it has {', '.join(entries)})")
    return decode_entry(entries[entry])
