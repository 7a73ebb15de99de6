"""bf16, fp16 and the fused residual add for both norms: rounding on the host, the shape's key and rules, the
gate's tolerance, and drawn variants compiled and run by the CPU interpreter against the rounded float64
reference."""

import json
import random
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from mage_gen import interp
from mage_gen.dtypes import BFLOAT16, FLOAT16, FLOAT32, dtype
from mage_gen.errors import ConfigError
from mage_gen.verdict import compare_outputs
from mage_gen.ops import get_op
from mage_gen.ops.base import shape_dict
from mage_gen.space import draw, expand, load_space
from mage_gen.variants import build

LN, RMS = get_op("layernorm"), get_op("rmsnorm")


def test_bf16_rounds_float64_once_to_nearest_even():
    # 1 + 2⁻⁸ is halfway between the bf16 neighbours 1 and 1 + 2⁻⁷: ties go to the even one, anything above
    # it goes up, though rounding to float32 first would land on the tie and go down
    values = np.array([1 + 2**-8, 1 + 2**-8 + 2**-30, 1 + 3 * 2**-8, -(1 + 2**-8 + 2**-30), np.nan])
    assert [hex(b) for b in BFLOAT16.round(values)] == ["0x3f80", "0x3f81", "0x3f82", "0xbf81", "0x7fc0"]
    assert BFLOAT16.widen(BFLOAT16.round(values))[:4].tolist() == [1.0, 1 + 2**-7, 1 + 2**-6, -(1 + 2**-7)]


def test_bf16_from_float32_matches_torch_bit_for_bit():
    torch = pytest.importorskip("torch")
    values = np.random.default_rng(0).standard_normal(100_000).astype(np.float32) * np.float32(1e3)
    ours = BFLOAT16.round(values)
    theirs = torch.from_numpy(values).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    assert np.array_equal(ours, theirs)
    assert FLOAT16.round(values.astype(np.float64)).dtype == np.float16


def test_dtype_names_and_a_bad_one():
    assert dtype("bf16") is dtype("bfloat16") is BFLOAT16 and dtype("fp32") is FLOAT32 and dtype("half") is FLOAT16
    with pytest.raises(ConfigError, match="^dtype: unknown dtype 'bf8'; use one of fp32, bf16, fp16$"):
        dtype("bf8")


def test_an_fp32_shape_keeps_the_key_slug_and_kernel_names_it_had_before_dtypes():
    shape, params = LN.shape(d=768), LN.params_from_dict({})
    assert shape_dict(shape) == {"d": 768} and LN.shape_key(shape) == "d=768/float32" and LN.slug(shape) == "d768"
    assert LN.kernel_name(shape, params) == "layernorm_row_d768_t128_v4_r1_approx_nc"


def test_dtypes_and_the_residual_form_are_part_of_the_shape():
    shape = RMS.shape(d=4096, dtype="bf16", weight_dtype="fp32", residual=True)
    assert shape_dict(shape) == {"d": 4096, "dtype": "bfloat16", "residual": True}
    assert RMS.shape_key(shape) == "d=4096/bfloat16,w=float32,residual" and RMS.slug(shape) == "d4096_bf16_wfp32_res"
    assert RMS.shape(d=4096, dtype="bf16").weight_dtype == "bfloat16"  # weights default to the activations' type
    assert [(a.name, a.dtype) for a in RMS.args(shape) if a.kind in ("in", "out")] == [
        ("y", "bfloat16"), ("residual_out", "bfloat16"), ("x", "bfloat16"), ("residual", "bfloat16"), ("w", "float32")]
    # 4 bf16 rows of bytes per element (x, residual, y, residual_out) and the fp32 weight
    assert RMS.bytes_moved(shape, {"m": 10}) == 4 * 10 * 4096 * 2 + 4096 * 4


@pytest.mark.parametrize("dims, message", [
    ({"d": 767, "dtype": "bf16"}, "^dtype: a bf16 row is moved at least 4 bytes"),
    ({"d": 768, "dtype": "bf16", "weight_dtype": "fp16"}, "^weight-dtype: weights are bf16"),
    ({"d": 768, "residual": "yes"}, "^residual: residual is true or false"),
])
def test_a_shape_that_cannot_be_generated_is_refused(dims, message):
    with pytest.raises(ConfigError, match=message):
        LN.shape(**dims)


@pytest.mark.parametrize("dims, values, rule", [
    ({"dtype": "bf16"}, {"vector": 2}, "vector-width"),  # bytes: one bf16 is never moved alone
    ({"dtype": "bf16", "residual": True}, {"threads": 32, "vector": 16}, "registers"),  # x and residual held
])
def test_rules_for_16_bit_rows_and_the_residual(dims, values, rule):
    with pytest.raises(ConfigError, match=f"^{rule}:"):
        LN.validate(LN.shape(d=4096, **dims), LN.params_from_dict(values))


