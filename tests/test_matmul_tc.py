"""The tensor-core matmul (mage_gen/ops/matmul_tc.py): every quick variant compiles to the mma and ldmatrix
counts its tiles imply, without spills; drawn small variants with tails pass the gate on the CPU
interpreter in bf16 and tf32; the planted pipeline bugs fail it; rules refuse what cannot be built."""

import dataclasses

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mage_gen import interp
from mage_gen.dtypes import BFLOAT16, FLOAT32
from mage_gen.errors import ConfigError
from mage_gen.ops import get_op
from mage_gen.space import expand, load_space
from mage_gen.variants import build, build_all

OP = get_op("matmul_tc")


@pytest.mark.parametrize("precision", ["bf16", "tf32", "fp32x3"])
def test_every_quick_variant_compiles_to_its_tiles_mma_count(precision):
    shape = OP.shape(m=1000, n=1000, k=1000, precision=precision)
    valid, _ = expand(OP, shape, load_space(OP, "quick", shape))
    sample = valid[::5]  # every fifth (odd, prime to the last axes' periods): every value of every axis kept
    for axis in ("bm", "bn", "bk", "warps_m", "warps_n", "stages", "b_loads", "prefetch"):
        assert {getattr(p, axis) for p in sample} == {getattr(p, axis) for p in valid}, axis
    step, kind = (16, "bf16") if precision == "bf16" else (8, "tf32")
    split = 2 if precision == "fp32x3" else 1  # a high and a low tf32 part of every element
    for v in build_all(OP, shape, sample, "sm_90"):
        p, c = v.params, v.census
        mt, nt = p.bm // p.warps_m // 16, p.bn // p.warps_n // 8
        assert c.spill_bytes == 0 and c.stack_bytes == 0, v.source.kernel_name
        # 3xTF32: small·big, big·small and big·big for every pair of tiles
        assert c.mma == {f"m16n8k{step}.{kind}": (2 * split - 1) * mt * nt * p.bk // step}, c.mma
        # fragments loaded ahead: the first K step's once more, before the loop
        steps = p.bk // step + (1 if p.prefetch == "next" else 0)
        if precision == "bf16":
            assert c.ldmatrix == {"x4": mt * steps, "x2.trans": nt * steps}, c.ldmatrix
        else:
            # A by ldmatrix (a 16-byte row holds 4 fp32), B by shared loads; every fragment element rounded
            assert c.ldmatrix == {"x4": mt * steps} and c.tf32_round == split * (4 * mt + 2 * nt) * steps
        if p.b_loads == "wide":  # a lane's columns of 2 or 4 n-tiles side by side; N = 1000 is a multiple of 4
            assert c.stores_of("C", "v4") == c.stores_of("C") == mt * nt
        else:
            assert c.stores_of("C", "v2") == c.stores_of("C") == 2 * mt * nt  # N = 1000 is even: column pairs
        # one barrier per tile waits for one group fewer in flight, and has no barrier after the multiply;
        # fragments loaded ahead wait for the first tile, with all stages in flight, before the loop
        if p.prefetch == "next":
            assert c.wait_groups == {p.stages - 1: 1, p.stages - 2: 1} and c.bar_sync == 2
        else:
            assert c.wait_groups == {p.stages - (2 if p.sync == "one" else 1): 1}
            assert c.bar_sync == (1 if p.sync == "one" else 2)


@pytest.mark.parametrize("precision", ["bf16", "tf32"])
def test_the_wide_preset_builds_8_warp_blocks_over_256_wide_tiles_without_spills(precision):
    shape = OP.shape(m=4096, n=4096, k=4096, precision=precision)
    valid, _ = expand(OP, shape, load_space(OP, "wide", shape))
    assert {(p.bm, p.bn) for p in valid} >= {(256, 128), (128, 256)}
    assert {p.warps_m * p.warps_n for p in valid} == {4, 8}
    sample = valid[::3]
    assert {(p.bm, p.bn, p.bk) for p in sample} == {(p.bm, p.bn, p.bk) for p in valid}
    for v in build_all(OP, shape, sample, "sm_90"):
        assert v.census.spill_bytes == 0 and v.census.stack_bytes == 0, v.source.kernel_name


def test_the_wide_preset_has_no_3xtf32_tile_the_register_rule_admits():
    shape = OP.shape(m=4096, n=4096, k=4096, precision="fp32x3")
    valid, rejected = expand(OP, shape, load_space(OP, "wide", shape))
    assert not valid and {reason.split(":")[0] for _, reason in rejected} == {"registers", "threads"}


SMALL = [p for p in expand(OP, OP.shape(m=64, n=64, k=64), load_space(OP, "full"))[0] if p.bm <= 64 and p.bn <= 64]


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_drawn_variants_with_tails_pass_the_gate_on_the_cpu(data):
    precision = data.draw(st.sampled_from(["bf16", "tf32", "fp32x3"]), label="precision")
    even = 2 if precision == "bf16" else 1
    m = data.draw(st.integers(1, 64), label="m")
    n, k = (even * data.draw(st.integers(1, 64 // even), label=name) for name in ("n", "k"))
    shape = OP.shape(m=m, n=n, k=k, precision=precision)
    usable = []
    for p in SMALL:
        try:
            OP.validate(shape, p)
        except ConfigError:
            continue
        usable.append(p)
    params = data.draw(st.sampled_from(usable), label="params")
    result = interp.gate(OP, shape, build(OP, shape, params, "sm_90"), {}, np.random.default_rng(0))
    assert result.passed, f"{precision} {m}x{n}x{k} {params.label()}: {result.reason}"


def test_3xtf32_is_near_fp32_where_tf32_is_not():
    errors = {}
    for precision in ("tf32", "fp32x3"):
        shape = OP.shape(m=48, n=40, k=200, precision=precision)
        params = OP.params_from_dict({"bm": 32, "bn": 32, "bk": 16, "warps_m": 2, "warps_n": 2})
        result = interp.gate(OP, shape, build(OP, shape, params, "sm_90"), {}, np.random.default_rng(7))
        assert result.passed, result.reason
        errors[precision] = result.worst_error
    # tf32 keeps 11 bits of each input (~3e-4 here); the split keeps ~22, and fp32 sums remain
    assert errors["tf32"] > 1e-4 and errors["fp32x3"] < 1e-6, errors


@pytest.mark.parametrize("plant", ["stage_off_by_one", "loose_wait"])
@pytest.mark.parametrize("precision", ["bf16", "tf32"])
@pytest.mark.parametrize("sync, prefetch", [("two", "none"), ("one", "none"), ("one", "next")])
def test_the_planted_pipeline_bugs_fail_the_gate(plant, precision, sync, prefetch):
    shape = OP.shape(m=64, n=64, k=96, precision=precision)
    params = OP.params_from_dict({"bm": 64, "bn": 64, "bk": 32 if prefetch == "next" else 16, "stages": 2,
                                  "sync": sync, "prefetch": prefetch, "plant": plant})
    assert interp.gate(OP, shape, build(OP, shape, dataclasses.replace(params, plant=""), "sm_90"), {},
                       np.random.default_rng(0)).passed  # the config itself is right
    result = interp.gate(OP, shape, build(OP, shape, params, "sm_90"), {}, np.random.default_rng(0))
    assert not result.passed and "cp.async" in result.reason


def c_of(shape, inputs: dict, values: dict) -> np.ndarray:
    """C of the variant with these params, on the interpreter."""
    return interp.launch_with(OP, shape, build(OP, shape, OP.params_from_dict(values), "sm_90"), {}, inputs)["C"]


@pytest.mark.parametrize("dims, values", [
    ((64, 64, 40), {"bm": 64, "bn": 64, "bk": 16, "pad_a": 4}),  # 4 n-tiles a warp: 16-byte loads, C by v4
    ((40, 36, 24), {"bm": 32, "bn": 32, "bk": 8, "pad_a": 4}),  # 2 n-tiles: 8-byte loads, tails
    ((50, 70, 40), {"bm": 16, "bn": 128, "bk": 8, "warps_m": 1, "stages": 3, "sync": "one", "pad_a": 4}),  # 8; N % 4
])
@pytest.mark.parametrize("precision", ["tf32", "fp32x3"])
def test_wide_b_loads_compute_what_word_loads_do_bit_for_bit(dims, values, precision):
    # the same products into the same accumulators, only the columns a lane owns moved: C must not change a bit
    m, n, k = dims
    shape = OP.shape(m=m, n=n, k=k, precision=precision)
    inputs = OP.make_inputs(shape, {}, np.random.default_rng(3))
    outputs = {b: c_of(shape, inputs, {**values, "b_loads": b}) for b in ("word", "wide")}
    assert np.isfinite(outputs["wide"]).all() and np.array_equal(outputs["word"], outputs["wide"])
    reference = OP.reference(shape, inputs, {})["C"]
    assert np.linalg.norm(outputs["wide"] - reference) <= OP.tolerance_of(shape, "C", FLOAT32) * np.linalg.norm(reference)


@pytest.mark.parametrize("precision, dims, values", [
    ("bf16", (50, 70, 100), {"bm": 32, "bn": 32, "bk": 32, "stages": 3}),  # tails; a last tile part K
    ("tf32", (40, 36, 40), {"bm": 32, "bn": 32, "bk": 16, "stages": 2, "pad_a": 4, "b_loads": "wide"}),
    ("fp32x3", (64, 64, 16), {"bm": 64, "bn": 64, "bk": 16, "stages": 4, "pad_a": 4}),  # one tile, four stages
])
def test_fragments_loaded_ahead_compute_what_step_loads_do_bit_for_bit(precision, dims, values):
    # the same mma in the same order into the same accumulators, only the loads moved: C must not change a bit
    shape = OP.shape(*dims, precision=precision)
    inputs = OP.make_inputs(shape, {}, np.random.default_rng(5))
    outputs = {f: c_of(shape, inputs, {**values, "sync": "one", "prefetch": f}) for f in ("none", "next")}
    assert np.isfinite(outputs["next"]).all() and np.array_equal(outputs["none"], outputs["next"])


def test_wide_b_loads_read_b_a_vector_at_a_time():
    shape = OP.shape(m=64, n=64, k=64, precision="tf32")
    word, wide = (build(OP, shape, OP.params_from_dict({"bk": 16, "pad_a": 4, "b_loads": b}), "sm_90").source.text
                  for b in ("word", "wide"))
    # 2 K steps × 2 rows × 1 group of 4 n-tiles: 4 vector loads where the word form has 2 × 2 × 4 scalar ones
    assert wide.count("ld.shared.v4.f32") == 4 and "ld.shared.v4.f32" not in word
    assert word.count("ld.shared.f32") == 16 and "ld.shared.f32" not in wide
    assert wide.count("st.global.v4.f32") == 2 * 2 * 2  # 2 m-tiles × 2 halves × 2 vectors of 4 columns


@pytest.mark.parametrize("dims, values, rule", [
    ({"m": 64, "n": 64, "k": 64, "precision": "bf16"}, {"bk": 8}, "k-step"),
    ({"m": 64, "n": 64, "k": 64}, {"bm": 64, "warps_m": 8}, "warp-tile"),
    ({"m": 64, "n": 64, "k": 64}, {"pad_a": 4}, "pad"),
    ({"m": 64, "n": 64, "k": 64}, {"stages": 5}, "stages"),
    ({"m": 64, "n": 64, "k": 64}, {"plant": "typo"}, "plant"),
    ({"m": 64, "n": 64, "k": 64}, {"sync": "one", "stages": 1}, "sync"),
    ({"m": 64, "n": 64, "k": 64}, {"b_loads": "wide"}, "b-loads"),  # bf16: B by ldmatrix
    ({"m": 64, "n": 64, "k": 64, "precision": "tf32"}, {"bn": 32, "warps_n": 4, "bk": 16, "b_loads": "wide"}, "b-loads"),
    ({"m": 64, "n": 64, "k": 64, "precision": "tf32"}, {"bk": 16, "pad_b": 1, "b_loads": "wide"}, "b-loads"),
    ({"m": 64, "n": 64, "k": 64}, {"prefetch": "next"}, "prefetch"),  # two barriers per tile
    ({"m": 64, "n": 64, "k": 64}, {"bk": 16, "sync": "one", "prefetch": "next"}, "prefetch"),  # one K step a tile
    ({"m": 64, "n": 64, "k": 64}, {"prefetch": "soon"}, "prefetch"),
])
def test_rules_refuse_what_cannot_be_built(dims, values, rule):
    with pytest.raises(ConfigError, match=f"^{rule}:"):
        OP.validate(OP.shape(**dims), OP.params_from_dict(values))


def test_shapes_and_what_a_user_may_set():
    with pytest.raises(ConfigError, match="^divisibility: bf16 rows"):
        OP.shape(m=8, n=7, k=8)
    with pytest.raises(ConfigError, match="^precision:"):
        OP.shape(m=8, n=8, k=8, precision="fp8")
    with pytest.raises(ConfigError, match="unknown matmul_tc parameter"):
        OP.params_from_user({"plant": "loose_wait"})
    shape = OP.shape(m=4096, n=4096, k=4096, precision="tf32")
    assert OP.shape_key(shape) == "m=4096,n=4096,k=4096/tf32"
    assert OP.tolerance_of(shape, "C", FLOAT32) == 4 * 2.0**-11
    assert [(a.name, a.dtype) for a in OP.args(OP.shape(m=8, n=8, k=8))] == [
        ("C", "float32"), ("A", "bfloat16"), ("B", "bfloat16")]


@pytest.mark.parametrize("precision", ["bf16", "tf32", "fp32x3"])
@pytest.mark.parametrize("k, widest", [(1000, 16), (1002, 8), (37, 4)])
def test_the_default_config_is_valid_and_copies_as_wide_as_the_rows_allow(precision, k, widest):
    if precision == "bf16" and k % 2:
        return  # a bf16 K is even
    bf16_rows = {1000: 16, 1002: 4}  # 2000 and 2004 bytes
    widest = bf16_rows[k] if precision == "bf16" else widest
    shape = OP.shape(m=1000, n=1000, k=k, precision=precision)
    params = OP.params_from_dict(OP.defaults(shape))
    OP.validate(shape, params)
    assert params.copy == widest
    assert {p.copy for p in expand(OP, shape, load_space(OP, "quick", shape))[0]} == {widest}


@pytest.mark.parametrize("precision", ["bf16", "fp32x3"])
def test_wide_copies_fill_the_tiles_and_pass_the_gate_with_tails(precision):
    # M and N tails (50 and 40 of 64-wide tiles) and a K tail (168 over 32- or 16-deep tiles); every copy of its
    # width
    shape = OP.shape(m=50, n=40, k=168, precision=precision)
    params = OP.params_from_dict({"bm": 64, "bn": 64, "bk": 32 if precision == "bf16" else 16, "stages": 3,
                                  "copy": 16})
    v = build(OP, shape, params, "sm_90")
    pieces = 16 // (2 if precision == "bf16" else 4)  # elements per copy
    per_tile = (64 * params.bk + params.bk * 64) // pieces // params.threads  # copies per thread per tile
    assert v.census.cp_async == {16: per_tile * params.stages}, v.census.cp_async  # the prologue's and the loop's
    assert "cp.async.cg.shared.global" in v.compiled.ptx
    result = interp.gate(OP, shape, v, {}, np.random.default_rng(4))
    assert result.passed, result.reason
    with pytest.raises(ConfigError, match="^copy-width: 16-byte copies must divide the rows"):
        OP.validate(OP.shape(m=50, n=40, k=50, precision=precision), params)


def test_a_peer_that_rounds_c_to_bf16_is_allowed_one_bf16_ulp_more():
    shape = OP.shape(m=256, n=256, k=256)
    assert OP.tolerance_of(shape, "C", BFLOAT16) == pytest.approx(2 * 2.0**-8 + OP.tolerance_of(shape, "C", FLOAT32))


@pytest.mark.parametrize("precision", ["bf16", "tf32", "fp32x3"])
def test_the_largest_tiles_the_register_rule_admits_compile_without_spills(precision):
    # 64×64 warp tiles (128 accumulators a thread) are admitted where their unrolled fragments fit; the K depths
    # at which ptxas spills are refused. fp32x3 holds a K tile's products apart from C (twice the accumulators):
    # its largest is 64×32, and 64×64 is refused at any depth.
    shape = OP.shape(m=1000, n=1000, k=1000, precision=precision)
    bn = 64 if precision == "fp32x3" else 128
    big = {"bm": 128, "bn": bn, "warps_m": 2, "warps_n": 2, "stages": 3, "copy": 16,
           "pad_a": 8 if precision == "bf16" else 4}
    fits, spills = {"bf16": (32, 64), "tf32": (16, 32), "fp32x3": (8, 16)}[precision]
    built = build(OP, shape, OP.params_from_dict({**big, "bk": fits}), "sm_90")
    assert built.census.spill_bytes == 0 and built.census.stack_bytes == 0, built.census
    if precision == "fp32x3":
        with pytest.raises(ConfigError, match="^registers:"):
            OP.validate(shape, OP.params_from_dict({**big, "bn": 128, "bk": 8}))
    with pytest.raises(ConfigError, match="^registers:"):
        OP.validate(shape, OP.params_from_dict({**big, "bk": spills}))
