"""Memory and warp-synchronous instructions: ld, st, cp.async (+ commit/wait), shfl.sync, and the L2 cache
policies (createpolicy, applypriority), which move nothing; a load under an evict-last policy (.L2::cache_hint)
leaves its lines kept, as a prefetch under one does.

Loads and stores go through the warp (warp.load / warp.store), which picks global or shared memory
by state space (or, for generic addresses, by which window the address falls in)."""

from __future__ import annotations

import re

import numpy as np

from mage_gen.interp.alu import TYPES, type_of
from mage_gen.interp.errors import DivergenceError, InterpError, UnknownInstruction
from mage_gen.interp.program import CONST_GENERIC_BASE, DTYPES, LANES, Decoder, parse_int

_SPACES = {"global", "shared", "shared::cta", "shared::cluster", "param", "local", "const"}
_IGNORED = re.compile(r"^(nc|ca|cg|cs|lu|cv|wb|wt|weak|volatile|relaxed|cta|gpu|sys|L1::\w+|L2::(64B|128B|256B)"
                      r"|v2|v4)$")


def _space_and_width(parts: list[str]) -> tuple[str, int]:
    space = next((p for p in parts[1:] if p in _SPACES), "generic")
    if space == "shared::cta":
        space = "shared"
    for p in parts[1:]:
        if p not in _SPACES and p not in TYPES and not _IGNORED.match(p):
            raise UnknownInstruction(f"modifier .{p} not implemented")
    if space == "local":
        raise UnknownInstruction(f"{space} memory not implemented")
    return space, 4 if "v4" in parts else 2 if "v2" in parts else 1


def _words_per(dt) -> int:
    size = np.dtype(dt).itemsize
    if size not in (4, 8):
        raise UnknownInstruction(f"{size}-byte memory elements not implemented")
    return size // 4


def _widening(dec: Decoder, dsts: list[int], dt):
    """An integer loaded into a wider register is sign- (.s) or zero-extended (.u/.b) to its size."""
    have = {np.dtype(dec.prog.slot_dtypes[d]).itemsize for d in dsts if d >= 0}
    size = np.dtype(dt).itemsize
    if have == {size} or np.dtype(dt).kind == "f":
        return None
    if len(have) != 1 or max(have) < size:
        raise UnknownInstruction("destination register narrower than the loaded type")
    wide = max(have)
    return np.dtype(("i" if np.dtype(dt).kind == "i" else "u") + str(wide)).type


def _ld(dec: Decoder, st, parts):
    hinted = "L2::cache_hint" in parts
    if hinted:
        parts = [p for p in parts if p != "L2::cache_hint"]
        if len(st.operands) != 3:
            raise UnknownInstruction("ld.L2::cache_hint takes a destination, an address and a cache policy")
    elif len(st.operands) != 2:
        raise UnknownInstruction("a cache policy operand without .L2::cache_hint")
    space, n = _space_and_width(parts)
    if hinted and space != "global":
        raise UnknownInstruction(f"ld.{space} under a cache policy not implemented")
    dt = DTYPES[type_of(parts)]
    dsts = [dec.dst(x) for x in dec.vector(st.operands[0])]
    if len(dsts) != n:
        raise UnknownInstruction(f"{n} destinations expected")
    what = f"line {st.line}: {st.text}"
    widen = _widening(dec, dsts, dt)
    if space == "param":
        m = re.fullmatch(r"\[\s*([\w$]+)\s*(?:\+\s*(\d+))?\s*\]", st.operands[1])
        if not m or m.group(1) not in dec.params:
            raise UnknownInstruction(f"parameter operand {st.operands[1]!r} not understood")
        off = dec.params[m.group(1)].offset + int(m.group(2) or 0)
        size = np.dtype(dt).itemsize

        def fn_param(w, mask):
            value = np.frombuffer(w.block.params[off:off + size], dtype=dt)[0]
            w.put(dsts[0], np.full(LANES, value, dtype=widen or dt), mask)
        return fn_param
    if np.dtype(dt).itemsize == 2 and not hinted and widen is None:
        return _ld16(dec, st, space, dt, dsts)
    wpe = _words_per(dt)
    base, off = dec.address(st.operands[1])
    policy = dec.src(st.operands[2], np.uint64) if hinted else None
    if space == "const":
        return _ld_const(dec, dsts, base, off, n * wpe, dt, widen, what)

    def fn(w, mask):
        addr = np.broadcast_to(base(w.r) + off, (LANES,))
        sel = w.active(mask)
        words = w.load(space, addr[sel], n * wpe, sel, what)
        if policy is not None:
            values = np.broadcast_to(policy(w.r), (LANES,))[sel]
            _check_policy(values, what)
            if np.any(values == _POLICY_TAG | np.uint64(_PRIORITIES.index("L2::evict_last"))):
                w.keep_lines(addr[sel], n * wpe * 4)
        vals = np.ascontiguousarray(words).view(dt)  # (k, n)
        if widen is not None:
            vals = vals.astype(widen)
        for j, d in enumerate(dsts):
            w.put_lanes(d, vals[:, j], mask)
    return fn


