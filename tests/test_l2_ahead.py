"""l2_ahead: a norm block asks L2 for a later block's rows (cp.async.bulk.prefetch.L2), at a chosen eviction priority,
on the CPU: the interpreter runs it and holds every byte asked to the kernel's buffers and every policy to one
createpolicy made, the census counts it, the op refuses what it cannot serve."""

import dataclasses

import numpy as np
import pytest

from mage_gen import interp
from mage_gen.census import take_census
from mage_gen.compile import compile_source
from mage_gen.errors import ConfigError
from mage_gen.ops import get_op
from mage_gen.variants import Variant, build

ARCH = "sm_90"


def ahead(op, template="row", rows=1, kb=1, **extra):
    return op.params_from_dict({"template": template, "threads": 32, "vector": 16, "rows_per_block": rows,
                                "l2_ahead": kb, **extra})


@pytest.mark.parametrize("op_name", ["layernorm", "rmsnorm"])
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("template,rows,extra", [("row", 1, {}), ("multirow", 2, {}), ("wide", 1, {}),
                                                 ("wide", 1, {"hint": "keep_unreleased"})])
def test_a_block_asks_l2_for_a_later_blocks_rows_and_the_output_is_unchanged(op_name, residual, template, rows, extra):
    op = get_op(op_name)
    shape = op.shape(d=256, dtype="bf16", residual=residual)
    variant = build(op, shape, ahead(op, template, rows, **extra), ARCH)
    assert variant.census.l2_prefetch == {"x": 1, **({"residual": 1} if residual else {})}
    assert variant.source.kernel_name.endswith("_ahead1k")
    # 1 KB is two rows of 512 bytes: the block two groups on (one for a block of two rows) at 1 row, at a part-filled
    # last group and past the end
    for m in (1, 5, 9):
        result = interp.gate(op, shape, variant, {"m": m}, np.random.default_rng(m))
        assert result.passed, result.reason


@pytest.mark.parametrize("op_name", ["layernorm", "rmsnorm"])
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("d", [256, 1000])  # rows of 512 bytes, and of 2000: lines across two blocks' rows
def test_rows_asked_at_evict_last_priority_then_released_and_the_output_is_unchanged(op_name, residual, d):
    op = get_op(op_name)
    shape = op.shape(d=d, dtype="bf16", residual=residual)
    kept = build(op, shape, ahead(op, "multirow", 2, ahead_priority="last"), ARCH)
    tensors = {"x": 1, **({"residual": 1} if residual else {})}
    assert kept.census.l2_prefetch == kept.census.l2_prefetch_hinted == tensors
    assert kept.census.cache_policies == {"evict_last": 1}
    assert kept.census.l2_released == tensors  # and given back normal priority once read
    assert kept.source.kernel_name.endswith("_ahead1k_evictlast")
    normal = build(op, shape, ahead(op, "multirow", 2), ARCH)
    assert normal.census.l2_prefetch_hinted == normal.census.cache_policies == normal.census.l2_released == {}
    for m in (1, 5, 9):
        result = interp.gate(op, shape, kept, {"m": m}, np.random.default_rng(m))
        assert result.passed, result.reason


