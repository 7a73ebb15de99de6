"""Planted template bugs must change the generated code and fail the gate. Here the gate runs on the
CPU through the PTX interpreter; tests/test_gpu_*.py run the same bugs on the GPU."""

import re

import numpy as np
import pytest

from mage_gen import interp
from planted import BUGS, OP, SHAPE, variant


def strip_names(ptx: str) -> str:
    return re.sub(r"layernorm_\w+", "K", ptx)


@pytest.mark.parametrize("bug", sorted(BUGS))
def test_each_layernorm_bug_changes_the_ptx_and_fails_the_gate(bug):
    clean, planted = variant("sm_90"), variant("sm_90", bug)
    assert strip_names(clean.compiled.ptx) != strip_names(planted.compiled.ptx)
    assert interp.gate(OP, SHAPE, clean, {"m": 3}, np.random.default_rng(1)).passed
    result = interp.gate(OP, SHAPE, planted, {"m": 3}, np.random.default_rng(1))
    assert not result.passed and result.reason
