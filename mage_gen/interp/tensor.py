"""Warp-wide matrix instructions: mma.sync and ldmatrix, with the fragment layouts of the PTX ISA.

Every lane holds a fixed piece of each matrix; a warp's 32 lanes together hold it all. Lane l has
groupID g = l // 4 and threadID_in_group t = l % 4. For register j of a lane (h: the lower or upper 16-bit
half of a packed register), the element it holds:

  C, D   m16n8, f32     row g + 8·(j // 2),     col 2t + j % 2
  A      m16n8k16, 16b  row g + 8·(j % 2),      col 2t + h + 8·(j // 2)
  B      m16n8k16, 16b  row (k) 2t + h + 8·j,   col (n) g
  A      m16n8k8, tf32  row g + 8·(j % 2),      col t + 4·(j // 2)
  B      m16n8k8, tf32  row (k) t + 4·j,        col (n) g
  ldmatrix m8n8, matrix j: row g, cols 2t + h (with .trans: row 2t + h, col g); rows are read from the
  16-byte addresses lanes 8j..8j+7 give.

The products are formed from the exact inputs (a .tf32 operand's lower 13 bits are ignored, as the
hardware ignores them) and summed in float64, rounded once to f32: the hardware's order of summation is
not specified, so a kernel's result is checked against float64 with a tolerance, never bit for bit.
"""

from __future__ import annotations

import numpy as np

from mage_gen.interp import fp
from mage_gen.interp.errors import DivergenceError, InterpError, UnknownInstruction
from mage_gen.interp.program import LANES

_LANE = np.arange(LANES)
_G, _T = _LANE // 4, _LANE % 4


