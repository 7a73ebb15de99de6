"""On the GPU: generated RMSNorm variants compute RMSNorm, and its peers pass the same gate. Skipped without
a CUDA driver."""

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mage_gen import gpu
from mage_gen.measure import Bench, gate
from mage_gen.ops import get_op
from mage_gen.space import expand, load_space
from mage_gen.variants import build

pytestmark = pytest.mark.gpu
OP = get_op("rmsnorm")
FULL = load_space(OP, "full")


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_drawn_variants_match_the_float64_reference(device, stream, data):
    d = data.draw(st.one_of(st.integers(1, 1024), st.integers(1, 16384)), label="d")
    shape = OP.shape(d=d)
    valid, _ = expand(OP, shape, FULL)
    params = data.draw(st.sampled_from(valid), label="params")
    m = data.draw(st.integers(1, 5000), label="m")
    variant = build(OP, shape, params, device.arch)
    kernel = gpu.Kernel(variant.compiled.cubin, variant.source.kernel_name)
    try:
        result = gate(OP, shape, params, kernel, {"m": m}, np.random.default_rng(data.draw(st.integers(0, 2**32 - 1))),
                      stream)
    finally:
        kernel.unload()
    assert result.passed, f"{variant.source.kernel_name} m={m}: {result.reason}"


def test_torch_and_triton_rmsnorm_pass_the_gate_beside_a_variant(device):
    pytest.importorskip("torch")
    from mage_gen.peers import make_peers

    shape, run = OP.shape(d=4096), {"m": 4096}
    bench = Bench(OP, shape, run, seed=3)
    evaluation = bench.evaluate(build(OP, shape, OP.params_from_dict({"template": "row", "threads": 256, "vector": 4}),
                                      device.arch))
    assert evaluation.gate.passed, evaluation.gate.reason
    peers, missing = make_peers(OP, shape, run, bench.timing_inputs(), None, check=bench.check_tensor)
    assert {p.name for p in peers} >= {"torch"} and not any("gate" in why for why in missing.values()), missing
