"""Tensor-core PTX (templates/ptx.j2: mma, ldmatrix, cvt_tf32) compiled by NVRTC and run by the CPU
interpreter against numpy: each fragment layout as the PTX ISA gives it, written here a second way (by
register word, as the ISA's tables read) so that a layout the interpreter got wrong fails; a kernel that
loads one register from the wrong place fails too; and the census counts the instructions."""

import numpy as np
import pytest

from mage_gen import interp
from mage_gen.census import take_census
from mage_gen.compile import compile_source
from mage_gen.dtypes import BFLOAT16
from mage_gen.interp import fp
from mage_gen.interp.errors import DivergenceError, InterpError
from mage_gen.render import Source, environment

# One warp: its registers loaded from per-lane words (FRAGMENTS) or, through shared memory, by ldmatrix
# (LDMATRIX); D stored per lane and register.
FRAGMENTS = """{% import "ptx.j2" as ptx %}
extern "C" __global__ void fragments(float* __restrict__ d, const unsigned* __restrict__ a_words,
    const unsigned* __restrict__ b_words, const float* __restrict__ c)
{
    const int lane = threadIdx.x;
    unsigned a[4], b[2];
    float acc[4];
{% for j in range(4) %}
    a[{{ j }}] = a_words[lane * 4 + {{ A_ORDER[j] }}];
    acc[{{ j }}] = c[lane * 4 + {{ j }}];
{% endfor %}
{% for j in range(2) %}
    b[{{ j }}] = b_words[lane * 2 + {{ j }}];
{% endfor %}
    {{ ptx.mma(regs('acc', 4), regs('a', 4), regs('b', 2), DTYPE) }}
{% for j in range(4) %}
    d[lane * 4 + {{ j }}] = acc[{{ j }}];
{% endfor %}
}
"""

# A (16×16) and B (16×8), bf16 row-major in global memory, through shared memory into registers with
# ldmatrix.x4 (A) and ldmatrix.x2.trans (B); D (16×8) written row-major from the accumulator layout.
LDMATRIX = """{% import "ptx.j2" as ptx %}
extern "C" __global__ void through_shared(float* __restrict__ d, const unsigned* __restrict__ a_rows,
    const unsigned* __restrict__ b_rows)
{
    // bf16 pairs, copied a 32-bit word at a time: a row of A is 8 words, a row of B 4
    __shared__ __align__(16) unsigned a_tile[16 * 8], b_tile[16 * 4];
    const int lane = threadIdx.x;
    for (int i = lane; i < 16 * 8; i += 32) a_tile[i] = a_rows[i];
    for (int i = lane; i < 16 * 4; i += 32) b_tile[i] = b_rows[i];
    __syncthreads();
    unsigned a[4], b[2];
    float acc[4] = {0.f, 0.f, 0.f, 0.f};
    // lane l gives row l % 16, columns 8 * (l / 16) of A: matrices (rows 0-7 | 8-15) × (cols 0-7 | 8-15)
    const unsigned a_at = (unsigned)__cvta_generic_to_shared(a_tile + (lane % 16) * 8 + (lane / 16) * 4);
    // lanes 0-15 give rows k = 0..15 of B (8 columns each): two matrices, read transposed
    const unsigned b_at = (unsigned)__cvta_generic_to_shared(b_tile + (lane % 16) * 4);
    {{ ptx.ldmatrix(regs('a', 4), 'a_at', False, 'a') }}
    {{ ptx.ldmatrix(regs('b', 2), 'b_at', True, 'b') }}
    {{ ptx.mma(regs('acc', 4), regs('a', 4), regs('b', 2), 'bf16') }}
{% for j in range(4) %}
    d[(lane / 4 + 8 * {{ j // 2 }}) * 8 + 2 * (lane % 4) + {{ j % 2 }}] = acc[{{ j }}];
{% endfor %}
}
"""

ROUND = """{% import "ptx.j2" as ptx %}
extern "C" __global__ void to_tf32(unsigned* __restrict__ out, const float* __restrict__ x, int n)
{
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) { unsigned r; float v = x[i]; {{ ptx.cvt_tf32('r', 'v', ROUNDING) }} out[i] = r; }
}
"""


def compiled(template: str, name: str, **context):
    text = environment().from_string(template).render(**context)
    return compile_source(Source(text=text, kernel_name=name, template="test", template_hash="-", params=None))


# ---- the ISA's fragment tables, written by register word (lane l, g = l // 4, t = l % 4) ----

