"""RMSNorm: the layer norm's templates with NORM 'rms' compile to one row-wide sum and no bias, compute the
float64 reference in the CPU interpreter, and leave every layer-norm kernel as it was."""

import random

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mage_gen import interp
from mage_gen.errors import ConfigError
from mage_gen.ops import get_op
from mage_gen.space import draw, expand, load_space
from mage_gen.variants import build, build_all

RMS = get_op("rmsnorm")
LN = get_op("layernorm")
# a grid given per SM in the space (grid_cap "4/SM") sized as on an H200, the GPU of tuned/: any count would do
SMS = 132


@pytest.mark.parametrize("d", [768, 1000, 65536])
def test_every_third_quick_preset_variant_compiles_to_one_sum_and_no_bias(d):
    # a third: every structure is the layer norm's, whose every quick variant test_layernorm_variants compiles
    shape = RMS.shape(d=d)
    valid, _ = expand(RMS, shape, load_space(RMS, "quick"))
    assert valid
    for v in build_all(RMS, shape, valid[::3], "sm_90"):
        c, launch = v.census, RMS.geometry(shape, v.params, {"m": 37})
        assert c.spill_bytes == 0 and c.stack_bytes == 0, v.source.kernel_name
        assert c.shared_bytes == launch.static_shared_bytes, v.source.kernel_name
        assert set(c.global_loads) <= {"x", "x.tail", "x.pass1", "x.pass1.tail", "x.pass2", "x.pass2.tail", "w",
                                       "w.tail"}, c.global_loads
        # one row-wide sum: one barrier where a row spans several warps, none within one warp
        assert c.bar_sync == (1 if v.params.threads > 32 else 0), v.source.kernel_name
        assert v.source.kernel_name.startswith("rmsnorm_")


def test_rmsnorm_has_one_statistic():
    with pytest.raises(ConfigError, match="^stats: rmsnorm has one statistic"):
        RMS.validate(RMS.shape(d=768), RMS.params_from_dict({"stats": "one_pass"}))
    assert [a.name for a in RMS.args(RMS.shape(d=768))] == ["y", "x", "w", "M", "eps"]
    assert "b" not in RMS.contract(RMS.shape(d=768), RMS.params_from_dict({}))["tensors"]


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_rmsnorm_variants_match_the_reference_on_the_cpu(data):
    d = data.draw(st.one_of(st.integers(1, 1024), st.sampled_from([768, 1000, 1024])), label="d")
    params = draw(RMS, RMS.shape(d=d), load_space(RMS, "full", sms=SMS),
                  random.Random(data.draw(st.integers(0, 2**32 - 1), label="params seed")))
    if params is None:
        return
    m = data.draw(st.integers(1, 3), label="M")
    shape = RMS.shape(d=d)
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1), label="seed"))
    err = interp.worst_error(RMS, shape, build(RMS, shape, params, "sm_90"), {"m": m}, rng, runs=[{"m": m}])
    assert err <= RMS.tolerance, f"{params.label()} at d={d}, M={m}: relative error {err:.3g}"


def test_the_reference_is_rmsnorm():
    rng = np.random.default_rng(0)
    inputs = RMS.make_inputs(RMS.shape(d=5), {"m": 2}, rng)
    x, w = inputs["x"].astype(np.float64), inputs["w"].astype(np.float64)
    expected = x / np.sqrt((x * x).mean(axis=1, keepdims=True) + 1e-6) * w
    assert np.allclose(RMS.reference(RMS.shape(d=5), inputs, {"eps": 1e-6})["y"], expected, rtol=1e-15)
    assert set(inputs) == {"x", "w"}


def test_a_layer_norm_and_an_rmsnorm_of_one_config_differ_only_where_the_statistic_does():
    shape, params = LN.shape(d=768), LN.params_from_dict({"template": "row", "threads": 128, "vector": 16})
    ln, rms = LN.source(shape, params).text, RMS.source(shape, params).text
    assert "const float* __restrict__ b" in ln and "const float* __restrict__ b" not in rms
    assert "mul.rn.f32" in rms and "mul.rn.f32" not in ln


@pytest.mark.parametrize("values", [{"template": "row", "threads": 64}, {"template": "multirow", "threads": 64,
                                                                         "rows_per_block": 2}])
def test_a_persistent_block_of_several_warps_alternates_its_partial_sums_between_rows(values):
    # one barrier per row: with a single shared array a fast warp writes the next row's partial sum while a slow
    # one still reads this row's, a race the interpreter reports; three blocks walk 37 rows
    shape = RMS.shape(d=1024)
    v = build(RMS, shape, RMS.params_from_dict({"vector": 16, "grid_cap": 3, **values}), "sm_90")
    assert v.census.bar_sync == 1 and "partial[iter & 1]" in v.source.text
    result = interp.gate(RMS, shape, v, {"m": 37}, np.random.default_rng(4))
    assert result.passed, result.reason