@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("d", [256, 1000])
def test_every_line_asked_for_at_evict_last_is_released_by_the_end_of_the_launch(residual, d):
    op = get_op("layernorm")
    shape = op.shape(d=d, dtype="bf16", residual=residual)
    kept = build(op, shape, ahead(op, "multirow", 2, ahead_priority="last"), ARCH)
    text = kept.source.text
    start, end = text.index("    // This block's rows, read, back to normal priority"), text.rindex("}")
    source = dataclasses.replace(kept.source, text=text[:start] + text[end:])
    compiled = compile_source(source, ARCH)
    unreleased = Variant(kept.params, source, compiled, take_census(compiled))
    assert unreleased.census.l2_released == {}
    for m in (5, 9):
        inputs = op.make_inputs(shape, {"m": m}, np.random.default_rng(m))
        stats = {name: interp.Stats() for name in ("kept", "unreleased")}
        for name, variant in (("kept", kept), ("unreleased", unreleased)):
            interp.launch_with(op, shape, variant, {"m": m}, inputs, stats[name])
        assert stats["kept"].kept_lines == 0
        # 1 KB ahead is the next group of two rows: every row after the first two is asked for, each of its lines
        # (rows of 512 bytes are four whole lines; rows of 2000 bytes share lines)
        rows_asked = (m - 2) * (2 if residual else 1)
        if d == 256:
            assert stats["unreleased"].kept_lines == rows_asked * 4
        else:
            assert stats["unreleased"].kept_lines > rows_asked * 15


def gate_planted(op_name: str, params: dict, old: str, new: str):
    """The interpreter's gate (5 rows) of the kernel with `old`, found once in its text, replaced by `new`."""
    op = get_op(op_name)
    shape = op.shape(d=256, dtype="bf16")
    clean = build(op, shape, ahead(op, **params), ARCH)
    assert clean.source.text.count(old) == 1
    source = dataclasses.replace(clean.source, text=clean.source.text.replace(old, new))
    compiled = compile_source(source, ARCH)
    planted = Variant(clean.params, source, compiled, take_census(compiled))
    return interp.gate(op, shape, planted, {"m": 5}, np.random.default_rng(0))


def test_a_prefetch_under_a_value_no_createpolicy_made_is_refused():
    result = gate_planted("rmsnorm", {"ahead_priority": "last"}, '"l"(ahead_policy) : "memory");',
                          '"l"(ahead + 1) : "memory");')
    assert not result.passed and "not a value createpolicy made" in result.reason


def test_a_release_of_a_line_that_is_not_128_byte_aligned_is_a_fault():
    result = gate_planted("layernorm", {"ahead_priority": "last"}, "+ threadIdx.x * 128ull;", "+ threadIdx.x * 64ull;")
    assert not result.passed and "applypriority" in result.reason and "not 128-byte aligned" in result.reason


def test_a_release_of_a_line_with_no_byte_of_a_buffer_is_a_fault():
    result = gate_planted("layernorm", {"ahead_priority": "last"}, "line_ < end_;", "line_ < end_ + 256;")
    assert not result.passed and "applypriority" in result.reason and "no byte in any buffer" in result.reason


def test_a_prefetch_past_the_last_row_is_a_fault():
    result = gate_planted("rmsnorm", {}, "if (ahead < M) {", "if (true) {")
    assert not result.passed and "prefetch.L2" in result.reason and "outside every buffer" in result.reason


def test_off_by_default_and_the_kernel_text_without_it_is_the_text_before_it():
    op = get_op("layernorm")
    shape = op.shape(d=4096, dtype="bf16")
    plain = op.source(shape, op.params_from_dict({"threads": 128}))
    assert "prefetch" not in plain.text and "_ahead" not in plain.kernel_name
    assert "l2_prefetch" in build(op, shape, op.params_from_dict({"threads": 128}), ARCH).census.to_dict()


def test_the_distance_is_in_whole_row_groups_of_at_least_one():
    op = get_op("layernorm")
    shape = op.shape(d=8192, dtype="bf16")  # rows of 16 KB
    assert op.context(shape, ahead(op, kb=2048))["L2_AHEAD_GROUPS"] == 128
    assert op.context(shape, ahead(op, kb=8))["L2_AHEAD_GROUPS"] == 1
    assert op.context(shape, ahead(op, "multirow", rows=2, kb=2048))["L2_AHEAD_GROUPS"] == 64


