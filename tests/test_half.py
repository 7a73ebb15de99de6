"""bf16 and f16 through the PTX vocabulary (templates/half.j2): packed 32-bit loads and stores, unpacking to f32 and rounding
back, compiled by NVRTC and run by the CPU interpreter, bit for bit against torch's conversions (round to
nearest even), and counted by the census."""

import numpy as np
import pytest

from mage_gen import interp
from mage_gen.census import take_census
from mage_gen.compile import compile_source
from mage_gen.render import Source, environment

torch = pytest.importorskip("torch")

# Each thread unpacks four packed words (eight halves) into floats, and packs four floats into two words.
KERNEL = """{% import "ptx.j2" as ptx %}{% import "half.j2" as half %}
extern "C" __global__ void halves(float* __restrict__ wide, unsigned* __restrict__ narrow,
    const unsigned* __restrict__ packed, const float* __restrict__ values, int n)
{
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    unsigned p[4]; float lo[4], hi[4];
    {{ half.ld_global_b32(regs('p', 4), 'packed + 4 * i', 'nc', 'packed') }}
{% for k in range(4) %}
    {{ half.unpack_half2('lo[' ~ k ~ ']', 'hi[' ~ k ~ ']', 'p[' ~ k ~ ']', DTYPE) }}
{% endfor %}
    float o[2];
{% for k in range(4) %}
    o[0] = lo[{{ k }}]; o[1] = hi[{{ k }}];
    {{ ptx.st_global('wide + 8 * i + ' ~ (2 * k), regs('o', 2), '', 'wide') }}
{% endfor %}
    float v[4]; unsigned q[2];
    {{ ptx.ld_global(regs('v', 4), 'values + 4 * i', 'nc', 'values') }}
    {{ half.pack_half2('q[0]', 'v[0]', 'v[1]', DTYPE) }}
    {{ half.pack_half2('q[1]', 'v[2]', 'v[3]', DTYPE) }}
    {{ half.st_global_b32('narrow + 2 * i', regs('q', 2), '', 'narrow') }}
}
"""
TORCH = {"bf16": torch.bfloat16, "f16": torch.float16}


def compiled(dtype: str):
    text = environment().from_string(KERNEL).render(DTYPE=dtype)
    return compile_source(Source(text=text, kernel_name="halves", template="test", template_hash="-", params=None))


