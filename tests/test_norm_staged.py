"""Template staged: rows copied by cp.async into shared memory `stages` turns ahead of their use, run by the CPU
interpreter (which tracks each async copy until its wait_group) and counted in the PTX."""

import dataclasses
import re

import numpy as np
import pytest

from mage_gen import interp
from mage_gen.census import take_census
from mage_gen.compile import compile_source
from mage_gen.errors import ConfigError
from mage_gen.ops import get_op
from mage_gen.variants import build

LN, RMS = get_op("layernorm"), get_op("rmsnorm")


def staged(op, d=520, dtype="bf16", residual=False, **values):
    # d = 520 bf16 at 16 bytes: 65 vectors, so 64 threads leave the second slot one lane wide
    shape = op.shape(d=d, dtype=dtype, residual=residual)
    params = op.params_from_dict({"template": "staged", "threads": 64, "vector": 16, "stages": 3, "grid_cap": 2}
                                 | values)
    return shape, build(op, shape, params, "sm_90")


@pytest.mark.parametrize("op", [LN, RMS], ids=["layernorm", "rmsnorm"])
@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
@pytest.mark.parametrize("values", [{}, {"hold": "packed", "weights": "early"}, {"stages": 2, "threads": 96}],
                         ids=["float", "packed-early", "two-stages"])
def test_a_staged_row_is_copied_once_and_every_row_of_a_block_passes_the_gate(op, residual, values):
    shape, v = staged(op, residual=residual, **values)
    c, stages, slots = v.census, v.params.stages, -(-65 // v.params.threads)
    tensors = 2 if residual else 1
    # x (and the residual) only by 16-byte copies: `stages` rows issued ahead, one refill per row
    assert c.loads_of("x") == 0 and c.passes_over("x") == 1
    assert c.cp_async == {16: (stages + 1) * slots * tensors} and c.commit_groups == stages + 1
    assert c.wait_groups == {stages - 1: 1}
    assert op.geometry(shape, v.params, {"m": 9}).dynamic_shared_bytes == stages * tensors * 520 * 2
    # two blocks walk 1, 3 and 37 rows: each block reuses every stage many times at 37
    for m in (1, 3, 37):
        result = interp.gate(op, shape, v, {"m": m}, np.random.default_rng(m))
        assert result.passed, (m, result.reason)


def test_a_stage_read_before_its_copy_is_waited_for_is_caught():
    # one wait_group too lenient: the row's own copies may still be in flight when it is read from its stage
    shape, clean = staged(LN)
    text, count = re.subn(r"cp\.async\.wait_group 2;", "cp.async.wait_group 3;", clean.source.text)
    assert count == 1
    source = dataclasses.replace(clean.source, text=text)
    compiled = compile_source(source, "sm_90")
    planted = dataclasses.replace(clean, source=source, compiled=compiled, census=take_census(compiled))
    assert interp.gate(LN, shape, clean, {"m": 9}, np.random.default_rng(3)).passed
    result = interp.gate(LN, shape, planted, {"m": 9}, np.random.default_rng(3))
    assert not result.passed and result.reason


@pytest.mark.parametrize("values, rule", [
    ({"grid_cap": 0}, "staged"),  # a persistent grid or nothing
    ({"stages": 1}, "stages"), ({"stages": 9}, "stages"),
    ({"hint": "none"}, "hint"),
    ({"vector": 16, "stages": 8, "d": 8192, "residual": True}, "shared-memory"),  # 8 × 2 × 16 KB
    ({"vector": 16, "d": 1028}, "staged"),  # 8 elements do not divide d: no head or tail here
])
def test_what_a_staged_block_cannot_do_is_refused_by_a_rule(values, rule):
    values = {"template": "staged", "threads": 128, "vector": 16, "stages": 3, "grid_cap": 264} | values
    d, residual = values.pop("d", 4096), values.pop("residual", False)
    with pytest.raises(ConfigError, match=f"^{rule}:"):
        LN.validate(LN.shape(d=d, dtype="bf16", residual=residual), LN.params_from_dict(values))
    with pytest.raises(ConfigError, match="^stages: only template staged"):
        LN.validate(LN.shape(d=4096, dtype="bf16"), LN.params_from_dict({"threads": 128, "stages": 2}))
