"""Arithmetic, logic, comparison, selection, conversion and moves: one builder per PTX opcode.

A builder gets the decoder, the statement and the opcode's dotted parts and returns fn(warp, mask),
which computes on all 32 lanes and writes only the lanes in mask (None: every lane)."""

from __future__ import annotations

import numpy as np

from mage_gen.interp import fp
from mage_gen.interp.errors import UnknownInstruction
from mage_gen.interp.memory import SHARED_GENERIC_BASE
from mage_gen.interp.program import DTYPES, LANES, Decoder

TYPES = set(DTYPES)


def type_of(parts: list[str]) -> str:
    types = [p for p in parts if p in TYPES]
    if not types:
        raise UnknownInstruction("no operand type")
    return types[-1]


def _unsupported(parts, mods) -> None:
    bad = [p for p in parts[1:] if p not in mods and p not in TYPES]
    if bad:
        raise UnknownInstruction(f"modifier(s) {', '.join('.' + b for b in bad)} not implemented")


def _float_mods(parts, typ, extra=()) -> bool:
    """Returns whether .ftz applies; raises for rounding modes other than round-to-nearest."""
    _unsupported(parts, {"rn", "ftz", "approx", "full", "sat", *extra})
    if "sat" in parts:
        raise UnknownInstruction(".sat not implemented")
    return "ftz" in parts and typ == "f32"


def _emit(dec: Decoder, dst: str, compute):
    """fn(warp, mask) writing compute(registers) to dst; a 0-d result (every source an immediate) is spread
    over the lanes."""
    d = dec.dst(dst)

    def fn(w, m):
        w.put(d, _full(compute(w.r)), m)
    return fn


def _binary(f):
    def build(dec: Decoder, st, parts):
        typ = type_of(parts)
        dt = DTYPES[typ]
        if np.dtype(dt).kind == "f":
            ftz = _float_mods(parts, typ)
        else:
            ftz = False
            _unsupported(parts, {"lo", "hi", "wide", "cc"} if parts[0] == "mul" else set())
        op = f
        if parts[0] == "mul" and np.dtype(dt).kind in "iu":
            mode = "lo" if "lo" in parts else "wide" if "wide" in parts else "hi" if "hi" in parts else None
            if mode is None:
                raise UnknownInstruction("integer mul needs .lo, .hi or .wide")
            op = {"lo": np.multiply, "wide": _mul_wide, "hi": _mul_hi}[mode]
        a, b = dec.src(st.operands[1], dt), dec.src(st.operands[2], dt)
        if ftz:
            return _emit(dec, st.operands[0], lambda r: fp.ftz(op(fp.ftz(a(r)), fp.ftz(b(r)))))
        return _emit(dec, st.operands[0], lambda r: op(a(r), b(r)))
    return build


def _full(x):
    x = np.asarray(x)
    return x if x.ndim else np.full(LANES, x)


_WIDER = {np.dtype(np.int32): np.int64, np.dtype(np.uint32): np.uint64, np.dtype(np.int16): np.int32,
          np.dtype(np.uint16): np.uint32}


def _mul_wide(a, b):
    wide = _WIDER[np.asarray(a).dtype]
    return np.asarray(a).astype(wide) * np.asarray(b).astype(wide)


def _mul_hi(a, b):
    dt = np.asarray(a).dtype
    bits = dt.itemsize * 8
    if bits == 64:  # the upper half of a 128-bit product, in Python's integers (a division by a constant's magic number)
        a64, b64 = np.broadcast_arrays(np.asarray(a), np.asarray(b))
        return np.array([(int(x) * int(y)) >> 64 for x, y in zip(a64.ravel(), b64.ravel())],
                        dtype=dt).reshape(a64.shape)
    wide = np.int64 if dt.kind == "i" else np.uint64
    return ((np.asarray(a).astype(wide) * np.asarray(b).astype(wide)) >> bits).astype(dt)


def _div(a, b):
    a, b = np.asarray(a), np.asarray(b)
    if a.dtype.kind == "f":
        return a / b
    safe = np.where(b == 0, 1, b).astype(a.dtype)
    q = a // safe
    if a.dtype.kind == "i":
        q = q + ((a % safe != 0) & ((a < 0) ^ (safe < 0))).astype(a.dtype)
    return q


def _rem(a, b):
    a, b = np.asarray(a), np.asarray(b)
    safe = np.where(b == 0, 1, b).astype(a.dtype)
    return (a - _div(a, safe) * safe).astype(a.dtype)


