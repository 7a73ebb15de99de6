"""On the GPU: every generated matmul variant computes A·B, and the gate rejects the planted pipeline
bugs. Skipped without a CUDA driver."""

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mage_gen.measure import Bench
from mage_gen.ops import get_op
from mage_gen.ops.matmul import Params
from mage_gen.space import expand, load_space
from mage_gen.variants import build

from drawn import gate_on_gpu  # tests/drawn.py

pytestmark = pytest.mark.gpu
OP = get_op("matmul")
SPACE = load_space(OP, "explore")


def run_gate(device, stream, shape, params, seed=0):
    return gate_on_gpu(OP, device, stream, shape, params, seed=seed)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_drawn_variants_match_the_float64_reference(device, stream, data):
    dims = st.one_of(st.integers(1, 300), st.sampled_from([64, 128, 1000, 1024]))
    shape = OP.shape(m=data.draw(dims, label="m"), n=data.draw(dims, label="n"), k=data.draw(dims, label="k"))
    valid, _ = expand(OP, shape, SPACE)
    if not valid:  # an N that no 16-byte copy of B can serve
        return
    params = data.draw(st.sampled_from(valid), label="params")
    result = run_gate(device, stream, shape, params, data.draw(st.integers(0, 2**32 - 1)))
    assert result.passed, f"{params.label()} at {shape}: {result.reason}"


@pytest.mark.parametrize("dims", [(256, 256, 256), (200, 136, 328)])
@pytest.mark.parametrize("bug", ["offset_units", "last_tile_parity"])
def test_the_gate_rejects_each_planted_pipeline_bug(device, stream, dims, bug):
    m, n, k = dims
    shape = OP.shape(m=m, n=n, k=k)
    assert run_gate(device, stream, shape, Params()).passed  # the seed itself is right
    result = run_gate(device, stream, shape, Params(plant=bug))
    assert not result.passed and result.reason


def test_a_timed_kernel_reads_back_its_fences_untouched(device):
    # The timing subject's outputs are fenced like the gate's: after timed launches its fences must read as
    # poisoned (a false "wrote outside C" came from fences that were never poisoned).
    shape, params = OP.shape(m=256, n=256, k=256), Params()
    variant = build(OP, shape, params, device.arch)
    bench = Bench(OP, shape, {}, seed=3)
    kernel = bench.load(variant)
    try:
        subject = bench.subject(variant, kernel)
        bench.stream.synchronize()
        assert subject.bound.fence_complaints() == []
        subject.hot(2)
        subject.cold(2)
        bench.stream.synchronize()
        outputs, complaints = subject.bound.outputs()
        assert complaints == [] and np.isfinite(outputs["C"]).all()
        subject.close()
    finally:
        kernel.unload()
