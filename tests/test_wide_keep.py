"""Template wide keeps its row in L2 between its two passes (hint keep, keep_unreleased), fits more blocks per SM
(min_blocks), and loads a group of chunks in each pass before it uses any, on the CPU: the interpreter runs
each and counts what it leaves kept at evict-last, the census counts the loads under a policy, the op refuses what
the template cannot serve."""

import re

import numpy as np
import pytest

from mage_gen import interp
from mage_gen.errors import ConfigError
from mage_gen.ops import get_op
from mage_gen.variants import build

ARCH = "sm_90"


def wide(op, threads=64, **extra):
    return op.params_from_dict({"template": "wide", "threads": threads, "vector": 16, **extra})


@pytest.mark.parametrize("op_name", ["layernorm", "rmsnorm"])
@pytest.mark.parametrize("dtype", ["bf16", "float32"])
@pytest.mark.parametrize("hint", ["keep", "keep_unreleased"])
def test_the_row_is_read_at_evict_last_then_at_evict_first_and_the_output_is_unchanged(op_name, dtype, hint):
    op = get_op(op_name)
    shape = op.shape(d=1024, dtype=dtype)
    variant = build(op, shape, wide(op, hint=hint), ARCH)
    census = variant.census
    assert census.cache_policies == {"evict_first": 1, "evict_last": 1}
    weights = ("w", "b") if op_name == "layernorm" else ("w",)
    hinted = {"x.pass1", "x.pass2"} | (set() if hint == "keep" else set(weights))
    assert set(census.global_loads_hinted) == hinted
    assert census.global_loads_hinted["x.pass1"] == sum(census.global_loads["x.pass1"].values())
    assert census.l2_released == ({"x": 1} if hint == "keep" else {})
    for m in (1, 5):
        result = interp.gate(op, shape, variant, {"m": m}, np.random.default_rng(m))
        assert result.passed, result.reason


@pytest.mark.parametrize("op_name", ["layernorm", "rmsnorm"])
@pytest.mark.parametrize("hint", ["keep", "keep_unreleased"])
def test_with_a_residual_both_rows_are_read_twice_and_the_sum_written_in_the_second_pass(op_name, hint):
    # as Inductor's fused add: pass 1 writes nothing, pass 2 reads x and residual again (at evict-first), writes the
    # rounded sum and normalizes it
    op = get_op(op_name)
    shape = op.shape(d=1024, dtype="bf16", residual=True)
    variant = build(op, shape, wide(op, hint=hint), ARCH)
    census = variant.census
    assert census.load_passes["x"] == census.load_passes["residual"] == [1, 2]
    rows = {"x.pass1", "x.pass2", "residual.pass1", "residual.pass2"}
    assert rows <= set(census.global_loads_hinted)
    assert set(census.global_stores) == {"residual_out.pass2", "y"}
    assert census.stores_of("residual_out") == census.stores_of("y") == 2
    assert census.l2_released == ({"residual": 1, "x": 1} if hint == "keep" else {})
    for m in (1, 5):
        result = interp.gate(op, shape, variant, {"m": m}, np.random.default_rng(m))
        assert result.passed, result.reason


@pytest.mark.parametrize("op_name", ["layernorm", "rmsnorm"])
@pytest.mark.parametrize("residual", [False, True])
def test_keep_leaves_no_line_at_evict_last_and_keep_unreleased_leaves_the_rows_and_weights(op_name, residual):
    op = get_op(op_name)
    shape = op.shape(d=1024, dtype="bf16", residual=residual)
    m = 5
    inputs = op.make_inputs(shape, {"m": m}, np.random.default_rng(3))
    kept = {}
    for hint in ("nc", "keep", "keep_unreleased"):
        stats = interp.Stats()
        interp.launch_with(op, shape, build(op, shape, wide(op, hint=hint), ARCH), {"m": m}, inputs, stats)
        kept[hint] = stats.kept_lines
    row_lines, weight_lines = m * 1024 * 2 // 128 * (2 if residual else 1), 1024 * 2 // 128
    assert kept == {"nc": 0, "keep": 0,
                    "keep_unreleased": row_lines + weight_lines * (2 if op_name == "layernorm" else 1)}


def test_a_load_under_a_policy_names_it_as_its_last_operand():
    op = get_op("rmsnorm")
    text = build(op, op.shape(d=1024, dtype="bf16"), wide(op, hint="keep"), ARCH).source.text
    loads = re.findall(r'ld\.global\.nc\.L2::cache_hint\.v4\.b32 \{%0, %1, %2, %3\}, \[%4\], %5;[^"]*" '
                       r'.*, "l"\((\w+)\)\);', text)
    assert sorted(set(loads)) == ["keep_policy", "last_use_policy"]