def _minmax(f_int, f_float):
    def f(a, b):
        return (f_float if np.asarray(a).dtype.kind == "f" else f_int)(a, b)
    return f


def _shift(left: bool):
    def build(dec, st, parts):
        typ = type_of(parts)
        dt = np.dtype(DTYPES[typ])
        bits = dt.itemsize * 8
        a = dec.src(st.operands[1], dt)
        c = dec.const(st.operands[2], np.uint32)
        if c is not None and int(c) < bits:
            k = dt.type(int(c))
            comp = (lambda r: a(r) << k) if left else (lambda r: a(r) >> k)
        else:
            b = dec.src(st.operands[2], np.uint32)

            def comp(r):
                x, n = a(r), np.asarray(b(r)).astype(np.int64)
                big = n >= bits
                s = np.minimum(n, bits - 1).astype(dt)
                if left:
                    return np.where(big, dt.type(0), x << s)
                fill = np.where(x < 0, dt.type(-1), dt.type(0)) if dt.kind == "i" else dt.type(0)
                return np.where(big, fill, x >> s)
        return _emit(dec, st.operands[0], comp)
    return build


def _fma(dec, st, parts):
    typ = type_of(parts)
    dt = DTYPES[typ]
    a, b, c = (dec.src(o, dt) for o in st.operands[1:4])
    if np.dtype(dt).kind == "f":
        if typ != "f32":
            raise UnknownInstruction(f"{parts[0]}.{typ} not implemented")
        ftz = _float_mods(parts, typ)
        if ftz:
            return _emit(dec, st.operands[0], lambda r: fp.ftz(fp.fma_f32(fp.ftz(a(r)), fp.ftz(b(r)), fp.ftz(c(r)))))
        return _emit(dec, st.operands[0], lambda r: fp.fma_f32(a(r), b(r), c(r)))
    _unsupported(parts, {"lo", "wide", "hi"})
    if "wide" in parts:  # the addend and the result are twice as wide as the factors
        c_wide = dec.src(st.operands[3], _WIDER[np.dtype(dt)])
        return _emit(dec, st.operands[0], lambda r: _mul_wide(a(r), b(r)) + c_wide(r))
    if "lo" not in parts:
        raise UnknownInstruction("integer mad needs .lo or .wide")
    return _emit(dec, st.operands[0], lambda r: a(r) * b(r) + c(r))


def _unary(f_int, f_float):
    def build(dec, st, parts):
        typ = type_of(parts)
        dt = DTYPES[typ]
        a = dec.src(st.operands[1], dt)
        if np.dtype(dt).kind == "f":
            ftz = _float_mods(parts, typ)
            if f_float is None:
                raise UnknownInstruction(f"{parts[0]}.{typ} not implemented")
            if ftz:
                return _emit(dec, st.operands[0], lambda r: fp.ftz(f_float(fp.ftz(a(r)))))
            return _emit(dec, st.operands[0], lambda r: f_float(a(r)))
        if f_int is None:
            raise UnknownInstruction(f"{parts[0]}.{typ} not implemented")
        return _emit(dec, st.operands[0], lambda r: f_int(a(r)))
    return build


def _recip(x):
    return (np.float32(1) / x).astype(np.float32) if x.dtype == np.float32 else 1 / x


def _sqrt(x):
    return np.sqrt(x)


def _logic(f):
    def build(dec, st, parts):
        typ = type_of(parts)
        dt = DTYPES[typ]
        srcs = [dec.src(o, dt) for o in st.operands[1:]]
        if len(srcs) == 1:
            return _emit(dec, st.operands[0], lambda r: f(srcs[0](r)))
        a, b = srcs
        return _emit(dec, st.operands[0], lambda r: f(a(r), b(r)))
    return build


_CMP = {
    "eq": np.equal, "ne": np.not_equal, "lt": np.less, "le": np.less_equal, "gt": np.greater,
    "ge": np.greater_equal, "lo": np.less, "ls": np.less_equal, "hi": np.greater, "hs": np.greater_equal,
}


def _compare(cmp: str, kind: str):
    """(a, b) -> bool lanes, with PTX's ordered/unordered float semantics."""
    if cmp in ("num", "nan"):
        return (lambda a, b: ~(np.isnan(a) | np.isnan(b))) if cmp == "num" else (lambda a, b: np.isnan(a) | np.isnan(b))
    unordered = cmp.endswith("u") and cmp[:-1] in _CMP and kind == "f"
    f = _CMP[cmp[:-1] if unordered else cmp]
    if kind != "f":
        return f
    if unordered:
        return lambda a, b: f(a, b) | np.isnan(a) | np.isnan(b)
    if cmp == "ne":
        return lambda a, b: (a != b) & ~(np.isnan(a) | np.isnan(b))
    return f


