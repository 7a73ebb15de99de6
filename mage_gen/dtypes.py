"""Element types of the tensors a kernel reads and writes, on the host: how numpy holds them, how values are
rounded into them, and what a poisoned output looks like. Arithmetic inside the kernels is always fp32.

numpy has no bfloat16: a bf16 array is held as its raw 16-bit patterns (uint16); an fp16 array as float16.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mage_gen.errors import ConfigError


@dataclass(frozen=True)
class DType:
    name: str  # torch's name: float32, bfloat16, float16
    short: str  # what --dtype takes: fp32, bf16, fp16
    ptx: str  # the PTX type of one element: f32, bf16, f16
    c_type: str  # how a kernel parameter points to it
    itemsize: int
    storage: type  # the numpy type holding it
    unit_roundoff: float  # half the distance from 1 to the next representable value
    nan_bits: int  # a quiet NaN of this type, repeated to fill 32 bits

    @property
    def half(self) -> bool:
        return self.itemsize == 2

    def widen(self, array: np.ndarray) -> np.ndarray:
        """The values as float32; exact for every type here."""
        if self.name == "bfloat16":
            return (np.asarray(array, dtype=np.uint16).astype(np.uint32) << np.uint32(16)).view(np.float32)
        return np.asarray(array).astype(np.float32)

    def round(self, values: np.ndarray) -> np.ndarray:
        """float32 or float64 values rounded to nearest even into this type, once, as a kernel's cvt.rn does
        (torch's .to(dtype) does the same from float32; from float64 it rounds to float32 first)."""
        values = np.asarray(values)
        if self.name == "float32":
            return values.astype(np.float32)
        if self.name == "float16":
            return values.astype(np.float16)  # numpy rounds float64 to float16 directly, not through float32
        bits = values.astype(np.float32).view(np.uint32)
        if values.dtype == np.float64:
            _undo_double_rounding(values, bits)
        rounded = (bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
        return np.where(np.isnan(values), np.uint16(0x7FC0), rounded.astype(np.uint16))


def _undo_double_rounding(values: np.ndarray, bits: np.ndarray) -> None:
    """float64 → float32 → bf16, each to nearest even, differs from float64 → bf16 only where the float32 landed
    exactly on a bf16 tie (its low 16 bits 0x8000) from a float64 that was not one: there the float32 is
    moved one step back toward the float64, so the second rounding goes the way the first should have. Few
    elements are ever on a tie, so this costs a pass over the bits and little else."""
    flat_bits, flat_values = bits.reshape(-1), values.reshape(-1)
    ties = np.flatnonzero((flat_bits & np.uint32(0xFFFF)) == np.uint32(0x8000))
    if not ties.size:
        return
    landed = flat_bits[ties].view(np.float32).astype(np.float64)
    exact = flat_values[ties]
    moved = ties[landed != exact]
    if moved.size:
        away = np.abs(landed[landed != exact]) > np.abs(exact[landed != exact])  # rounded up in magnitude
        flat_bits[moved] = np.where(away, flat_bits[moved] - np.uint32(1), flat_bits[moved] + np.uint32(1))


def _e4m3_values() -> np.ndarray:
    """The value of each of the 256 e4m3 (OCP float8_e4m3fn) codes: sign, 4 exponent bits (bias 7), 3 mantissa
    bits, subnormals at exponent 0, no infinities, NaN at S.1111.111."""
    codes = np.arange(256)
    exponent, mantissa = (codes >> 3) & 0xF, (codes & 7).astype(np.float64)
    magnitude = np.where(exponent == 0, mantissa / 8 * 2.0**-6, (1 + mantissa / 8) * 2.0 ** (exponent - 7))
    values = np.where(codes & 0x80, -magnitude, magnitude)
    values[(codes & 0x7F) == 0x7F] = np.nan
    return values


class E4M3Type(DType):
    """fp8 e4m3 (torch.float8_e4m3fn), held as its raw 8-bit codes: what the Hopper GEMM's fp8 operands are. Not
    among DTYPES: no norm takes it."""

    def widen(self, array: np.ndarray) -> np.ndarray:
        return _E4M3_VALUES[np.asarray(array, dtype=np.uint8)].astype(np.float32)

    def round(self, values: np.ndarray) -> np.ndarray:
        """To the nearest e4m3 code, ties to the even code, as torch's .to(torch.float8_e4m3fn) rounds: a magnitude
        past the largest finite value (448, infinities too) saturates to it; NaN stays NaN. float32 values are
        rounded from their own bits, anything else from float64's: one rounding either way."""
        values = np.asarray(values)
        if values.dtype != np.float32:
            values = values.astype(np.float64)
        unsigned, width, mantissa, bias = ((np.uint32, 32, 23, 127) if values.dtype == np.float32
                                           else (np.uint64, 64, 52, 1023))
        magnitude_bits = values.view(unsigned) & unsigned((1 << (width - 1)) - 1)
        shift = unsigned(mantissa - 3)
        # to nearest even at the three mantissa bits kept: a carry moves into the exponent, as it should
        odd = (magnitude_bits >> shift) & unsigned(1)
        kept = (magnitude_bits + unsigned((1 << (mantissa - 4)) - 1) + odd) >> shift
        code = kept.astype(np.int32) - np.int32((bias - 7) << 3)  # the exponent's bias from the source's to e4m3's 7
        magnitude = np.abs(values)
        # below e4m3's least normal (2⁻⁶) its codes are multiples of 2⁻⁹; rint rounds halves to even
        code = np.where(magnitude < 2.0**-6, np.rint(magnitude * 512), code)
        code = np.where(np.isnan(values), 0x7F, np.minimum(code, 0x7E)).astype(np.uint8)
        return np.where(np.signbit(values), code | np.uint8(0x80), code)


_E4M3_VALUES = _e4m3_values()
FLOAT32 = DType("float32", "fp32", "f32", "float", 4, np.float32, 2.0**-24, 0x7FC00000)
BFLOAT16 = DType("bfloat16", "bf16", "bf16", "unsigned short", 2, np.uint16, 2.0**-8, 0x7FC07FC0)
FLOAT16 = DType("float16", "fp16", "f16", "unsigned short", 2, np.float16, 2.0**-11, 0x7E007E00)
DTYPES = (FLOAT32, BFLOAT16, FLOAT16)
E4M3 = E4M3Type("float8_e4m3fn", "e4m3", "e4m3", "unsigned char", 1, np.uint8, 2.0**-4, 0x7F7F7F7F)
_ALIASES = {"float": FLOAT32, "f32": FLOAT32, "bf16": BFLOAT16, "f16": FLOAT16, "half": FLOAT16}


def dtype(name: str) -> DType:
    """A DType by any of its names (fp32, float32, bf16, bfloat16, fp16, float16, half)."""
    for d in DTYPES:
        if name in (d.name, d.short):
            return d
    if name in _ALIASES:
        return _ALIASES[name]
    raise ConfigError(f"dtype: unknown dtype {name!r}; use one of {', '.join(d.short for d in DTYPES)}")


def element(name: str) -> DType:
    """Any element type a kernel's tensors may hold by name: those of dtype(), and e4m3 (the GEMM's fp8)."""
    return E4M3 if name in (E4M3.name, E4M3.short) else dtype(name)


def of_storage(storage: np.dtype | type) -> DType:
    """The DType whose numpy storage this is (a uint16 array holds bf16)."""
    kind = np.dtype(storage)
    for d in DTYPES:
        if np.dtype(d.storage) == kind:
            return d
    raise ValueError(f"no element type is held as numpy {kind}")