def _ld_const(dec: Decoder, dsts: list[int], base, off, nwords: int, dt, widen, what: str):
    """A load from the module's .const arrays (read-only, the same for every thread)."""
    data = np.frombuffer(dec.prog.constants, dtype=np.uint8)

    def fn(w, mask):
        sel = w.active(mask)
        addr = np.broadcast_to(base(w.r) + off, (LANES,))[sel].astype(np.int64) - CONST_GENERIC_BASE
        if ((addr < 0) | (addr + 4 * nwords > data.size) | (addr % min(4 * nwords, 16) != 0)).any():
            raise InterpError(f"{what}: a constant-memory load outside the module's .const arrays (or misaligned)")
        raw = data[addr[:, None] + np.arange(4 * nwords)[None, :]]
        vals = np.ascontiguousarray(raw).view(dt)
        if widen is not None:
            vals = vals.astype(widen)
        for j, d in enumerate(dsts):
            w.put_lanes(d, vals[:, j], mask)
    return fn


def _ld16(dec: Decoder, st, space: str, dt, dsts: list[int]):
    """A 2-byte global load (memory.Global.read16) into a 16-bit register."""
    if space != "global" or len(dsts) != 1:
        raise UnknownInstruction("2-byte loads other than one element from global memory not implemented")
    base, off = dec.address(st.operands[1])
    what = f"line {st.line}: {st.text}"

    def fn(w, mask):
        sel = w.active(mask)
        addr = np.broadcast_to(base(w.r) + off, (LANES,))[sel].astype(np.uint64)
        w.put_lanes(dsts[0], w.block.glob.read16(addr, w.tids[sel], w.block.describe, what).view(dt), mask)
    return fn


def _st16(dec: Decoder, st, space: str, dt):
    """A 2-byte global store (memory.Global.write16)."""
    if space != "global":
        raise UnknownInstruction("2-byte stores to shared memory not implemented")
    src = dec.src(st.operands[1], dt)
    base, off = dec.address(st.operands[0])
    what = f"line {st.line}: {st.text}"

    def fn(w, mask):
        sel = w.active(mask)
        addr = np.broadcast_to(base(w.r) + off, (LANES,))[sel].astype(np.uint64)
        w.block.glob.write16(addr, np.broadcast_to(src(w.r), (LANES,))[sel].view(np.uint16), w.tids[sel],
                             w.block.describe, what)
    return fn


def _st(dec: Decoder, st, parts):
    space, n = _space_and_width(parts)
    if space == "param":
        raise UnknownInstruction("st.param not implemented")
    dt = DTYPES[type_of(parts)]
    if np.dtype(dt).itemsize == 2 and n == 1:
        return _st16(dec, st, space, dt)
    srcs = [dec.src(x, dt) for x in dec.vector(st.operands[1])]
    if len(srcs) != n:
        raise UnknownInstruction(f"{n} sources expected")
    _words_per(dt)
    base, off = dec.address(st.operands[0])
    what = f"line {st.line}: {st.text}"

    def fn(w, mask):
        r = w.r
        addr = np.broadcast_to(base(r) + off, (LANES,))
        sel = w.active(mask)
        vals = np.empty((LANES, n), dtype=dt)
        for j, s in enumerate(srcs):
            vals[:, j] = s(r)
        w.store(space, addr[sel], vals[sel].view(np.uint32), sel, what)
    return fn