def run(dtype: str, bits: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(every 16-bit pattern in bits widened to f32, values rounded to 16 bits), as the kernel computes them."""
    n = len(bits) // 8
    assert len(bits) == 8 * n and len(values) == 4 * n
    wide = np.full(8 * n, np.nan, np.float32)
    narrow = np.zeros(2 * n, np.uint32)
    interp.run(compiled(dtype).ptx, "halves", (-(-n // 256),), (256,), 0,
               [wide, narrow, bits.astype(np.uint16).view(np.uint32).copy(), values.astype(np.float32), n])
    return wide, narrow.view(np.uint16)


def torch_widen(bits: np.ndarray, dtype: str) -> np.ndarray:
    return torch.from_numpy(bits.astype(np.uint16).view(np.int16)).view(TORCH[dtype]).float().numpy()


def torch_narrow(values: np.ndarray, dtype: str) -> np.ndarray:
    return torch.from_numpy(values).to(TORCH[dtype]).view(torch.int16).numpy().view(np.uint16)


def hard_values(dtype: str) -> np.ndarray:
    """Float32s that test a rounding to 16 bits: exact ties both ways, one ulp either side of a tie, the
    largest finite and what overflows, subnormals of both formats, signed zeros, infinities and NaN."""
    rng = np.random.default_rng(7)
    cut = 16 if dtype == "bf16" else 13  # f32 mantissa bits a conversion drops (f16 normals)
    upper = rng.integers(0, 1 << 16, 2048, dtype=np.uint64)
    halfway = np.uint64(1 << (cut - 1))
    ties = (upper << np.uint64(16)) & np.uint64(0xFFFF0000) if dtype == "bf16" else \
        rng.integers(0x38800000, 0x47000000, 2048, dtype=np.uint64) & ~np.uint64((1 << cut) - 1)
    near = np.concatenate([ties | halfway, (ties | halfway) - np.uint64(1), (ties | halfway) + np.uint64(1)])
    specials = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 3.3895314e38, 3.4028235e38, 65504.0, 65520.0,
                         65519.996, 1e-40, -1e-40, 5.9604645e-08, 2.9802322e-08, 2.9802326e-08, 1e-45],
                        dtype=np.float32)
    values = np.concatenate([near.astype(np.uint32).view(np.float32), specials,
                             rng.standard_normal(2048).astype(np.float32) * np.float32(1e3)])
    return np.resize(values, -(-len(values) // 1024) * 1024)  # whole threads of four


@pytest.mark.parametrize("dtype", ["bf16", "f16"])
def test_every_16_bit_pattern_widens_to_the_float_torch_gives(dtype):
    bits = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    wide, _ = run(dtype, bits, np.zeros(len(bits) // 2, np.float32))
    expected = torch_widen(bits, dtype)
    nan = np.isnan(expected)
    assert np.array_equal(np.isnan(wide), nan)
    assert np.array_equal(wide[~nan].view(np.uint32), expected[~nan].view(np.uint32))  # -0.0 and subnormals too


def test_a_bf16_pair_is_widened_by_placing_its_bits_and_an_f16_pair_by_conversion():
    # a bf16 is the upper half of its f32: a shift and a mask, one instruction each, where mov {lo, hi} and
    # cvt.f32.bf16 cost ptxas a PRMT and a shift for the upper half
    bf16, f16 = compiled("bf16").ptx, compiled("f16").ptx
    assert "cvt.f32.bf16" not in bf16 and bf16.count("bf16x2 widened") == 4
    assert bf16.count("shl.b32") >= 4 and bf16.count("and.b32") >= 4
    assert f16.count("cvt.f32.f16") == 8 and "bf16x2 widened" not in f16


@pytest.mark.parametrize("dtype", ["bf16", "f16"])
def test_rounding_to_16_bits_is_to_nearest_even_bit_for_bit(dtype):
    values = hard_values(dtype)
    _, narrow = run(dtype, np.zeros(2 * len(values), np.uint16), values)
    expected = torch_narrow(values, dtype)
    nan = np.isnan(values)
    assert nan.any() and np.array_equal(narrow[~nan], expected[~nan])
    assert (narrow[nan] == 0x7FFF).all()  # the canonical NaN (a NaN's payload is not modelled)


def test_the_lower_half_of_a_packed_word_is_the_element_at_the_lower_address():
    # 1.0 and 2.0 as bf16 (0x3F80, 0x4000) in memory order: a little-endian word 0x40003F80
    wide, narrow = run("bf16", np.array([0x3F80, 0x4000, 0, 0, 0, 0, 0, 0] * 256, np.uint16),
                       np.tile(np.array([1.0, 2.0, -1.0, 0.5], np.float32), 256))
    assert wide[:2].tolist() == [1.0, 2.0]
    assert narrow[:4].tolist() == [0x3F80, 0x4000, 0xBF80, 0x3F00]


@pytest.mark.parametrize("dtype", ["bf16", "f16"])
def test_the_census_counts_packed_moves_and_conversions(dtype):
    census = take_census(compiled(dtype))
    assert census.global_loads["packed"] == {"v4": 1} and census.global_stores["narrow"] == {"v2": 1}
    assert (census.half_widen, census.half_narrow) == (8, 2)


def test_e4m3_codes_widen_to_their_values_and_round_to_nearest_even_saturating():
    from mage_gen.dtypes import E4M3

    codes = np.array([0x00, 0x01, 0x08, 0x38, 0x39, 0x7E, 0xFE, 0x80], dtype=np.uint8)
    assert E4M3.widen(codes).tolist() == [0.0, 2.0**-9, 2.0**-6, 1.0, 1.125, 448.0, -448.0, -0.0]
    assert np.isnan(E4M3.widen(np.array([0x7F, 0xFF], dtype=np.uint8))).all()
    # 1.0625 lies halfway between 1.0 (0x38, even) and 1.125 (0x39): the even code; 1.1875, between 0x39 and 0x3A
    assert E4M3.round(np.array([1.0625, 1.1875, 1.07, 500.0, np.inf, -1e9, np.nan])).tolist() == [
        0x38, 0x3A, 0x39, 0x7E, 0x7E, 0xFE, 0x7F]


@pytest.mark.parametrize("width", [np.float32, np.float64])
def test_e4m3_rounds_every_code_its_midpoints_and_their_neighbours_to_the_nearest_even_code(width):
    from mage_gen.dtypes import E4M3

    finite = E4M3.widen(np.arange(0x7F, dtype=np.uint8)).astype(np.float64)  # codes 0..0x7E, ascending
    midpoints = (finite[:-1] + finite[1:]) / 2
    nudged = np.concatenate([midpoints * (1 - 2.0**-20), midpoints * (1 + 2.0**-20), [2.0**-10, 2.0**-10 * 3]])
    values = np.concatenate([finite, midpoints, nudged, [449.0, 480.0, 1e30, 2.0**-30, 0.0]])
    values = np.concatenate([values, -values]).astype(width)
    # the oracle: the nearest finite code by value, the even one of two equally near; past 448, 448
    magnitude = np.abs(values.astype(np.float64))
    distance = np.abs(magnitude[:, None] - finite[None, :])
    nearest = distance.min(axis=1, keepdims=True)
    candidates = np.where(distance == nearest, np.arange(0x7F)[None, :], 1 << 10)
    even = np.where(candidates % 2 == 0, candidates, 1 << 10).min(axis=1)
    code = np.where(even < 1 << 10, even, candidates.min(axis=1))
    code = np.where(magnitude > 448, 0x7E, code) | np.where(np.signbit(values), 0x80, 0)
    assert E4M3.round(values).tolist() == code.tolist()


def test_e4m3_rounds_as_torch_casts():
    torch = pytest.importorskip("torch")
    from mage_gen.dtypes import E4M3

    values = np.concatenate([np.random.default_rng(0).standard_normal(20000) * 40, np.linspace(-500, 500, 4001)])
    assert np.array_equal(E4M3.round(values),
                          torch.tensor(values).to(torch.float8_e4m3fn).view(torch.uint8).numpy())
