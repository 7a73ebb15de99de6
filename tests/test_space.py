"""Search spaces as the spec files declare them: presets, their bases and default-by-size rules, the first
configs a space measures, values given per SM, and the one-line errors for a spec that cannot hold."""

import dataclasses
from pathlib import Path

import pytest

from mage_gen.errors import ConfigError
from mage_gen.ops import get_op
from mage_gen.space import expand, load_space


def test_the_norm_spaces_for_long_rows_start_from_the_triton_peer_s_kernel():
    for name in ("layernorm", "rmsnorm"):
        op = get_op(name)
        shape = op.shape(d=8192, dtype="bf16")
        space = load_space(op, "long", shape)
        valid = set(expand(op, shape, space, "sm_90")[0])
        triton_w8 = op.params_from_dict({"template": "row", "threads": 256, "vector": 16, "hint": "none"})
        assert triton_w8 in valid and triton_w8.l2_ahead == 0 and triton_w8.min_blocks == 1
        assert triton_w8 in {op.params_from_dict(dict(values)) for values in space.first}
        # Triton's 16 warps hold 4 rows per SM; ours of 512 threads does only when fitted to it
        triton_w16 = dataclasses.replace(triton_w8, threads=512, min_blocks=4)
        assert triton_w16 in valid and triton_w16 in {op.params_from_dict(dict(values)) for values in space.first}
        assert space.narrowed(threads=(512,)).first == space.first


def test_a_grid_given_per_sm_is_sized_for_the_gpu_the_space_is_loaded_for():
    for name in ("layernorm", "rmsnorm"):
        op = get_op(name)
        assert dict(load_space(op, "full", sms=100).axes)["grid_cap"] == (0, 400)
        assert dict(load_space(op, "quick", sms=132).axes)["grid_cap"] == (0, 528)
        assert dict(load_space(op, "full").axes)["grid_cap"] == (0,)  # no GPU named: no grid to size
        assert load_space(op, "full").needs_sms and not load_space(op, "full", sms=132).needs_sms
    assert not load_space(get_op("matmul"), "quick").needs_sms  # no value of it is given per SM


def test_the_gemm_spaces_start_from_whole_128_row_tiles_on_one_cta_per_sm_of_the_gpu():
    op = get_op("gemm_sm90")
    shape = op.shape(m=512, n=6144, k=4096)
    space = load_space(op, "mid", shape, sms=132)
    first = [op.params_from_dict(dict(values)) for values in space.first]
    assert [(p.bm, p.bn, p.stages, p.epilogue, p.grid) for p in first] == [
        (128, 192, 4, "tma", 132), (128, 128, 5, "tma", 132), (128, 256, 3, "tma", 132)]
    assert set(first) <= set(expand(op, shape, space, "sm_90a")[0])
    on_100 = load_space(op, "mid", shape, sms=100).first
    assert [p.grid for p in (op.params_from_dict(dict(values)) for values in on_100)] == [100] * 3
    assert load_space(op, "mid", shape).first == ()  # no GPU named: no grid to size, as the axes leave it out


def test_a_first_table_naming_an_unknown_axis_is_a_one_line_error(tmp_path, monkeypatch):
    spec = (Path(__file__).parents[1] / "search" / "rmsnorm.toml").read_text()
    (tmp_path / "search").mkdir()
    (tmp_path / "search" / "rmsnorm.toml").write_text(spec.replace('hint = ["none"]\n', 'warps = [8]\n', 1))
    monkeypatch.setattr("mage_gen.space.data_dir", lambda name: tmp_path / name)
    with pytest.raises(ConfigError, match=r"\[first\] of rmsnorm.toml names unknown axes warps"):
        load_space(get_op("rmsnorm"), "long")


def test_a_shape_with_no_preset_named_gets_the_first_whose_sizes_hold_it():
    from mage_gen.space import default_preset

    gemm = get_op("gemm_sm90")
    chosen = {m: load_space(gemm, None, gemm.shape(m=m, n=4096, k=4096)).preset for m in (16, 256, 257, 1024, 1025)}
    assert chosen == {16: "skinny", 256: "skinny", 257: "mid", 1024: "mid", 1025: "quick"}
    assert default_preset(gemm) == "quick" and load_space(gemm).preset == "quick"  # no shape: the spec's default
    assert load_space(gemm, "full", gemm.shape(m=16, n=64, k=64)).preset == "full"  # a preset named is the preset
    layernorm = get_op("layernorm")
    assert load_space(layernorm, None, layernorm.shape(d=768)).preset == "quick"  # no rules: the default


