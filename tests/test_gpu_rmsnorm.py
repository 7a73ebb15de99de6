"""On the GPU: generated RMSNorm variants compute RMSNorm, and its peers pass the same gate. Skipped without
a CUDA driver."""

import contextlib

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


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_drawn_variants_match_the_float64_reference(device, stream, data):
    name, m, result = gate_a_drawn_variant(OP, load_space(OP, "full", sms=device.sms), device, stream, data)
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


@contextlib.contextmanager
def gated_on_the_bench_inputs(device, shape, run, seed):
    """(bench, subject): a row variant of 256 threads gated, bound to the bench's timing inputs in place."""
    bench = Bench(OP, shape, run, seed=seed)
    variant = build(OP, shape, OP.params_from_dict({"template": "row", "threads": 256, "vector": 16}), device.arch)
    kernel = bench.load(variant)
    try:
        subject, checked = bench.checked_subject(variant, kernel, share_inputs=True)
        assert subject is not None, checked.reason
        try:
            yield bench, subject
        finally:
            subject.close()
    finally:
        kernel.unload()


def test_a_shared_subject_and_its_peers_read_the_bench_buffers_in_place(device):
    """bench/norms.py times the kernel, the peers and the copy floor on one copy of the inputs: the kernel's bound
    and the peers' tensors are the bench's buffers, left to the bench when the subject goes, and a write into
    them shows."""
    torch = pytest.importorskip("torch")
    import numpy as np

    from mage_gen.peers import make_peers, on_gpu

    shape, run = OP.shape(d=4096, dtype="bf16"), {"m": 512}
    with gated_on_the_bench_inputs(device, shape, run, seed=5) as (bench, subject):
        buffers = bench.timing_buffers()
        assert all(subject.bound.buffers[k] is buffers[k] for k in ("x", "w"))
        peers, missing = make_peers(OP, shape, run, subject.bound.inputs, None, check=bench.check_tensor,
                                    device_inputs={k: b.ptr for k, b in buffers.items()})
        assert {p.name for p in peers} >= {"torch"} and not any("gate" in why for why in missing.values()), missing
        x = on_gpu(buffers["x"].ptr, bench.timing_inputs()["x"].shape, OP.output_dtypes(shape)["y"])
        assert x.dtype == torch.bfloat16 and x.data_ptr() == buffers["x"].ptr
        assert np.array_equal(x.view(torch.int16).cpu().numpy().view(np.uint16), bench.timing_inputs()["x"])
        subject.close()
        assert bench.inputs_changed() == []  # still the bench's, intact, after the subject freed its own
        x[0, 0] = x[0, 0] + 1
        assert bench.inputs_changed() == ["x"]


def test_the_triton_peer_writes_the_kernels_own_outputs(device):
    """Handed a kernel's outputs (make_peers' device_outputs, as bench/norms.py hands them), Triton's kernel
    writes y and residual_out there, inside the fences, and is gated there."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("triton")
    from mage_gen.peers import make_peers

    shape, run = OP.shape(d=4096, dtype="bf16", residual=True), {"m": 512}
    with gated_on_the_bench_inputs(device, shape, run, seed=7) as (bench, subject):
        buffers = bench.timing_buffers()
        peers, missing = make_peers(OP, shape, run, subject.bound.inputs, None, check=bench.check_tensor,
                                    device_inputs={k: b.ptr for k, b in buffers.items()},
                                    device_outputs=subject.bound.output_pointers())
        triton_peer = next((p for p in peers if p.name == "triton"), None)
        assert triton_peer is not None, missing
        assert triton_peer.config["outputs"] == "the kernel's own, shared"
        subject.bound.poison(bench.stream)
        bench.stream.synchronize()
        assert bench.timing_reference().compare(subject.bound, bench.stream)[1]  # poisoned: the check can fail
        triton_peer.run()
        torch.cuda.synchronize()
        _, reason = bench.timing_reference().compare(subject.bound, bench.stream)
        assert reason == "", reason


def test_each_placement_holds_the_inputs_elsewhere_and_one_set_of_outputs_for_all_timed_there(device):
    """bench/norms.py and the tuner's final round time every subject at several placements: a later placement's
    inputs are a copy at other addresses, checked for writes like the timing buffers; every kernel checked there
    writes the placement's one set of fenced outputs, and so does the Triton peer given them."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("triton")
    import numpy as np

    from mage_gen.peers import make_peers, on_gpu

    shape, run = OP.shape(d=4096, dtype="bf16", residual=True), {"m": 512}
    bench = Bench(OP, shape, run, seed=11)
    variants = [build(OP, shape, OP.params_from_dict({"template": "row", "threads": t, "vector": 16}), device.arch)
                for t in (128, 256)]
    kernels = [bench.load(v) for v in variants]
    subjects = []
    try:
        first, checked = bench.checked_subject(variants[0], kernels[0], placement=0)
        assert first is not None, checked.reason
        subjects.append(first)
        place = bench.placement(1)
        for v, k in zip(variants, kernels):
            subject, err, reason = bench.checked_at(v, k, placement=1)
            assert subject is not None and reason == "", reason
            subjects.append(subject)
        zero = bench.timing_buffers()
        assert first.bound.buffers["x"] is zero["x"]
        assert place.inputs["x"].ptr != zero["x"].ptr
        assert all(s.bound.buffers[k] is place.inputs[k] for s in subjects[1:] for k in ("x", "residual", "w"))
        assert all(s.bound.buffers[k] is place.outputs[k] for s in subjects[1:] for k in ("y", "residual_out"))
        assert first.bound.buffers["y"] is bench.placement(0).outputs["y"]
        peers, missing = make_peers(OP, shape, run, bench.timing_inputs(), None, check=bench.check_tensor,
                                    device_inputs=place.input_pointers(), device_outputs=place.output_pointers())
        triton_peer = next((p for p in peers if p.name == "triton"), None)
        assert triton_peer is not None, missing
        assert triton_peer.config["outputs"] == "the kernel's own, shared"
        assert bench.inputs_changed() == []
        x1 = on_gpu(place.inputs["x"].ptr, bench.timing_inputs()["x"].shape, OP.output_dtypes(shape)["y"])
        assert np.array_equal(x1.view(torch.int16).cpu().numpy().view(np.uint16), bench.timing_inputs()["x"])
        x1[3, 5] = x1[3, 5] + 1
        assert bench.inputs_changed() == ["x (placement 1)"]
    finally:
        for s in subjects:
            s.close()
        for k in kernels:
            k.unload()
        bench.free_placements()