def accumulator_coords() -> tuple[np.ndarray, np.ndarray]:
    """(rows, cols), each (32 lanes, 4 registers), of an m16n8 f32 C or D fragment."""
    j = np.arange(4)
    return _G[:, None] + 8 * (j[None, :] // 2), 2 * _T[:, None] + j[None, :] % 2


def a16_coords() -> tuple[np.ndarray, np.ndarray]:
    """(rows, cols), each (32 lanes, 4 registers, 2 halves), of an m16n8k16 A fragment of 16-bit elements."""
    j, h = np.arange(4)[None, :, None], np.arange(2)[None, None, :]
    g, t = _G[:, None, None], _T[:, None, None]
    return np.broadcast_to(g + 8 * (j % 2), (LANES, 4, 2)), np.broadcast_to(2 * t + h + 8 * (j // 2), (LANES, 4, 2))


def b16_coords() -> tuple[np.ndarray, np.ndarray]:
    """(k rows, n cols), each (32 lanes, 2 registers, 2 halves), of an m16n8k16 B fragment."""
    j, h = np.arange(2)[None, :, None], np.arange(2)[None, None, :]
    g, t = _G[:, None, None], _T[:, None, None]
    return np.broadcast_to(2 * t + h + 8 * j, (LANES, 2, 2)), np.broadcast_to(g, (LANES, 2, 2))


def a_tf32_coords() -> tuple[np.ndarray, np.ndarray]:
    """(rows, cols), each (32 lanes, 4 registers), of an m16n8k8 tf32 A fragment."""
    j = np.arange(4)[None, :]
    return _G[:, None] + 8 * (j % 2), _T[:, None] + 4 * (j // 2)


def b_tf32_coords() -> tuple[np.ndarray, np.ndarray]:
    """(k rows, n cols), each (32 lanes, 2 registers), of an m16n8k8 tf32 B fragment."""
    j = np.arange(2)[None, :]
    return _T[:, None] + 4 * j, np.broadcast_to(_G[:, None], (LANES, 2))


_SHAPES = {  # shape: (K, input types, registers of A, of B)
    "m16n8k16": (16, ("bf16", "f16"), 4, 2),
    "m16n8k8": (8, ("tf32",), 4, 2),
}


def _whole_warp(w, mask, what: str) -> None:
    if mask is not None:
        lane = int(np.flatnonzero(~mask)[0])
        raise DivergenceError(f"{what}: lane {lane} of the warp does not execute this .sync.aligned instruction "
                              "with the others (every lane of the warp must)")


def _unpack16(words: np.ndarray, kind: str) -> np.ndarray:
    """(..., 2) floats of the lower and upper 16-bit halves of each word."""
    halves = np.stack([words & np.uint32(0xFFFF), words >> np.uint32(16)], axis=-1).astype(np.uint16)
    if kind == "bf16":
        return fp.bf16_to_f32(halves).astype(np.float64)
    return halves.view(np.float16).astype(np.float64)


def _mma(dec, st, parts):
    # mma.sync.aligned.<shape>.row.col.f32.<atype>.<btype>.f32
    if parts[1:3] != ["sync", "aligned"] or len(parts) != 10 or parts[4:6] != ["row", "col"]:
        raise UnknownInstruction("only mma.sync.aligned.<shape>.row.col.f32.<type>.<type>.f32 is implemented")
    shape, (dtype, atype, btype, ctype) = parts[3], parts[6:10]
    if shape not in _SHAPES or dtype != "f32" or ctype != "f32" or atype != btype or atype not in _SHAPES[shape][1]:
        raise UnknownInstruction(f"mma {shape} with .{dtype}.{atype}.{btype}.{ctype} not implemented")
    k, _, na, nb = _SHAPES[shape]
    if len(st.operands) != 4:
        raise UnknownInstruction("mma takes d, a, b, c")
    d = [dec.dst(x) for x in dec.vector(st.operands[0])]
    a = [dec.src(x, np.uint32) for x in dec.vector(st.operands[1])]
    b = [dec.src(x, np.uint32) for x in dec.vector(st.operands[2])]
    c = [dec.src(x, np.float32) for x in dec.vector(st.operands[3])]
    if (len(d), len(a), len(b), len(c)) != (4, na, nb, 4):
        raise UnknownInstruction(f"mma {shape} takes 4 d, {na} a, {nb} b and 4 c registers")
    what = f"line {st.line}: {st.text}"
    acc_rows, acc_cols = accumulator_coords()
    if atype == "tf32":
        (ar, ac), (br, bc) = a_tf32_coords(), b_tf32_coords()
    else:
        (ar, ac), (br, bc) = a16_coords(), b16_coords()

    def words(getters, r) -> np.ndarray:  # (32 lanes, registers)
        return np.stack([np.broadcast_to(g(r), (LANES,)) for g in getters], axis=1).astype(np.uint32)

    def fn(w, mask):
        _whole_warp(w, mask, what)
        r = w.r
        if atype == "tf32":
            av, bv = fp.tf32_operand(words(a, r)).astype(np.float64), fp.tf32_operand(words(b, r)).astype(np.float64)
        else:
            av, bv = _unpack16(words(a, r), atype), _unpack16(words(b, r), atype)
        A, B, C = np.zeros((16, k)), np.zeros((k, 8)), np.zeros((16, 8))
        A[ar, ac] = av
        B[br, bc] = bv
        C[acc_rows, acc_cols] = np.stack([np.broadcast_to(g(r), (LANES,)) for g in c], axis=1).astype(np.float64)
        D = (A @ B + C).astype(np.float32)
        for j, slot in enumerate(d):
            w.put(slot, D[acc_rows[:, j], acc_cols[:, j]], None)
    return fn


def _ldmatrix(dec, st, parts):
    # ldmatrix.sync.aligned.m8n8.x{1,2,4}{.trans}.shared{::cta}.b16 d, [addr]
    mods = parts[1:]
    if mods[:3] != ["sync", "aligned", "m8n8"] or mods[-1] != "b16" or mods[3] not in ("x1", "x2", "x4"):
        raise UnknownInstruction("only ldmatrix.sync.aligned.m8n8.x{1,2,4}[.trans].shared.b16 is implemented")
    rest = mods[4:-1]
    trans = "trans" in rest
    if [m for m in rest if m != "trans"] not in (["shared"], ["shared::cta"]):
        raise UnknownInstruction(f"ldmatrix modifiers {rest} not implemented")
    count = int(mods[3][1])
    d = [dec.dst(x) for x in dec.vector(st.operands[0])]
    if len(d) != count:
        raise UnknownInstruction(f"ldmatrix .x{count} writes {count} registers")
    base, off = dec.address(st.operands[1])
    what = f"line {st.line}: {st.text}"
    giving = _LANE < 8 * count  # the lanes whose addresses name the matrices' rows

    def fn(w, mask):
        _whole_warp(w, mask, what)
        addr = np.broadcast_to(base(w.r) + off, (LANES,)).astype(np.uint64)
        rows = addr[giving]
        if (bad := np.flatnonzero(rows % np.uint64(16))).size:
            raise InterpError(f"{what}: lane {int(bad[0])} gives row address {int(rows[bad[0]]):#x}, not 16-byte "
                              "aligned as ldmatrix requires")
        words = w.load("shared", rows, 4, giving, what)  # (8·count rows, 4 words of two b16)
        halves = np.stack([words & np.uint32(0xFFFF), words >> np.uint32(16)], axis=-1).reshape(count, 8, 8)
        for j, slot in enumerate(d):
            m = halves[j]
            lo, hi = (m[2 * _T, _G], m[2 * _T + 1, _G]) if trans else (m[_G, 2 * _T], m[_G, 2 * _T + 1])
            w.put(slot, (lo.astype(np.uint32) | (hi.astype(np.uint32) << np.uint32(16))).astype(np.uint32), None)
    return fn


BUILDERS = {"mma": _mma, "ldmatrix": _ldmatrix}