def pack(lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    return (lo.astype(np.uint32) | (hi.astype(np.uint32) << np.uint32(16))).astype(np.uint32)


def a16_words(a_bits: np.ndarray) -> np.ndarray:
    """(32, 4): register r of lane l holds A[g + 8(r%2), 2(t + 4(r//2)) + {0, 1}]."""
    words = np.zeros((32, 4), np.uint32)
    for lane in range(32):
        g, t = divmod(lane, 4)
        for r in range(4):
            row, word = g + 8 * (r % 2), t + 4 * (r // 2)
            words[lane, r] = pack(a_bits[row, 2 * word], a_bits[row, 2 * word + 1])
    return words


def b16_words(b_bits: np.ndarray) -> np.ndarray:
    """(32, 2): register r of lane l holds B[2(t + 4r) + {0, 1}, g] (B is K×N)."""
    words = np.zeros((32, 2), np.uint32)
    for lane in range(32):
        g, t = divmod(lane, 4)
        for r in range(2):
            word = t + 4 * r
            words[lane, r] = pack(b_bits[2 * word, g], b_bits[2 * word + 1, g])
    return words


def tf32_a_words(a: np.ndarray) -> np.ndarray:
    """(32, 4): register r of lane l holds A[g + 8(r%2), t + 4(r//2)] (16×8)."""
    return np.array([[a[lane // 4 + 8 * (r % 2), lane % 4 + 4 * (r // 2)] for r in range(4)] for lane in range(32)],
                    np.float32).view(np.uint32)


def tf32_b_words(b: np.ndarray) -> np.ndarray:
    """(32, 2): register r of lane l holds B[t + 4r, g] (8×8)."""
    return np.array([[b[lane % 4 + 4 * r, lane // 4] for r in range(2)] for lane in range(32)],
                    np.float32).view(np.uint32)


def accumulator(d_words: np.ndarray) -> np.ndarray:
    """(16, 8) from (32, 4): register r of lane l is D[g + 8(r//2), 2t + r%2]."""
    d = np.full((16, 8), np.nan, np.float32)
    for lane in range(32):
        g, t = divmod(lane, 4)
        for r in range(4):
            d[g + 8 * (r // 2), 2 * t + r % 2] = d_words[lane, r]
    return d


def scatter_accumulator(c: np.ndarray) -> np.ndarray:
    return np.array([[c[lane // 4 + 8 * (r // 2), 2 * (lane % 4) + r % 2] for r in range(4)] for lane in range(32)],
                    np.float32)


def run_fragments(dtype: str, a_words: np.ndarray, b_words: np.ndarray, c: np.ndarray,
                  a_order=(0, 1, 2, 3)) -> np.ndarray:
    kernel = compiled(FRAGMENTS, "fragments", DTYPE=dtype, A_ORDER=a_order)
    d = np.full(32 * 4, np.nan, np.float32)
    interp.run(kernel.ptx, "fragments", (1,), (32,), 0,
               [d, a_words.ravel().copy(), b_words.ravel().copy(), scatter_accumulator(c).ravel().copy()])
    return accumulator(d.reshape(32, 4))


@pytest.mark.parametrize("dtype", ["bf16", "f16"])
def test_mma_m16n8k16_takes_the_isa_fragments(dtype):
    rng = np.random.default_rng(0)
    a, b, c = rng.standard_normal((16, 16)), rng.standard_normal((16, 8)), rng.standard_normal((16, 8))
    if dtype == "bf16":
        a_bits, b_bits = BFLOAT16.round(a), BFLOAT16.round(b)
        a_exact, b_exact = BFLOAT16.widen(a_bits), BFLOAT16.widen(b_bits)
    else:
        a_exact, b_exact = a.astype(np.float16), b.astype(np.float16)
        a_bits, b_bits = a_exact.view(np.uint16), b_exact.view(np.uint16)
    expected = a_exact.astype(np.float64) @ b_exact.astype(np.float64) + c.astype(np.float32)
    d = run_fragments(dtype, a16_words(a_bits), b16_words(b_bits), c)
    assert np.allclose(d, expected, rtol=1e-6, atol=1e-6)
    # the same kernel with registers a1 and a2 swapped: rows 8-15 and columns 8-15 trade places
    wrong = run_fragments(dtype, a16_words(a_bits), b16_words(b_bits), c, a_order=(0, 2, 1, 3))
    assert not np.allclose(wrong, expected, rtol=1e-3, atol=1e-3)


def test_mma_m16n8k8_tf32_takes_the_isa_fragments_and_ignores_the_low_13_bits():
    rng = np.random.default_rng(1)
    a, b, c = (rng.standard_normal(s).astype(np.float32) for s in ((16, 8), (8, 8), (16, 8)))
    tf32 = lambda x: (x.view(np.uint32) & np.uint32(0xFFFFE000)).view(np.float32)  # noqa: E731
    expected = tf32(a).astype(np.float64) @ tf32(b).astype(np.float64) + c
    d = run_fragments("tf32", tf32_a_words(a), tf32_b_words(b), c)
    assert np.allclose(d, expected, rtol=1e-6, atol=1e-6)
    # unrounded operands are truncated, not rounded: the product of the exact floats is further away
    assert not np.allclose(d, a.astype(np.float64) @ b + c, rtol=1e-6, atol=1e-6)
    wrong = run_fragments("tf32", tf32_a_words(a), tf32_b_words(b), c, a_order=(1, 0, 2, 3))
    assert not np.allclose(wrong, expected, rtol=1e-3, atol=1e-3)


def test_ldmatrix_then_mma_computes_the_product_of_row_major_tiles():
    rng = np.random.default_rng(2)
    a_bits, b_bits = BFLOAT16.round(rng.standard_normal((16, 16))), BFLOAT16.round(rng.standard_normal((16, 8)))
    kernel = compiled(LDMATRIX, "through_shared")
    d = np.full(16 * 8, np.nan, np.float32)
    interp.run(kernel.ptx, "through_shared", (1,), (32,), 0,
               [d, a_bits.ravel().view(np.uint32).copy(), b_bits.ravel().view(np.uint32).copy()])
    expected = BFLOAT16.widen(a_bits).astype(np.float64) @ BFLOAT16.widen(b_bits).astype(np.float64)
    assert np.allclose(d.reshape(16, 8), expected, rtol=1e-6, atol=1e-6)
    census = take_census(kernel)
    assert census.mma == {"m16n8k16.bf16": 1} and census.ldmatrix == {"x2.trans": 1, "x4": 1}


def test_mma_by_part_of_a_warp_is_refused():
    kernel = compiled(FRAGMENTS, "fragments", DTYPE="bf16", A_ORDER=(0, 1, 2, 3))
    with pytest.raises(DivergenceError, match="every lane of the warp must"):
        interp.run(kernel.ptx, "fragments", (1,), (16,), 0, [np.zeros(128, np.float32), np.zeros(128, np.uint32),
                                                             np.zeros(64, np.uint32), np.zeros(128, np.float32)])


def test_cvt_rna_tf32_rounds_to_nearest_ties_away_and_keeps_the_exponent_carry():
    one = 1.0
    ulp = 2.0**-10  # tf32 keeps 10 explicit mantissa bits
    values = np.array([one + ulp / 2, -(one + ulp / 2), one + ulp / 2 - 2**-23, one + 3 * ulp / 2,
                       2 - ulp / 2, 3.0e38, np.float32(np.inf), 0.0, -0.0], np.float32)
    kernel = compiled(ROUND, "to_tf32", ROUNDING="rna")
    out = np.zeros(len(values), np.uint32)
    interp.run(kernel.ptx, "to_tf32", (1,), (32,), 0, [out, values, len(values)])
    got = out.view(np.float32)
    assert got[:5].tolist() == [one + ulp, -(one + ulp), one, one + 2 * ulp, 2.0]  # ties away from zero
    assert np.isinf(got[5]) or got[5] >= 3.0e38 and (out[5] & 0x1FFF) == 0
    assert np.isinf(got[6]) and got[7] == 0 and np.signbit(got[8])
    assert np.array_equal(out, fp.f32_to_tf32_rna(values)) and take_census(kernel).tf32_round == 1


def test_cvt_rn_tf32_rounds_ties_to_even():
    one, ulp = 1.0, 2.0**-10
    values = np.array([one + ulp / 2, one + 3 * ulp / 2, -(one + 3 * ulp / 2), one + ulp / 2 + 2**-23,
                       2 - ulp / 2, 3.4028235e38, np.float32(np.inf), -0.0, np.float32(np.nan)], np.float32)
    kernel = compiled(ROUND, "to_tf32", ROUNDING="rn")
    out = np.zeros(len(values), np.uint32)
    interp.run(kernel.ptx, "to_tf32", (1,), (32,), 0, [out, values, len(values)])
    got = out.view(np.float32)
    # ties go to the even neighbour (1 + ulp/2 down, 1 + 3ulp/2 up); past a tie, up; a carry reaches the exponent
    assert got[:5].tolist() == [one, one + 2 * ulp, -(one + 2 * ulp), one + ulp, 2.0]
    assert np.isinf(got[5]) and np.isinf(got[6]) and np.signbit(got[7]) and np.isnan(got[8])
    assert (out & 0x1FFF).tolist() == [0] * len(values)
    assert not np.array_equal(out[:1], fp.f32_to_tf32_rna(values[:1]))  # where the two roundings part
    assert take_census(kernel).tf32_round == 1


def test_ldmatrix_needs_16_byte_aligned_rows():
    text = LDMATRIX.replace("a_tile + (lane % 16) * 8 + (lane / 16) * 4", "a_tile + (lane % 16) * 8 + 1")
    kernel = compile_source(Source(text=environment().from_string(text).render(), kernel_name="through_shared",
                                   template="test", template_hash="-", params=None))
    with pytest.raises(InterpError, match="not 16-byte aligned"):
        interp.run(kernel.ptx, "through_shared", (1,), (32,), 0,
                   [np.zeros(128, np.float32), np.zeros(128, np.uint32), np.zeros(64, np.uint32)])

