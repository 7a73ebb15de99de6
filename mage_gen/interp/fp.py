"""fp32 arithmetic that rounds the way the GPU does.

add/sub/mul/div/sqrt on np.float32 arrays are IEEE-754 round-to-nearest-even, as PTX's .rn is.

fma.rn.f32 needs one rounding of a·b + c. The product of two floats is exact in float64 (24 + 24 = 48
significant bits ≤ 53), but the sum a·b + c rounded to float64 and then to float32 is rounded TWICE and
is NOT always right: with a = 97·2⁻⁷, b = 172961·2⁻¹⁷ (a·b = 1 + 2⁻²⁴ exactly, since 2²⁴ + 1 = 97·172961)
and c = 2⁻⁸⁰, float64 gives 1 + 2⁻²⁴, a float32 tie that rounds to 1, while the exact sum lies above
the tie and rounds to 1 + 2⁻²³ (tests/test_interp.py checks both). So fma_f32 computes the float64 sum
with its exact error (TwoSum) and, where the float64 sum is exactly a float32 tie, lets the error's sign
break it.

bf16 and f16 (cvt.f32.bf16 / .f16, cvt.rn.bf16x2.f32 / .f16x2.f32): widening is exact; narrowing rounds to
nearest even, overflowing to infinity. A NaN narrows to the canonical NaN 0x7FFF: finite values and
infinities are bit-exact (tests/test_interp.py compares every case with torch's conversion), a NaN's
payload is not modelled.

Where the GPU may differ: add/mul without a rounding modifier may be fused into an fma by ptxas, and
rsqrt.approx / ex2.approx / rcp.approx / div.full / div.approx are approximations on the GPU; here they are computed correctly
rounded, which lies within their documented error. The op tolerances absorb both.
"""

from __future__ import annotations

import numpy as np

F32_MIN_NORMAL = np.float32(1.1754944e-38)


def fma_f32(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    p = a.astype(np.float64) * b  # exact
    c64 = np.asarray(c, dtype=np.float64)
    s = p + c64
    r = s.astype(np.float32)
    # A float32 tie has at least 28 zero bits at the bottom of its float64 significand.
    low = (s.view(np.uint64) & np.uint64(0x0FFFFFFF)) == 0
    if not low.any():
        return r
    bb = s - p
    err = (p - (s - bb)) + (c64 - bb)  # TwoSum: p + c == s + err exactly
    r64 = r.astype(np.float64)
    d = s - r64  # s lies between r and its neighbour towards d
    toward = np.where(d > 0, np.float32(np.inf), np.float32(-np.inf)).astype(np.float32)
    n = np.nextafter(r, toward)
    tie = (d != 0) & (2 * np.abs(d) == np.abs(n.astype(np.float64) - r64)) & np.isfinite(n)
    fix = tie & (err != 0) & (np.sign(err) == np.sign(d))
    return np.where(fix, n, r).astype(np.float32)


def ftz(x: np.ndarray) -> np.ndarray:
    """Flush float32 subnormals to a zero of the same sign (.ftz)."""
    return np.where(np.abs(x) < F32_MIN_NORMAL, np.copysign(np.float32(0), x), x).astype(np.float32)


def rsqrt_f32(x: np.ndarray) -> np.ndarray:
    """1/sqrt(x), correctly rounded: within rsqrt.approx's documented error (2^-22.9 relative)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        return (1.0 / np.sqrt(x.astype(np.float64))).astype(np.float32)


def ex2_f32(x: np.ndarray) -> np.ndarray:
    """2^x, correctly rounded: within ex2.approx's documented error (2^-22.5 relative); inf past 128, 0 far below."""
    with np.errstate(over="ignore"):
        return np.exp2(x.astype(np.float64)).astype(np.float32)


CANONICAL_HALF_NAN = np.uint16(0x7FFF)


def bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    """The float32 a bf16's bits stand for: its upper half."""
    return (np.asarray(bits).astype(np.uint32) << np.uint32(16)).view(np.float32)


def f32_to_bf16(x: np.ndarray) -> np.ndarray:
    """cvt.rn.bf16.f32: the bits of x rounded to nearest even bf16."""
    x = np.asarray(x, dtype=np.float32)
    u = x.view(np.uint32).astype(np.uint64)
    rounded = ((u + np.uint64(0x7FFF) + ((u >> np.uint64(16)) & np.uint64(1))) >> np.uint64(16)).astype(np.uint16)
    return np.where(np.isnan(x), CANONICAL_HALF_NAN, rounded).astype(np.uint16)


def f32_to_f16(x: np.ndarray) -> np.ndarray:
    """cvt.rn.f16.f32 as bits: IEEE round to nearest even (numpy's conversion), NaN canonical."""
    x = np.asarray(x, dtype=np.float32)
    with np.errstate(over="ignore"):
        bits = x.astype(np.float16).view(np.uint16)
    return np.where(np.isnan(x), CANONICAL_HALF_NAN, bits).astype(np.uint16)


def f32_to_tf32_rna(x: np.ndarray) -> np.ndarray:
    """cvt.rna.tf32.f32: x rounded to 10 explicit mantissa bits, ties away from zero, as a .b32 whose low 13
    bits are zero. Adding half of the dropped range to the magnitude's bits and truncating rounds ties away;
    a carry out of the mantissa lands in the exponent, as it should. NaN stays a NaN."""
    x = np.asarray(x, dtype=np.float32)
    bits = x.view(np.uint32)
    rounded = (bits + np.uint32(0x1000)) & np.uint32(0xFFFFE000)
    return np.where(np.isnan(x), np.uint32(0x7FFFE000), rounded).astype(np.uint32)


def f32_to_tf32_rn(x: np.ndarray) -> np.ndarray:
    """cvt.rn.tf32.f32: x rounded to 10 explicit mantissa bits, ties to even, as a .b32 whose low 13 bits are
    zero. Adding just under half of the dropped range, plus the kept lowest bit, to the magnitude's bits and
    truncating rounds ties to the even neighbour; a carry lands in the exponent (past the largest finite value,
    in infinity). NaN stays a NaN."""
    x = np.asarray(x, dtype=np.float32)
    bits = x.view(np.uint32)
    rounded = (bits + np.uint32(0xFFF) + ((bits >> np.uint32(13)) & np.uint32(1))) & np.uint32(0xFFFFE000)
    return np.where(np.isnan(x), np.uint32(0x7FFFE000), rounded).astype(np.uint32)


def tf32_operand(bits: np.ndarray) -> np.ndarray:
    """What an mma's .tf32 operand is: the register's upper 19 bits, the lower 13 ignored."""
    return (np.asarray(bits, dtype=np.uint32) & np.uint32(0xFFFFE000)).view(np.float32)