@pytest.mark.parametrize("values,why", [
    ({"template": "wide", "ahead_priority": "last"}, "template wide never gives the rows asked ahead"),
    ({"grid_cap": 528}, "one row group per block"),
    ({"l2_ahead": -1}, "KB of rows ahead"),
    ({"l2_ahead": 0, "ahead_priority": "last"}, "l2_ahead is 0"),
    ({"ahead_priority": "first"}, "ahead_priority must be one of"),
])
def test_what_cannot_ask_ahead_is_refused(values, why):
    op = get_op("layernorm")
    with pytest.raises(ConfigError, match=why):
        op.validate(op.shape(d=4096, dtype="bf16"), dataclasses.replace(ahead(op), **values))


def test_a_row_that_is_not_whole_16_byte_units_is_refused():
    op = get_op("layernorm")
    with pytest.raises(ConfigError, match="16-byte"):
        op.validate(op.shape(d=772, dtype="bf16"), ahead(op, vector=8))


def test_it_needs_sm_90_and_rows_aligned_for_it():
    op = get_op("layernorm")
    shape = op.shape(d=4096, dtype="bf16")
    with pytest.raises(ConfigError, match="needs sm_90"):
        build(op, shape, ahead(op), "sm_80")
    narrow = ahead(op, vector=8)  # 8-byte accesses alone would need 8-byte-aligned rows
    assert op.contract(shape, narrow)["tensors"]["x"]["alignment_bytes"] == 16
    assert op.contract(shape, dataclasses.replace(narrow, l2_ahead=0))["tensors"]["x"]["alignment_bytes"] == 8


def test_a_space_expanded_for_an_older_arch_leaves_it_out():
    from mage_gen.space import expand, load_space

    op = get_op("layernorm")
    shape = op.shape(d=4096, dtype="bf16")
    space = load_space(op, "short", shape)
    for_90, _ = expand(op, shape, space, "sm_90")
    for_80, rejected = expand(op, shape, space, "sm_80")
    assert any(p.l2_ahead for p in for_90) and any(p.weights == "l2" for p in for_90)
    assert for_80 == [p for p in for_90 if not p.l2_ahead and p.weights != "l2"]
    assert any("needs sm_90, not sm_80" in why for _, why in rejected)


@pytest.mark.parametrize("op_name", ["layernorm", "rmsnorm"])
@pytest.mark.parametrize("template,rows,extra", [("row", 1, {}), ("multirow", 2, {}), ("row", 1, {"grid_cap": 2}),
                                                 ("wide", 1, {}), ("wide", 1, {"hint": "keep_unreleased"})])
@pytest.mark.parametrize("residual", [False, True])
def test_weights_asked_of_l2_by_the_first_block_and_the_output_is_unchanged(op_name, template, rows, extra, residual):
    op = get_op(op_name)
    shape = op.shape(d=256, dtype="bf16", residual=residual)
    variant = build(op, shape, ahead(op, template, rows, kb=0, weights="l2", **extra), ARCH)
    assert variant.census.l2_prefetch == {"w": 1, **({"b": 1} if op_name == "layernorm" else {})}
    assert variant.source.kernel_name.endswith("_wl2")
    assert op.min_arch_of(shape, variant.params) == 90
    assert op.contract(shape, variant.params)["tensors"]["w"]["alignment_bytes"] == 16
    for m in (1, 5):
        result = interp.gate(op, shape, variant, {"m": m}, np.random.default_rng(m))
        assert result.passed, result.reason


def test_weights_that_are_not_whole_16_byte_units_are_not_asked_for():
    op = get_op("layernorm")
    with pytest.raises(ConfigError, match="weights: a bulk prefetch"):
        op.validate(op.shape(d=772, dtype="bf16"), ahead(op, kb=0, vector=4, weights="l2"))


def test_template_wide_reads_no_weights_early():
    op = get_op("rmsnorm")
    with pytest.raises(ConfigError, match="^wide-options: .*weights late or l2"):
        op.validate(op.shape(d=4096, dtype="bf16"), ahead(op, "wide", kb=0, weights="early"))