def _cp_async(dec: Decoder, st, parts):
    if len(parts) < 3 or parts[1] != "async":
        raise UnknownInstruction("only cp.async is implemented")
    q = parts[2:]
    what = f"line {st.line}: {st.text}"
    if q == ["commit_group"]:
        return lambda w, mask: w.cp_commit(mask)
    if q == ["wait_group"]:
        n = parse_int(st.operands[0])
        return lambda w, mask: w.cp_wait(n, mask, what)
    if q == ["wait_all"]:
        def wait_all(w, mask):
            w.cp_commit(mask)
            w.cp_wait(0, mask, what)
        return wait_all
    if q[:4] == ["bulk", "prefetch", "L2", "global"]:
        return _prefetch_l2(dec, st, q[4:])
    if q[0] == "bulk":
        from mage_gen.interp.hopper import cp_bulk  # TMA copies and their bulk groups

        return cp_bulk(dec, st, parts)
    if q[0] not in ("ca", "cg") or len(q) < 3 or q[1] not in ("shared", "shared::cta") or q[2] != "global":
        raise UnknownInstruction("cp.async form not implemented")
    extra = [p for p in q[3:] if not re.match(r"L2::(64B|128B|256B)$", p)]
    if extra:
        raise UnknownInstruction(f"cp.async modifier(s) {extra} not implemented")
    if len(st.operands) > 4:
        raise UnknownInstruction("cp.async with a cache policy operand not implemented")
    size = parse_int(st.operands[2])
    if size not in (4, 8, 16) or (q[0] == "cg" and size != 16):
        raise UnknownInstruction(f"cp.async.{q[0]} of {size} bytes")
    dbase, doff = dec.address(st.operands[0])
    sbase, soff = dec.address(st.operands[1])
    src_size = dec.src(st.operands[3], np.uint32) if len(st.operands) > 3 else None

    def fn(w, mask):
        r = w.r
        sel = w.active(mask)
        dst = np.broadcast_to(dbase(r) + doff, (LANES,))[sel]
        src = np.broadcast_to(sbase(r) + soff, (LANES,))[sel]
        ssz = None if src_size is None else np.broadcast_to(src_size(r), (LANES,))[sel]
        w.cp_issue(dst, src, size, ssz, sel, what)
    return fn


def _prefetch_l2(dec: Decoder, st, extra: list[str]):
    """cp.async.bulk.prefetch.L2.global[.L2::cache_hint] [addr], size[, policy]: no value moves, so it only has
    to ask for bytes that exist, under a policy createpolicy made. A GPU may drop a prefetch of unmapped memory or
    fault on it; here every byte asked must lie in one argument buffer, from a 16-byte-aligned address, in whole
    16-byte units."""
    hinted = extra == ["L2::cache_hint"]
    if (extra and not hinted) or len(st.operands) != (3 if hinted else 2):
        raise UnknownInstruction(f"cp.async.bulk.prefetch.L2 form {extra} with {len(st.operands)} operands not implemented")
    base, off = dec.address(st.operands[0])
    size = dec.src(st.operands[1], np.uint32)
    policy = dec.src(st.operands[2], np.uint64) if hinted else None
    what = f"line {st.line}: {st.text}"

    def fn(w, mask):
        r = w.r
        sel = w.active(mask)
        keep = False
        if policy is not None:
            values = np.broadcast_to(policy(r), (LANES,))[sel]
            _check_policy(values, what)
            keep = bool(np.any(values == _POLICY_TAG | np.uint64(_PRIORITIES.index("L2::evict_last"))))
        addr = np.broadcast_to(base(r) + off, (LANES,))[sel]
        sizes = np.broadcast_to(size(r), (LANES,))[sel].astype(np.int64)
        w.prefetch_l2(addr, sizes, sel, what, keep)
    return fn


# createpolicy's result is opaque: here a tag in the high bits, to tell a policy from any other value, and the
# priority's index. The interpreter has no cache: a policy changes only which lines a launch leaves kept at
# evict-last (Stats.kept_lines).
_POLICY_TAG = np.uint64(0xC0DE_0000_0000_0000)
_POLICY_MASK = np.uint64(0xFFFF_0000_0000_0000)
_PRIORITIES = ("L2::evict_last", "L2::evict_normal", "L2::evict_first", "L2::evict_unchanged")