@pytest.mark.parametrize("rule", ['{ preset = "narrow", up_to = { m = 256 } }', '{ preset = "skinny", up_to = { x = 2 } }',
                                  '{ preset = "skinny", up_to = { m = 2.5 } }', '{ preset = "skinny" }'])
def test_a_default_by_size_rule_the_spec_cannot_hold_is_a_one_line_error(tmp_path, monkeypatch, rule):
    spec = (Path(__file__).parents[1] / "search" / "gemm_sm90.toml").read_text()
    (tmp_path / "search").mkdir()
    (tmp_path / "search" / "gemm_sm90.toml").write_text(
        spec.replace('{ preset = "skinny", up_to = { m = 256 } }', rule, 1))
    monkeypatch.setattr("mage_gen.space.data_dir", lambda name: tmp_path / name)
    gemm = get_op("gemm_sm90")
    with pytest.raises(ConfigError, match=r"^space: each default_by_size of gemm_sm90.toml takes a preset of the spec"):
        load_space(gemm, None, gemm.shape(m=4096, n=64, k=64))


def test_a_preset_with_a_base_narrows_the_base_s_axes_then_its_own():
    gemm = get_op("gemm_sm90")
    skinny, chained = (dict(load_space(gemm, preset).axes) for preset in ("skinny", "skinny_chains"))
    assert chained["chains"] == (1, 2) and skinny["chains"] == (1,)
    assert {axis: v for axis, v in chained.items() if axis != "chains"} == \
        {axis: v for axis, v in skinny.items() if axis != "chains"}
    assert "base" not in chained
    # a base's own base first: skinny_tail is skinny_chains with the split summed by ticket as well
    tail = dict(load_space(gemm, "skinny_tail").axes)
    assert tail["split_sum"] == ("global", "ticket") and tail["chains"] == (1, 2)
    assert {axis: v for axis, v in tail.items() if axis != "split_sum"} == \
        {axis: v for axis, v in chained.items() if axis != "split_sum"}


@pytest.mark.parametrize("base, why", [("narrow", "is not a preset"), ("skinny_chains", "leads back to itself")])
def test_a_base_that_is_no_preset_or_leads_back_is_a_one_line_error(tmp_path, monkeypatch, base, why):
    spec = (Path(__file__).parents[1] / "search" / "gemm_sm90.toml").read_text()
    (tmp_path / "search").mkdir()
    (tmp_path / "search" / "gemm_sm90.toml").write_text(spec.replace('base = "skinny"', f'base = "{base}"', 1))
    monkeypatch.setattr("mage_gen.space.data_dir", lambda name: tmp_path / name)
    with pytest.raises(ConfigError, match=rf"^space: the base '{base}' of preset skinny_chains in gemm_sm90.toml {why}"):
        load_space(get_op("gemm_sm90"), "skinny_chains")


def test_the_rmsnorm_space_for_long_rows_starts_from_inductor_s_kernel_too():
    op = get_op("rmsnorm")
    shape = op.shape(d=8192, dtype="bf16")
    space = load_space(op, "long", shape)
    valid = set(expand(op, shape, space, "sm_90")[0])
    first = [op.params_from_dict(dict(values)) for values in space.first]
    inductor = op.params_from_dict({"template": "wide", "threads": 512, "vector": 16, "hint": "keep_unreleased",
                                    "min_blocks": 4})
    assert inductor in valid and inductor in first
    # Triton's tables come first, in the order written, then Inductor's, and no config is measured twice
    assert first[0].template == "row" and len(set(first)) == len(first)
    asking = [i for i, p in enumerate(first) if p.weights == "l2"]
    assert asking and first.index(inductor) < min(asking)
    # then Inductor's kernel with w asked of L2 as the launch starts
    inductor_asking = dataclasses.replace(inductor, weights="l2")
    assert inductor_asking in valid and inductor_asking in first