def _setp(dec, st, parts):
    typ = type_of(parts)
    dt = DTYPES[typ]
    cmp = parts[1]
    if cmp not in _CMP and not (cmp.endswith("u") and cmp[:-1] in _CMP) and cmp not in ("num", "nan"):
        raise UnknownInstruction(f"comparison .{cmp} not understood")
    combine = next((p for p in parts[2:] if p in ("and", "or", "xor")), None)
    _unsupported(parts[1:], {cmp, "and", "or", "xor", "ftz"})
    f = _compare(cmp, np.dtype(dt).kind)
    if "ftz" in parts and typ == "f32":
        plain = f
        f = lambda a, b: plain(fp.ftz(a), fp.ftz(b))  # noqa: E731
    dsts = st.operands[0].split("|")
    a, b = dec.src(st.operands[1], dt), dec.src(st.operands[2], dt)
    c = dec.src(st.operands[3], np.bool_) if combine else None
    join = {"and": np.logical_and, "or": np.logical_or, "xor": np.logical_xor}.get(combine)
    p = dec.dst(dsts[0])
    q = dec.dst(dsts[1]) if len(dsts) > 1 else -1

    def fn(w, m):
        r = w.r
        t = _full(f(a(r), b(r)))
        if join is None:
            w.put(p, t, m)
            if q >= 0:
                w.put(q, ~t, m)
        else:
            cv = c(r)
            w.put(p, _full(join(t, cv)), m)
            if q >= 0:
                w.put(q, _full(join(~t, cv)), m)
    return fn


def _selp(dec, st, parts):
    dt = DTYPES[type_of(parts)]
    a, b = dec.src(st.operands[1], dt), dec.src(st.operands[2], dt)
    c = dec.src(st.operands[3], np.bool_)
    return _emit(dec, st.operands[0], lambda r: np.where(c(r), a(r), b(r)).astype(dt))


def _mov(dec, st, parts):
    typ = type_of(parts)
    dt = DTYPES[typ]
    if len(st.operands) != 2:
        raise UnknownInstruction("mov takes a destination and a source")
    dst, src = st.operands[0].strip(), st.operands[1].strip()
    if dst.startswith("{") or src.startswith("{"):
        return _mov_vector(dec, dt, dst, src)
    return _emit(dec, dst, dec.src(src, dt))