@pytest.mark.parametrize("op", [LN, RMS], ids=["layernorm", "rmsnorm"])
def test_a_wide_bf16_residual_row_is_read_once_and_read_back_from_residual_out(op):
    # d = 1026: the 8-element body leaves a head and tail of 16-bit pairs on alternate rows
    shape = op.shape(d=1026, dtype="bf16", residual=True)
    v = build(op, shape, op.params_from_dict({"template": "wide", "threads": 96, "vector": 16}), "sm_90")
    c = v.census
    assert c.passes_over("x") == c.passes_over("residual") == c.passes_over("residual_out") == 1
    assert c.loads_of("residual_out") > 0 and "ld.global.nc" not in "".join(
        line for line in v.compiled.ptx.splitlines() if "tensor=residual_out" in line)
    result = interp.gate(op, shape, v, {"m": 3}, np.random.default_rng(2))
    assert result.passed, result.reason


def test_a_preset_gives_16_bit_rows_the_same_bytes_per_access():
    shape = LN.shape(d=4096, dtype="bf16")
    valid, _ = expand(LN, shape, load_space(LN, "quick", shape))
    assert {p.vector for p in valid} == {8, 16}  # bytes: 4 and 8 bf16


def test_the_gate_allows_one_ulp_of_bf16_and_not_two():
    bits = BFLOAT16.round(np.array([1.5, -2.25, 3.0], np.float32))
    ref = BFLOAT16.widen(bits).astype(np.float64)
    one_ulp, two_ulp = bits + np.uint16(1), bits + np.uint16(2)  # every element one (two) steps further from 0
    assert compare_outputs(LN, LN.shape(d=4, dtype="bf16"), {"y": one_ulp}, {"y": ref})[1] == ""
    assert "relative error" in compare_outputs(LN, LN.shape(d=4, dtype="bf16"), {"y": two_ulp}, {"y": ref})[1]
    nan = np.array([0x7FC0, 0x3FC0], np.uint16)  # bf16 NaN, 1.5
    assert "NaN" in compare_outputs(LN, LN.shape(d=4, dtype="bf16"), {"y": nan}, {"y": ref})[1]
    assert LN.tolerance_of(LN.shape(d=8, dtype="bf16", residual=True), "residual_out", BFLOAT16) == 0.0  # x + residual is bit for bit torch's


def test_the_residual_reference_rounds_the_sum_before_normalizing():
    shape = LN.shape(d=8, dtype="bf16", residual=True)
    inputs = LN.make_inputs(shape, {"m": 3}, np.random.default_rng(1))
    ref = LN.reference(shape, inputs, {"eps": 1e-5})
    h = BFLOAT16.widen(BFLOAT16.round(BFLOAT16.widen(inputs["x"]) + BFLOAT16.widen(inputs["residual"])))
    assert np.array_equal(ref["residual_out"], h.astype(np.float64))
    plain = LN.reference(LN.shape(d=8), {"x": h, "w": BFLOAT16.widen(inputs["w"]), "b": BFLOAT16.widen(inputs["b"])},
                         {"eps": 1e-5})["y"]
    assert np.array_equal(ref["y"], BFLOAT16.widen(BFLOAT16.round(plain)).astype(np.float64))


def test_a_bf16_residual_kernel_moves_what_it_should():
    shape = RMS.shape(d=512, dtype="bf16", residual=True)
    v = build(RMS, shape, RMS.params_from_dict({"threads": 64, "vector": 16}), "sm_90")
    c = v.census
    for tensor in ("x", "residual", "w"):
        assert c.loads_of(tensor, "v4") == 1 and c.loads_of(tensor) == 1, c.global_loads
    assert c.stores_of("y", "v4") == c.stores_of("residual_out", "v4") == 1, c.global_stores
    # 8 elements of x, residual and w widened, and the rounded sum widened back; the sum and y narrowed in pairs
    assert (c.half_widen, c.half_narrow) == (32, 8)
    assert "unsigned short* __restrict__ residual_out" in v.source.text


# a grid given per SM in the space (grid_cap "4/SM") sized as on an H200, the GPU of tuned/: any count would do
SMS = 132
DRAWN_TYPES = st.sampled_from([("bf16", None), ("fp16", None), ("bf16", "fp32"), ("fp16", "fp32"), ("fp32", None)])


