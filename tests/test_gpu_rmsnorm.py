"""On the GPU: generated RMSNorm variants compute RMSNorm, and its peers pass the same gate. Skipped without
a CUDA driver."""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mage_gen.measure import Bench
from mage_gen.ops import get_op
from mage_gen.space import load_space
from mage_gen.variants import build

from drawn import gate_a_drawn_variant

pytestmark = pytest.mark.gpu
OP = get_op("rmsnorm")
FULL = load_space(OP, "full")


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_drawn_variants_match_the_float64_reference(device, stream, data):
    name, m, result = gate_a_drawn_variant(OP, FULL, device, stream, data)
    assert result.passed, f"{name} m={m}: {result.reason}"


def test_torch_and_triton_rmsnorm_pass_the_gate_beside_a_variant(device):
    pytest.importorskip("torch")
    from mage_gen.peers import make_peers

    shape, run = OP.shape(d=4096), {"m": 4096}
    bench = Bench(OP, shape, run, seed=3)
    evaluation = bench.evaluate(build(OP, shape, OP.params_from_dict({"template": "row", "threads": 256, "vector": 16}),
                                      device.arch))
    assert evaluation.gate.passed, evaluation.gate.reason
    peers, missing = make_peers(OP, shape, run, bench.timing_inputs(), None, check=bench.check_tensor)
    assert {p.name for p in peers} >= {"torch"} and not any("gate" in why for why in missing.values()), missing