@pytest.mark.parametrize("d,threads", [(1024, 64), (1024, 96), (4096, 128), (2048, 32)])
def test_each_pass_loads_a_group_of_chunks_before_it_uses_any_and_covers_the_row(d, threads):
    # 1024/8 = 128 vectors over 64 threads: one group of 2; over 96: a group of 2, the second chunk only for some
    # threads; 512 over 128: a group of 4; 256 over 32: two groups of 4
    op = get_op("rmsnorm")
    shape = op.shape(d=d, dtype="bf16")
    variant = build(op, shape, wide(op, threads=threads, hint="keep"), ARCH)
    group = min(4, -(-(d // 8) // threads))
    loads = variant.census.global_loads
    assert sum(loads["x.pass1"].values()) == sum(loads["x.pass2"].values()) == variant.census.stores_of("y") == group
    for m in (1, 3):
        result = interp.gate(op, shape, variant, {"m": m}, np.random.default_rng(d + m))
        assert result.passed, result.reason


@pytest.mark.parametrize("op_name", ["layernorm", "rmsnorm"])
def test_wide_fits_its_registers_to_min_blocks(op_name):
    op = get_op(op_name)
    shape = op.shape(d=8192, dtype="bf16")
    free = build(op, shape, wide(op, threads=512, hint="keep_unreleased"), ARCH)
    fitted = build(op, shape, wide(op, threads=512, hint="keep_unreleased", min_blocks=4), ARCH)
    assert "__launch_bounds__(512, 4)" in fitted.source.text
    assert free.census.registers > 32 >= fitted.census.registers
    assert fitted.source.kernel_name.endswith("_keep_unreleased_b4")


@pytest.mark.parametrize("params,shape_args,words", [
    ({"template": "row", "hint": "keep"}, {}, "template wide"),
    ({"template": "wide", "hint": "keep", "vector": 16}, {"d": 1001 * 2}, "whole vectors"),
])
def test_keep_is_refused_where_the_template_cannot_serve_it(params, shape_args, words):
    op = get_op("layernorm")
    shape = op.shape(**{"d": 1024, "dtype": "bf16", **shape_args})
    with pytest.raises(ConfigError, match=words):
        op.validate(shape, op.params_from_dict({"threads": 64, "vector": 16, **params}))


@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("hint", ["nc", "keep_unreleased"])
def test_a_wide_layer_norm_takes_shifted_statistics_in_one_reduction_without_a_division(residual, hint):
    op = get_op("layernorm")
    shape = op.shape(d=1024, dtype="bf16", residual=residual)
    shifted = build(op, shape, wide(op, threads=64, hint=hint, stats="shifted"), ARCH)
    chan = build(op, shape, wide(op, threads=64, hint=hint), ARCH)
    assert shifted.source.kernel_name.endswith("_shift")
    # the shift is the row's first element (and its residual's): one scalar load each beside the row
    assert {"x_first", "residual_first"} & set(shifted.census.global_loads) == (
        {"x_first", "residual_first"} if residual else {"x_first"})
    # volatile, so that ptxas keeps it in pass 1's loop beside the chunk loads: hoisted, the row waited on it alone
    first_loads = [line for line in shifted.compiled.ptx.splitlines() if "tensor=x_first" in line]
    assert first_loads and all("ld.volatile.global" in line for line in first_loads)
    assert shifted.census.bar_sync == chan.census.bar_sync == 1
    assert "div.rn.f32" in chan.compiled.ptx and "div.rn.f32" not in shifted.compiled.ptx
    for m in (1, 5):
        result = interp.gate(op, shape, shifted, {"m": m}, np.random.default_rng(m))
        assert result.passed, result.reason


def test_shifted_statistics_in_wide_need_rows_of_whole_vectors():
    op = get_op("layernorm")
    with pytest.raises(ConfigError, match="^wide-options: .*whole vectors"):
        op.validate(op.shape(d=1001 * 2, dtype="bf16"), wide(op, threads=64, stats="shifted"))


L1_QUALIFIERS = {"normal": (None, None), "last": ("L1::evict_last", None), "first": (None, "L1::evict_first"),
                 "last_first": ("L1::evict_last", "L1::evict_first")}


@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("l1", list(L1_QUALIFIERS))
def test_l1_priorities_mark_the_first_pass_and_w_evict_last_and_the_second_evict_first(l1, residual):
    op = get_op("rmsnorm")
    shape = op.shape(d=1024, dtype="bf16", residual=residual)
    variant = build(op, shape, wide(op, hint="keep_unreleased", l1=l1), ARCH)
    first, second = L1_QUALIFIERS[l1]
    rows = ("x", "residual") if residual else ("x",)

    def qualifiers(tag):
        lines = [line for line in variant.compiled.ptx.splitlines() if line.strip().startswith("ld.global")
                 and f"tensor={tag}" in line]
        assert lines, tag
        return {q for line in lines for q in re.findall(r"L1::\w+", line.split()[0])}

    for row in rows:
        assert qualifiers(f"{row}.pass1") == ({first} if first else set())
        assert qualifiers(f"{row}.pass2") == ({second} if second else set())
    assert qualifiers("w") == ({first} if first else set())
    suffix = {"normal": "_keep_unreleased", "last": "_l1l", "first": "_l1f", "last_first": "_l1lf"}[l1]
    assert variant.source.kernel_name.endswith(suffix)
    for m in (1, 5):
        result = interp.gate(op, shape, variant, {"m": m}, np.random.default_rng(m))
        assert result.passed, result.reason


@pytest.mark.parametrize("params,words", [
    ({"template": "row", "hint": "nc", "l1": "last"}, "^l1: L1 priorities are given to the two passes of a keep hint"),
    ({"template": "wide", "hint": "nc", "l1": "first"}, "hint is nc; leave l1 at normal"),
    ({"template": "wide", "hint": "keep", "l1": "both"}, "^l1: l1 must be one of"),
])
def test_l1_priorities_are_refused_outside_a_keep_hint(params, words):
    op = get_op("rmsnorm")
    with pytest.raises(ConfigError, match=words):
        op.validate(op.shape(d=1024, dtype="bf16"), op.params_from_dict({"threads": 64, "vector": 16, **params}))
