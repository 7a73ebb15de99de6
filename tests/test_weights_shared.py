"""weights shared: a norm block copies w (and b) into shared memory beside its first row's x (cp.async) and reads them
back after the statistics. On the CPU: the interpreter runs each form (a block of one row and of several, a
persistent grid, the residual, fp32 weights beside bf16 rows, RMSNorm) against the float64 reference, and would
stop on a read of shared memory a copy still in flight fills, or on two rows' threads racing on it; the census
counts the copies; the op refuses what cannot be staged."""

import dataclasses

import numpy as np
import pytest

from mage_gen import interp
from mage_gen.errors import ConfigError
from mage_gen.ops import get_op
from mage_gen.variants import build

ARCH = "sm_90"


def staged(op, **values):
    return op.params_from_dict({"template": "row", "threads": 64, "vector": 16, "weights": "shared", **values})


@pytest.mark.parametrize("op_name", ["layernorm", "rmsnorm"])
@pytest.mark.parametrize("shape_values,values", [
    (dict(dtype="bf16"), {}),
    (dict(dtype="bf16"), {"threads": 32}),  # one warp a row: no barrier at all
    (dict(dtype="bf16"), {"template": "multirow", "threads": 32, "rows_per_block": 4}),
    (dict(dtype="bf16"), {"template": "multirow", "threads": 32, "rows_per_block": 2, "grid_cap": 3}),
    (dict(dtype="bf16"), {"grid_cap": 2, "stats": "shifted"}),
    (dict(dtype="bf16", residual=True), {"hold": "packed"}),
    (dict(dtype="bf16", weight_dtype="fp32"), {}),  # 32 bytes of weights a slot: two copies each
    (dict(dtype="fp32"), {"vector": 8}),
])
def test_weights_staged_in_shared_memory_give_the_reference_output(op_name, shape_values, values):
    op = get_op(op_name)
    if op_name == "rmsnorm" and values.get("stats") == "shifted":
        values = {k: v for k, v in values.items() if k != "stats"}
    shape = op.shape(d=512, **shape_values)
    variant = build(op, shape, staged(op, **values), ARCH)
    tensors = 2 if op_name == "layernorm" else 1
    slots, elements = op._slots(shape, variant.params), op._elements(shape, variant.params)
    weight_bytes = 4 if shape_values.get("weight_dtype", shape_values["dtype"]) == "fp32" else 2
    # each slot's weights copied once, 16 bytes at a time at most (fp32 weights beside 8 bf16: two copies)
    copies = variant.census.cp_async
    assert sum(size * n for size, n in copies.items()) == tensors * slots * elements * weight_bytes
    assert max(copies) == min(16, elements * weight_bytes)
    assert variant.census.commit_groups == 1 and variant.census.wait_groups == {0: 1}
    for m in (1, 5, 9):  # rows past the end of a block of several, and of a persistent grid
        result = interp.gate(op, shape, variant, {"m": m}, np.random.default_rng(m))
        assert result.passed, result.reason


def test_the_wait_comes_before_the_staged_weights_are_read():
    # without it the interpreter stops on a read of shared memory a copy still in flight fills
    op = get_op("layernorm")
    shape = op.shape(d=512, dtype="bf16")
    variant = build(op, shape, staged(op), ARCH)
    ptx = variant.compiled.ptx
    assert ptx.index("cp.async.wait_group 0") < ptx.index("tensor=w.staged")
    unwaited = dataclasses.replace(variant, compiled=dataclasses.replace(
        variant.compiled, ptx=ptx.replace("cp.async.wait_group 0;", "")))
    result = interp.gate(op, shape, unwaited, {"m": 1}, np.random.default_rng(0))
    assert not result.passed and "cp.async" in result.reason, result.reason


@pytest.mark.parametrize("shape_values,values,why", [
    (dict(d=512, dtype="bf16"), {"template": "wide"}, "wide-options"),
    (dict(d=516, dtype="bf16"), {}, "must divide d=516"),
    (dict(d=8192, dtype="fp32"), {}, "static shared memory"),  # 64 KB of w and b
])
def test_what_cannot_be_staged_is_refused(shape_values, values, why):
    op = get_op("layernorm")
    with pytest.raises(ConfigError, match=why):
        op.validate(op.shape(**shape_values), staged(op, **values))


def test_the_launch_declares_the_staged_bytes():
    op = get_op("layernorm")
    shape = op.shape(d=8192, dtype="bf16")
    variant = build(op, shape, staged(op, threads=128), ARCH)
    launch = op.geometry(shape, variant.params, {"m": 4})
    assert launch.static_shared_bytes == variant.census.shared_bytes == 2 * 8192 * 2 + 2 * 4 * 4
    assert op.min_arch_of(op.shape(d=512), staged(op)) == 80