def _createpolicy(dec: Decoder, st, parts):
    """createpolicy.fractional.L2::evict_*.b64 policy[, 1.0]: every access under it at that priority."""
    if parts[1:2] != ["fractional"] or parts[-1] != "b64" or len(parts) != 4 or parts[2] not in _PRIORITIES:
        raise UnknownInstruction("only createpolicy.fractional.L2::evict_*.b64 (one priority) is implemented")
    if len(st.operands) not in (1, 2):
        raise UnknownInstruction("createpolicy takes a destination and at most a fraction")
    if len(st.operands) == 2 and st.operands[1].strip() not in ("1.0", "0f3F800000", "0d3FF0000000000000"):
        raise UnknownInstruction("createpolicy of a fraction other than 1.0 not implemented")
    d = dec.dst(st.operands[0])
    value = _POLICY_TAG | np.uint64(_PRIORITIES.index(parts[2]))
    return lambda w, m: w.put(d, np.full(LANES, value, np.uint64), m)


def _applypriority(dec: Decoder, st, parts):
    """applypriority.global.L2::evict_normal [addr], 128: no value moves; the line must be a 128-byte line,
    aligned, that holds a byte of an argument buffer."""
    if parts[1:] != ["global", "L2::evict_normal"] or len(st.operands) != 2 or parse_int(st.operands[1]) != 128:
        raise UnknownInstruction("only applypriority.global.L2::evict_normal [a], 128 is implemented")
    base, off = dec.address(st.operands[0])
    what = f"line {st.line}: {st.text}"

    def fn(w, mask):
        sel = w.active(mask)
        w.apply_priority(np.broadcast_to(base(w.r) + off, (LANES,))[sel], sel, what)
    return fn


def _check_policy(values: np.ndarray, what: str) -> None:
    if np.any((values & _POLICY_MASK) != _POLICY_TAG):
        raise InterpError(f"{what}: the cache policy operand is not a value createpolicy made")


def _shfl(dec: Decoder, st, parts):
    if parts[1] != "sync" or parts[2] not in ("bfly", "down", "up", "idx") or parts[-1] != "b32":
        raise UnknownInstruction("shfl form not implemented (need shfl.sync.{bfly,down,up,idx}.b32)")
    mode = parts[2]
    dsts = st.operands[0].split("|")
    d = dec.dst(dsts[0])
    p = dec.dst(dsts[1]) if len(dsts) > 1 else -1
    a = dec.src(st.operands[1], np.uint32)
    b = dec.src(st.operands[2], np.uint32)
    c = dec.src(st.operands[3], np.uint32)
    member = dec.const(st.operands[4], np.uint32)
    if member is None:
        raise UnknownInstruction("shfl.sync with a register membermask not implemented")
    members = ((int(member) >> np.arange(LANES)) & 1).astype(bool)
    what = f"line {st.line}: {st.text}"
    lane = np.arange(LANES, dtype=np.int64)

    def plan(bv, cv):
        bv, cv = np.asarray(bv).astype(np.int64), np.asarray(cv).astype(np.int64)
        seg = (cv >> 8) & 0x1F
        clamp = cv & 0x1F
        min_lane = lane & seg
        max_lane = min_lane | (clamp & ~seg)
        if mode == "up":
            j = lane - bv
            ok = j >= max_lane
        elif mode == "down":
            j = lane + bv
            ok = j <= max_lane
        elif mode == "bfly":
            j = lane ^ bv
            ok = j <= max_lane
        else:
            j = min_lane | (bv & 0x1F & ~seg)
            ok = j <= max_lane
        return np.where(ok, j, lane), np.broadcast_to(ok, (LANES,))

    fixed = None
    if dec.const(st.operands[2], np.uint32) is not None and dec.const(st.operands[3], np.uint32) is not None:
        fixed = plan(dec.const(st.operands[2], np.uint32), dec.const(st.operands[3], np.uint32))

    def fn(w, mask):
        r = w.r
        active = w.live if mask is None else mask
        if (members & ~active).any() or (active & ~members).any():
            missing = np.flatnonzero(members & ~active)
            lane_ = int(missing[0]) if missing.size else int(np.flatnonzero(active & ~members)[0])
            raise DivergenceError(f"{what}: lane {lane_} of {w.describe_lane(lane_)}'s warp is named in the "
                                  "membermask but does not execute this shfl.sync with the others (or the reverse)")
        j, ok = fixed if fixed is not None else plan(b(r), c(r))
        av = np.broadcast_to(a(r), (LANES,))
        w.put(d, av[j], mask)
        if p >= 0:
            w.put(p, np.array(ok), mask)
    return fn


