"""On the GPU: tensor-core matmul variants drawn from the whole space, with tails, at each precision compute
A·B within their precision's tolerance, and the gate rejects the planted pipeline bugs there as the CPU
interpreter does (tests/test_matmul_tc.py). Skipped without a CUDA driver."""

import random

import pytest
from hypothesis import HealthCheck, given, reject, settings
from hypothesis import strategies as st

from mage_gen.ops import get_op
from mage_gen.space import draw, load_space

from drawn import gate_on_gpu  # tests/drawn.py

pytestmark = pytest.mark.gpu
OP = get_op("matmul_tc")


def run_gate(device, stream, shape, params, seed=0):
    return gate_on_gpu(OP, device, stream, shape, params, seed=seed)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_drawn_variants_match_the_float64_reference(device, stream, data):
    precision = data.draw(st.sampled_from(["bf16", "tf32", "fp32x3"]), label="precision")
    even = 2 if precision == "bf16" else 1  # a bf16 row is read at least 4 bytes at a time
    dims = st.one_of(st.integers(1, 160), st.sampled_from([64, 128, 1000]))
    m = data.draw(dims, label="m")
    n, k = (even * -(-data.draw(dims, label=name) // even) for name in ("n", "k"))
    shape = OP.shape(m=m, n=n, k=k, precision=precision)
    space = load_space(OP, "full", shape)
    params = draw(OP, shape, space, random.Random(data.draw(st.integers(0, 2**32 - 1), label="params seed")))
    if params is None:
        reject()
    result = run_gate(device, stream, shape, params, data.draw(st.integers(0, 2**32 - 1), label="seed"))
    assert result.passed, f"{params.label()} at {shape}: {result.reason}"


@pytest.mark.parametrize("precision", ["bf16", "tf32", "fp32x3"])
@pytest.mark.parametrize("plant", ["stage_off_by_one", "loose_wait"])
@pytest.mark.parametrize("sync, prefetch", [("two", "none"), ("one", "none"), ("one", "next")])
def test_the_gate_rejects_each_planted_pipeline_bug(device, stream, plant, precision, sync, prefetch):
    # A loose wait is a race: it shows only where a stage is read before its copy lands. Two stages leave the
    # least slack, and inputs that C's poisoning (64 MB) pushes out of L2 make the first tiles come from DRAM.
    # With three stages at 256² (inputs in L2) the copies landed in time and the planted kernel passed on an
    # H200; at this size it failed 5 of 5 fresh inputs at every precision and sync (bench/
    # tc_loose_wait_probe.py, in git at 59ba810; results/h200/tc_loose_wait_probe_*.json).
    shape = OP.shape(m=4096, n=4096, k=1024, precision=precision)
    # fragments loaded ahead take an even number of K steps a tile: bf16 bk 32
    bk = 32 if prefetch == "next" and precision == "bf16" else 16
    values = {"bm": 64, "bn": 64, "bk": bk, "stages": 2, "sync": sync, "prefetch": prefetch}
    assert run_gate(device, stream, shape, OP.params_from_dict(values)).passed  # the unplanted config is right
    result = run_gate(device, stream, shape, OP.params_from_dict({**values, "plant": plant}), seed=1)
    assert not result.passed and result.reason