@settings(max_examples=16, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_drawn_16_bit_and_residual_variants_pass_the_gate_on_the_cpu(data):
    op = data.draw(st.sampled_from([LN, RMS]), label="op")
    act, weight = data.draw(DRAWN_TYPES, label="dtypes")
    residual = data.draw(st.booleans(), label="residual")
    d = 2 * data.draw(st.one_of(st.integers(1, 300), st.sampled_from([384, 500])), label="d/2")
    shape = op.shape(d=d, dtype=act, weight_dtype=weight, residual=residual)
    small = load_space(op, "full", shape, sms=SMS).narrowed(threads=(32, 64, 96, 128), rows_per_block=(1, 2))
    params = draw(op, shape, small, random.Random(data.draw(st.integers(0, 2**32 - 1), label="params seed")))
    assume(params is not None)
    m = data.draw(st.integers(1, 3), label="M")
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1), label="seed"))
    result = interp.gate(op, shape, build(op, shape, params, "sm_90"), {"m": m}, rng)
    assert result.passed, f"{op.name} {shape_dict(shape)} {params.label()} M={m}: {result.reason}"


def test_the_cli_takes_dtypes_and_the_residual_form():
    def mage_gen(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "mage_gen", *args], capture_output=True, text=True, timeout=300)

    shown = mage_gen("inspect", "rmsnorm", "--d", "1024", "--dtype", "bf16", "--json",
                     "--config", "residual=true,threads=128,vector=16")
    assert shown.returncode == 0, shown.stderr
    doc = json.loads(shown.stdout)
    assert doc["shape"] == {"d": 1024, "dtype": "bfloat16", "weight_dtype": "bfloat16", "residual": True}
    assert doc["kernel"] == "rmsnorm_row_d1024_bf16_res_t128_v8_r1_approx_nc"
    refused = mage_gen("variants", "layernorm", "--d", "768", "--config", "threads=64")
    assert refused.returncode == 2 and "here --config sets only dtype, weight_dtype, residual" in refused.stderr
    assert "Traceback" not in refused.stderr and len(refused.stderr.strip().splitlines()) == 1
    clash = mage_gen("inspect", "layernorm", "--d", "768", "--dtype", "bf16", "--config", "dtype=fp16")
    assert clash.returncode == 2 and "disagree" in clash.stderr


@pytest.mark.parametrize("op", [LN, RMS], ids=["layernorm", "rmsnorm"])
@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
def test_a_row_held_packed_is_widened_in_each_pass_and_still_exact(op, residual):
    shape = op.shape(d=512, dtype="bf16", residual=residual)
    packed = build(op, shape, op.params_from_dict({"threads": 64, "vector": 16, "hold": "packed"}), "sm_90")
    floats = build(op, shape, op.params_from_dict({"threads": 64, "vector": 16}), "sm_90")
    assert packed.source.kernel_name == floats.source.kernel_name + "_hpack"
    assert "unsigned cur[1][4];" in packed.source.text and "float cur[1][8];" in floats.source.text
    # 8 elements of the row per thread: each pass over the held row widens them again (layer norm: mean,
    # squares, output; RMSNorm: squares, output), where a float row is widened once (the residual form's
    # rounded sum too: as it is stored, where packed)
    passes = 3 if op is LN else 2
    extra = packed.census.half_widen - floats.census.half_widen
    assert extra == 8 * (passes - 1), (packed.census.half_widen, floats.census.half_widen)
    assert packed.census.half_narrow == floats.census.half_narrow
    for m in (1, 3):
        result = interp.gate(op, shape, packed, {"m": m}, np.random.default_rng(m))
        assert result.passed, result.reason  # residual_out bit for bit: the held row is the sum it stored


def test_holding_a_row_packed_frees_the_registers_of_more_rows_per_sm():
    # six 128-thread blocks of d = 8192 per SM leave 80 registers a thread: a row of 64 floats spills there,
    # the same row held as 32 packed words does not
    shape = RMS.shape(d=8192, dtype="bf16")
    built = {hold: build(RMS, shape, RMS.params_from_dict({"threads": 128, "vector": 16, "min_blocks": 6,
                                                           "hold": hold}), "sm_90") for hold in ("float", "packed")}
    assert built["float"].census.spill_bytes > 0 and built["packed"].census.spill_bytes == 0
    assert built["packed"].census.registers <= 80


@pytest.mark.parametrize("dims, values, rule", [
    ({"d": 4096}, {"hold": "packed"}, "^hold: only a 16-bit row"),
    ({"d": 1026, "dtype": "bf16"}, {"hold": "packed", "vector": 16}, "^hold: a packed row is held in whole vectors"),
    ({"d": 4096, "dtype": "bf16"}, {"hold": "packed", "template": "wide"}, "^wide-options:"),
])
def test_a_row_that_cannot_be_held_packed_is_refused(dims, values, rule):
    with pytest.raises(ConfigError, match=rule):
        LN.validate(LN.shape(**dims), LN.params_from_dict(values))