_SEMANTICS = ("relaxed", "acquire", "release", "acq_rel")
_ATOMIC_OPS = {("add", "u32"): lambda old, b: old + b, ("add", "s32"): lambda old, b: old + b,
               ("exch", "b32"): lambda old, b: b, ("exch", "u32"): lambda old, b: b}


def _atom(dec: Decoder, st, parts):
    """atom{.sem}{.scope}.global.op.type d, [a], b (and red, which returns nothing): add of .u32 / .s32 and exch of
    .b32, each lane in turn (lane order is one order a GPU may take). sem: relaxed (the default), acquire, release,
    acq_rel; scope: gpu (the default), sys or cta (which orders nothing across blocks). What the semantics order
    is kept by memory.Visibility."""
    q = parts[1:]
    sem = next((p for p in q if p in _SEMANTICS), "relaxed")
    scope = next((p for p in q if p in ("cta", "gpu", "sys")), "gpu")
    rest = [p for p in q if p not in _SEMANTICS and p not in ("cta", "gpu", "sys")]
    if len(rest) != 3 or rest[0] != "global" or (rest[1], rest[2]) not in _ATOMIC_OPS:
        raise UnknownInstruction(f"only {parts[0]}[.sem][.scope].global.add.u32/.s32 and .exch.b32 are implemented")
    if sum(p in _SEMANTICS for p in q) > 1 or sum(p in ("cta", "gpu", "sys") for p in q) > 1:
        raise UnknownInstruction(f"{parts[0]} with two semantics or two scopes")
    returns = parts[0] == "atom"
    if len(st.operands) != (3 if returns else 2):
        raise UnknownInstruction(f"{parts[0]} takes {'a destination, ' if returns else ''}an address and a value")
    dt = DTYPES[rest[2]]
    op = _ATOMIC_OPS[(rest[1], rest[2])]
    d = dec.dst(st.operands[0]) if returns else -1
    base, off = dec.address(st.operands[1 if returns else 0])
    value = dec.src(st.operands[2 if returns else 1], dt)
    what = f"line {st.line}: {st.text}"
    counted = scope != "cta"

    def fn(w, mask):
        glob = w.block.glob
        sel = w.active(mask)
        addr = np.broadcast_to(base(w.r) + off, (LANES,))[sel].astype(np.uint64)
        tids = w.tids[sel]
        idx = glob.word_index(addr, 4, tids, w.block.describe, what)
        values = np.broadcast_to(value(w.r), (LANES,))[sel].astype(dt)
        old = np.empty(len(tids), dtype=dt)
        for i, word in enumerate(idx.tolist()):  # one lane after another, each on the word's latest value
            old[i] = glob.words[word:word + 1].view(dt)[0]
            glob.words[word:word + 1].view(dt)[0] = op(old[i], values[i])
            if counted and glob.visibility is not None:
                glob.visibility.atomic(word, int(tids[i]), sem)
        if returns:
            w.put_lanes(d, old, mask)
    return fn


def _membar(dec: Decoder, st, parts):
    """membar.gl / .sys: fence.sc at gpu / sys scope; membar.cta orders nothing across blocks."""
    if parts[1:] not in (["gl"], ["sys"], ["cta"]) or st.operands:
        raise UnknownInstruction("only membar.cta, membar.gl and membar.sys are implemented")
    return memory_fence(parts[1] != "cta")


def memory_fence(counted: bool):
    """A fence.sc / fence.acq_rel (membar): at gpu or sys scope (counted), what memory.Visibility keeps of the
    thread's acquires and releases."""
    def fn(w, mask):
        visibility = w.block.glob.visibility
        if counted and visibility is not None:
            for tid in w.tids[w.active(mask)].tolist():
                visibility.fence(tid)
    return fn


BUILDERS = {"ld": _ld, "st": _st, "cp": _cp_async, "shfl": _shfl, "createpolicy": _createpolicy,
            "applypriority": _applypriority, "atom": _atom, "red": _atom, "membar": _membar}