_UNSIGNED = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def _mov_vector(dec, dt, dst: str, src: str):
    """mov.bN {a, b, ...}, x splits x into equal parts, the first from the lowest bits; mov.bN x, {a, b, ...}
    joins them the same way."""
    size = np.dtype(dt).itemsize
    if np.dtype(dt).kind != "u" or (dst.startswith("{") == src.startswith("{")):
        raise UnknownInstruction("mov with a vector operand is implemented for one bit-typed side only")
    names = dec.vector(dst if dst.startswith("{") else src)
    if size % len(names):
        raise UnknownInstruction(f"{len(names)} parts do not split a {8 * size}-bit register")
    part = _UNSIGNED[size // len(names)]
    bits = np.uint64(8 * (size // len(names)))
    if dst.startswith("{"):
        whole = dec.src(src, dt)
        slots = [dec.dst(n) for n in names]

        def split(w, m):
            value = _full(whole(w.r)).astype(np.uint64)
            for i, slot in enumerate(slots):
                w.put(slot, ((value >> (bits * np.uint64(i))) & np.uint64((1 << int(bits)) - 1)).astype(part), m)
        return split
    pieces = [dec.src(n, part) for n in names]

    def join(r):
        value = np.zeros(LANES, np.uint64)
        for i, piece in enumerate(pieces):
            value |= _full(piece(r)).astype(np.uint64) << (bits * np.uint64(i))
        return value.astype(dt)
    return _emit(dec, dst, join)


def _cvt_half(dec, st, dtyp: str, styp: str, rnd: str | None):
    """Conversions between f32 and bf16 / f16, single and packed in pairs (bf16 held as its bits)."""
    if dtyp == "f32" and styp in ("bf16", "f16"):
        a = dec.src(st.operands[1], np.uint16)
        widen = fp.bf16_to_f32 if styp == "bf16" else (lambda bits: np.asarray(bits).view(np.float16).astype(np.float32))
        return _emit(dec, st.operands[0], lambda r: widen(_full(a(r))))
    narrow = {"bf16": fp.f32_to_bf16, "f16": fp.f32_to_f16, "bf16x2": fp.f32_to_bf16, "f16x2": fp.f32_to_f16}.get(dtyp)
    if styp != "f32" or narrow is None:
        raise UnknownInstruction(f"cvt from .{styp} to .{dtyp} not implemented")
    if rnd != "rn":
        raise UnknownInstruction(f"cvt to .{dtyp} is implemented with .rn only")
    if dtyp.endswith("x2"):  # d = {a in the upper half, b in the lower}
        if len(st.operands) != 3:
            raise UnknownInstruction(f"cvt.rn.{dtyp}.f32 takes a destination and two sources")
        upper, lower = dec.src(st.operands[1], np.float32), dec.src(st.operands[2], np.float32)
        return _emit(dec, st.operands[0], lambda r: (narrow(_full(upper(r))).astype(np.uint32) << np.uint32(16))
                     | narrow(_full(lower(r))).astype(np.uint32))
    a = dec.src(st.operands[1], np.float32)
    return _emit(dec, st.operands[0], lambda r: narrow(_full(a(r))))


_ROUND_INT = {"rni": np.rint, "rzi": np.trunc, "rmi": np.floor, "rpi": np.ceil}


def _cvt(dec, st, parts):
    types = [p for p in parts if p in TYPES]
    if len(types) != 2:
        raise UnknownInstruction("cvt needs a destination and a source type")
    dtyp, styp = types
    ddt, sdt = np.dtype(DTYPES[dtyp]), np.dtype(DTYPES[styp])
    mods = [p for p in parts[1:] if p not in TYPES]
    if dtyp == "tf32":
        if styp != "f32":
            raise UnknownInstruction(f"cvt from .{styp} to .tf32 not implemented")
        _unsupported(parts, {"rna", "rn"})
        if len(mods) != 1:
            raise UnknownInstruction("cvt to .tf32 takes one rounding, .rna or .rn")
        rounding = fp.f32_to_tf32_rna if mods == ["rna"] else fp.f32_to_tf32_rn
        a = dec.src(st.operands[1], np.float32)
        return _emit(dec, st.operands[0], lambda r: rounding(_full(a(r))))
    if {"bf16", "bf16x2", "f16x2"} & {dtyp, styp} or (dtyp == "f16" and styp == "f32") or (styp == "f16" and dtyp == "f32"):
        _unsupported(parts, {"rn"})
        return _cvt_half(dec, st, dtyp, styp, "rn" if "rn" in mods else None)
    _unsupported(parts, {"rn", "rz", "rm", "rp", "rni", "rzi", "rmi", "rpi", "ftz", "sat"})
    a = dec.src(st.operands[1], sdt.type)
    rnd = next((x for x in mods if x in ("rn", "rz", "rm", "rp", "rni", "rzi", "rmi", "rpi")), None)
    ftz = "ftz" in mods
    sat = "sat" in mods
    if ftz and sdt == np.float32:  # .ftz flushes an f32 source as well as an f32 destination
        unflushed = a
        a = lambda r: fp.ftz(unflushed(r))  # noqa: E731

    if ddt.kind in "iu" and sdt.kind in "iu":
        if rnd:
            raise UnknownInstruction("rounding modifier on an integer-to-integer cvt")
        if sat:
            info = np.iinfo(ddt)
            comp = lambda r: np.clip(np.asarray(a(r)).astype(np.int64), info.min, info.max).astype(ddt)  # noqa: E731
        else:
            comp = lambda r: np.asarray(a(r)).astype(ddt)  # noqa: E731
    elif ddt.kind == "f" and sdt.kind in "iu":
        if rnd not in (None, "rn"):
            raise UnknownInstruction(f"cvt.{rnd} from integer to float not implemented")
        comp = lambda r: np.asarray(a(r)).astype(ddt)  # noqa: E731
    elif ddt.kind in "iu" and sdt.kind == "f":
        f = _ROUND_INT.get(rnd)
        if f is None:
            raise UnknownInstruction("float-to-integer cvt needs .rni, .rzi, .rmi or .rpi")
        info = np.iinfo(ddt)

        def comp(r):
            x = f(np.asarray(a(r)).astype(np.float64))
            x = np.where(np.isnan(x), 0, np.clip(x, info.min, info.max))
            return x.astype(ddt)
    else:  # float to float
        if rnd in _ROUND_INT:
            g = _ROUND_INT[rnd]
            comp = lambda r: g(np.asarray(a(r))).astype(ddt)  # noqa: E731
        elif ddt.itemsize < sdt.itemsize and rnd not in (None, "rn"):
            raise UnknownInstruction(f"cvt.{rnd} narrowing not implemented")
        else:
            comp = lambda r: np.asarray(a(r)).astype(ddt)  # noqa: E731
        if sat:
            inner = comp
            comp = lambda r: np.where(np.isnan(inner(r)), 0, np.clip(inner(r), 0, 1)).astype(ddt)  # noqa: E731
    if ftz and ddt == np.float32:
        inner2 = comp
        comp = lambda r: fp.ftz(inner2(r))  # noqa: E731
    return _emit(dec, st.operands[0], comp)


def _cvta(dec, st, parts):
    _unsupported(parts, {"to", "global", "shared", "cta", "shared::cta"})
    dt = DTYPES[type_of(parts)]
    a = dec.src(st.operands[1], dt)
    base = dt(SHARED_GENERIC_BASE) if np.dtype(dt).itemsize == 8 else None
    if "global" in parts:
        return _emit(dec, st.operands[0], a)
    if "shared" not in parts and "shared::cta" not in parts:
        raise UnknownInstruction("cvta to or from this state space not implemented")
    if base is None:
        raise UnknownInstruction("32-bit cvta.shared not implemented")
    if "to" in parts:
        return _emit(dec, st.operands[0], lambda r: a(r) - base)
    return _emit(dec, st.operands[0], lambda r: a(r) + base)


def _bfi(dec, st, parts):
    dt = np.dtype(DTYPES[type_of(parts)])
    bits = dt.itemsize * 8
    a, b = dec.src(st.operands[1], dt.type), dec.src(st.operands[2], dt.type)
    c, d = dec.src(st.operands[3], np.uint32), dec.src(st.operands[4], np.uint32)

    def comp(r):
        pos = np.minimum(np.asarray(c(r)).astype(np.int64) & 0xFF, bits)
        ln = np.minimum(np.asarray(d(r)).astype(np.int64) & 0xFF, bits - pos)
        mask = (((np.int64(1) << ln) - 1) << pos).astype(np.uint64)
        av = np.asarray(a(r)).astype(np.uint64) << pos.astype(np.uint64)
        bv = np.asarray(b(r)).astype(np.uint64)
        return ((bv & ~mask) | (av & mask)).astype(f"u{dt.itemsize}").view(dt)
    return _emit(dec, st.operands[0], comp)


def _copysign(dec, st, parts):
    dt = DTYPES[type_of(parts)]
    a, b = dec.src(st.operands[1], dt), dec.src(st.operands[2], dt)
    return _emit(dec, st.operands[0], lambda r: np.copysign(b(r), a(r)))


def _rsqrt(dec, st, parts):
    typ = type_of(parts)
    if typ != "f32" or "approx" not in parts:
        raise UnknownInstruction("only rsqrt.approx(.ftz).f32 is implemented")
    return _unary(None, fp.rsqrt_f32)(dec, st, parts)


def _ex2(dec, st, parts):
    if type_of(parts) != "f32" or "approx" not in parts:
        raise UnknownInstruction("only ex2.approx(.ftz).f32 is implemented")
    return _unary(None, fp.ex2_f32)(dec, st, parts)


def _div_build(dec, st, parts):
    typ = type_of(parts)
    if np.dtype(DTYPES[typ]).kind == "f" and not {"rn", "full", "approx"} & set(parts):
        raise UnknownInstruction("float div needs .rn, .full or .approx")
    return _binary(_div)(dec, st, parts)


BUILDERS = {
    "add": _binary(np.add), "sub": _binary(np.subtract), "mul": _binary(np.multiply),
    "div": _div_build, "rem": _binary(_rem),
    "min": _binary(_minmax(np.minimum, np.fmin)), "max": _binary(_minmax(np.maximum, np.fmax)),
    "fma": _fma, "mad": _fma,
    "neg": _unary(np.negative, np.negative), "abs": _unary(np.abs, np.abs),
    "rcp": _unary(None, _recip), "sqrt": _unary(None, _sqrt), "rsqrt": _rsqrt, "ex2": _ex2,
    "and": _logic(np.bitwise_and), "or": _logic(np.bitwise_or), "xor": _logic(np.bitwise_xor),
    "not": _logic(np.invert), "shl": _shift(True), "shr": _shift(False),
    "setp": _setp, "selp": _selp, "mov": _mov, "cvt": _cvt, "cvta": _cvta, "bfi": _bfi, "copysign": _copysign,
}