def _stats_refusal(shape, params) -> str:
    try:
        LN.validate(shape, params)
    except ConfigError as exc:
        return str(exc) if str(exc).startswith("stats:") else ""
    return ""


@pytest.mark.parametrize("dims, allowed", [
    ({"d": 8192, "dtype": "bf16"}, True), ({"d": 65536, "dtype": "bf16"}, True), ({"d": 65538, "dtype": "bf16"}, False),
    ({"d": 8192, "dtype": "fp16"}, True), ({"d": 8194, "dtype": "fp16"}, False), ({"d": 768}, False),
])
def test_shifted_statistics_are_held_to_rows_whose_output_absorbs_their_worst_cancellation(dims, allowed):
    params = LN.params_from_dict({"threads": 1024, "vector": 16, "stats": "shifted", "hold": "packed"})
    refusal = _stats_refusal(LN.shape(**dims), params)
    assert (refusal == "") == allowed, refusal
    if not allowed:
        assert refusal.startswith("stats: shifted statistics") and "use stats two_pass or one_pass" in refusal


def test_shifted_statistics_stay_within_the_tolerance_where_a_plain_sum_of_squares_cancels():
    # d = 8192 bf16 rows of 1024s (bf16's step there is 8): row 0 has two elements one step off, so a sum of
    # squares about 0 loses the variance (2⁻¹¹ of the mean square) to fp32 cancellation; row 1's first element,
    # the shift itself, is the one off: the worst row for the shifted sums, (k − mean)² ≈ d·var; row 2 is noise.
    d, base = 8192, 1024.0
    shape = LN.shape(d=d, dtype="bf16")
    rows = np.full((3, d), base, dtype=np.float32)
    rows[0, 1], rows[0, 2], rows[1, 0] = base + 8, base - 8, base + 8
    rows[2] = np.random.default_rng(5).standard_normal(d, dtype=np.float32)
    x = BFLOAT16.round(rows)
    exact = BFLOAT16.widen(x).astype(np.float64)
    assert np.array_equal(exact[:2], rows[:2].astype(np.float64))  # the constructed rows are exact in bf16
    plain = (np.square(rows[0]).sum(dtype=np.float32) / d - (rows[0].sum(dtype=np.float32) / d) ** 2)
    assert abs(plain - exact[0].var()) > 0.1 * exact[0].var()  # the row defeats a plain sum of squares in fp32
    rng = np.random.default_rng(6)
    inputs = {"x": x, "w": BFLOAT16.round(rng.standard_normal(d, dtype=np.float32)),
              "b": BFLOAT16.round(rng.standard_normal(d, dtype=np.float32))}
    v = build(LN, shape, LN.params_from_dict({"threads": 256, "vector": 16, "stats": "shifted", "min_blocks": 4}),
              "sm_90")
    assert v.census.bar_sync == 1 and v.census.loads_of("x_first") == 1  # one reduction; the shift read beside x
    outputs = interp.launch_with(LN, shape, v, {"m": 3}, inputs)
    reference = LN.reference(shape, inputs, LN.scalars(shape, {"m": 3}))
    for row in range(3):
        err, reason = compare_outputs(LN, shape, {"y": outputs["y"][row:row + 1]}, {"y": reference["y"][row:row + 1]})
        assert not reason, (row, err, reason)


def _fp32_layer_norm(row: np.ndarray, w: np.ndarray, b: np.ndarray, eps: float) -> np.ndarray:
    """A layer norm as any fp32 kernel computes it: the mean, then the centred sum of squares, summed in fp32."""
    d = np.float32(row.shape[1])
    centred = row - row.sum(axis=1, dtype=np.float32, keepdims=True) / d
    var = (centred * centred).sum(axis=1, dtype=np.float32, keepdims=True) / d
    return centred / np.sqrt(var + np.float32(eps)) * w + b


@pytest.mark.parametrize("residual", [False, True])
def test_every_row_drawn_at_the_smallest_d_is_within_an_fp32_norms_reach(residual):
    # Two values drawn close together would leave x − mean a few ulps of the row's offset mean: any fp32 layer
    # norm would then miss the 1e-5 tolerance, and the gate would fail a correct kernel.
    from mage_gen.verdict import relative_error

    shape = LN.shape(d=2, residual=residual)
    worst = 0.0
    for seed in range(2000):
        inputs = LN.make_inputs(shape, {"m": 1}, np.random.default_rng(seed))
        row = inputs["x"] + inputs["residual"] if residual else inputs["x"]
        y = _fp32_layer_norm(row, inputs["w"], inputs["b"], LN.eps)
        reference = LN.reference(shape, inputs, LN.scalars(shape, {"m": 1}))["y"]
        worst = max(worst, relative_error(y, reference))
    assert worst <= LN.tolerance_of(shape, "y", FLOAT32)
