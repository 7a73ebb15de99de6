"""On the GPU: every generated layer-norm variant computes layer norm. Skipped without a CUDA driver."""

import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mage_gen import gpu
from mage_gen.measure import Bench, gate
from mage_gen.ops import get_op
from mage_gen.space import load_space
from mage_gen.variants import build

import planted
from drawn import gate_a_drawn_variant

pytestmark = pytest.mark.gpu
OP = get_op("layernorm")


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_drawn_variants_match_the_float64_reference(device, stream, data):
    name, m, result = gate_a_drawn_variant(OP, load_space(OP, "full", sms=device.sms), device, stream, data)
    assert result.passed, f"{name} m={m}: {result.reason}"
    assert result.worst_error < OP.tolerance


def test_timings_are_positive_and_grow_with_the_problem(device):
    shape = OP.shape(d=1024)
    variant = build(OP, shape, OP.params_type(template="row", threads=128, vector=16), device.arch)
    small = Bench(OP, shape, {"m": 1024}, seed=1).evaluate(variant)
    large = Bench(OP, shape, {"m": 65536}, seed=2).evaluate(variant)
    for ev in (small, large):
        assert ev.gate.passed, ev.gate.reason
        for t in (ev.hot, ev.cold):
            assert math.isfinite(t.median_us) and t.median_us > 0 and t.spread_us >= 0
    assert large.hot.median_us > 4 * small.hot.median_us  # 64× the rows cannot cost under 4× the time
    assert large.cold.median_us > small.cold.median_us
    for ev in (small, large):  # where the evaluation's time went, as `tune` reports it per trial
        assert set(ev.seconds) == {"load", "gate", "gate_host", "timing"}
        assert 0 < ev.seconds["gate_host"] < ev.seconds["gate"] and min(ev.seconds.values()) > 0



@pytest.mark.parametrize("bug", sorted(planted.BUGS))
def test_the_gate_rejects_each_planted_layernorm_bug(device, stream, bug):
    for v, should_pass in ((planted.variant(device.arch), True), (planted.variant(device.arch, bug), False)):
        kernel = gpu.Kernel(v.compiled.cubin, v.source.kernel_name)
        try:
            result = gate(OP, planted.SHAPE, v.params, kernel, {"m": 4096}, np.random.default_rng(3), stream)
        finally:
            kernel.unload()
        assert result.passed == should_pass, (bug, result.reason)
