"""On the GPU: the Hopper GEMM. Every stored winner, and drawn configs, match the float64 reference at tails
(M, N, K ≡ 1 mod 8, K not a multiple of 64), split K too, the same bits every launch, with its counters left zero;
swapped operands and fp8 (per-tensor and block scales) match it at tails too, and so does a Hilbert order whose table
is in global memory; the gate rejects a wrong swizzle and a wrong stride byte offset; a wait on the wrong phase is
reported as a hang and the next trial runs; a C++ program built from the emitted .h and .cubin alone computes C.
Skipped without a CUDA driver."""

import dataclasses
import functools
import random
import shutil
import subprocess

import pytest
from hypothesis import HealthCheck, given, reject, settings
from hypothesis import strategies as st

from mage_gen.emit import emit
from mage_gen.errors import NoGpuError, StoreError
from mage_gen.ops import get_op
from mage_gen.space import draw, load_space
from mage_gen.store import load_winners
from mage_gen.variants import build
from mage_gen.worker import IsolatedBackend, gpu_backend

from drawn import gate_on_gpu  # tests/drawn.py

pytestmark = pytest.mark.gpu
OP = get_op("gemm_sm90")
TAILS = [(1025, 1033, 1041), (1033, 1032, 1000), (3073, 4104, 521)]


def stored_winners(device):
    """(shape, params) of every gemm_sm90 entry tuned on this GPU."""
    from mage_gen.store import tuned_shapes

    winners = []
    for shape in tuned_shapes(OP, device.name):
        try:
            winners += [(shape, w.params) for w in load_winners(OP, shape, device.name)]
        except StoreError:
            continue
    return winners


@pytest.mark.parametrize("m, n, k", TAILS)
def test_every_stored_winner_passes_the_gate_at_tails(device, stream, m, n, k):
    winners = stored_winners(device)
    if not winners:
        pytest.skip(f"no gemm_sm90 winner is tuned for {device.name}")
    for tuned, params in winners:
        shape = dataclasses.replace(tuned, m=m, n=n, k=k)  # its own types and layout
        result = gate_on_gpu(OP, device, stream, shape, params)
        assert result.passed, f"{params.label()} (tuned at {tuned}) at {shape}: {result.reason}"


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_drawn_configs_match_the_float64_reference(device, stream, data):
    dims = st.one_of(st.integers(1, 700), st.sampled_from([64, 128, 256, 1000]))
    shape = OP.shape(m=data.draw(dims, label="m"), n=data.draw(dims, label="n"), k=data.draw(dims, label="k"),
                     c_dtype=data.draw(st.sampled_from(["bf16", "fp32"]), label="c_dtype"),
                     b_layout=data.draw(st.sampled_from(["nk", "kn"]), label="b_layout"))
    params = draw(OP, shape, load_space(OP, "full", shape, sms=device.sms),
                  random.Random(data.draw(st.integers(0, 2**32 - 1), label="params seed")))
    if params is None:
        reject()
    result = gate_on_gpu(OP, device, stream, shape, params, seed=data.draw(st.integers(0, 2**32 - 1), label="seed"))
    assert result.passed, f"{params.label()} at {shape}: {result.reason}"


CLUSTERED = [{"cluster": 2}, {"cluster": 2, "multicast": "a"}, {"cluster": 2, "epilogue": "tma"},
             {"cluster": 2, "multicast": "a", "schedule": "pingpong", "epilogue": "tma"}]


@pytest.mark.parametrize("values", CLUSTERED, ids=lambda v: ",".join(f"{k}={x}" for k, x in v.items()))
@pytest.mark.parametrize("m, n, k", TAILS)
def test_a_cluster_of_two_launched_with_its_cluster_attribute_passes_the_gate(device, stream, values, m, n, k):
    """No cluster shape is compiled in: gpu.Kernel.launch gives it (cuLaunchKernelEx) from the op's Launch."""
    params = OP.params_from_dict({"bm": 128, "bn": 128, "grid": device.sms, **values})
    shape = OP.shape(m=m, n=n, k=k)
    assert OP.geometry(shape, params, {}).cluster == (2, 1, 1)
    assert "__cluster_dims__" not in build(OP, shape, params, device.arch).source.text
    result = gate_on_gpu(OP, device, stream, shape, params)
    assert result.passed, f"{params.label()} at {shape}: {result.reason}"


def test_a_cluster_is_timed_through_a_captured_graph_and_the_driver_sizes_its_clusters(device):
    """The hot timing replays a CUDA graph captured from cuLaunchKernelEx launches; the occupancy query is given
    the cluster shape as a launch gives it."""
    from mage_gen import gpu
    from mage_gen.measure import Bench

    shape = OP.shape(m=4096, n=4096, k=4096)
    params = OP.params_from_dict({"bm": 128, "bn": 256, "stages": 3, "grid": device.sms, "cluster": 2})
    variant = build(OP, shape, params, device.arch)
    bench = Bench(OP, shape, {}, seed=1)
    launch = OP.geometry(shape, params, {})
    kernel = bench.load(variant)
    try:
        clusters = gpu.max_active_clusters(kernel, launch.block, launch.dynamic_shared_bytes, 2)
    finally:
        kernel.unload()
    assert 0 < clusters <= device.sms // 2
    evaluation = bench.evaluate(variant, hot_replays=3, cold_count=3)
    assert evaluation.gate.passed, evaluation.gate.reason
    assert evaluation.hot is not None and evaluation.hot.median_us > 0


SPLIT = [{"bm": 64, "bn": 64, "consumers": 1, "split_k": 2}, {"bm": 64, "bn": 64, "consumers": 1, "split_k": 3,
                                                                "epilogue": "tma"},
         {"bm": 128, "bn": 128, "split_k": 4}, {"bm": 128, "bn": 128, "split_k": 2, "schedule": "pingpong"},
         {"bm": 128, "bn": 128, "split_k": 2, "cluster": 2}]
# the unit with a tile's last ticket sums it, waiting on the others' count of stored partials
TICKET = [{"bm": 64, "bn": 64, "consumers": 1, "split_k": 3, "split_sum": "ticket"},
          {"bm": 128, "bn": 128, "split_k": 4, "split_sum": "ticket", "epilogue": "tma"}]


def test_a_hilbert_order_past_constant_memory_passes_the_gate_from_its_table_in_global_memory(device, stream):
    # 64×64 tiles over 8193 × 8200: 129 × 129 = 16641 tiles, past the 16384 that constant memory holds
    shape = OP.shape(m=8193, n=8200, k=72)
    params = OP.params_from_dict({"bm": 64, "bn": 64, "consumers": 1, "order": "hilbert"})
    assert "__device__ const unsigned tile_order[16641]" in OP.source(shape, params).text
    result = gate_on_gpu(OP, device, stream, shape, params)
    assert result.passed, result.reason


@pytest.mark.parametrize("values", SPLIT + TICKET, ids=lambda v: ",".join(f"{k}={x}" for k, x in v.items()))
@pytest.mark.parametrize("m, n, k", [*TAILS, (16, 4096, 4096)])
def test_split_k_passes_the_gate_and_leaves_its_counters_zero(device, stream, values, m, n, k):
    """measure.Bound gives the workspace (NaN) and the counters (zero), and the gate fails a launch that leaves a
    counter other than zero."""
    params = OP.params_from_dict({"grid": device.sms, **values})
    result = gate_on_gpu(OP, device, stream, OP.shape(m=m, n=n, k=k), params)
    assert result.passed, f"{params.label()} at {m}x{n}x{k}: {result.reason}"


@pytest.mark.parametrize("values", SPLIT[:3] + TICKET, ids=lambda v: ",".join(f"{k}={x}" for k, x in v.items()))
def test_split_k_writes_the_same_bits_every_launch(device, stream, values):
    """Whichever unit of a tile finishes last sums the partials in slice order: ten launches on one set of random
    inputs, the counters left by each for the next, give one result bit for bit."""
    import numpy as np

    from mage_gen import gpu
    from mage_gen.measure import Bound

    shape = OP.shape(m=1025, n=1033, k=4096, c_dtype="fp32")
    params = OP.params_from_dict({"grid": device.sms, **values})
    variant = build(OP, shape, params, device.arch)
    kernel = gpu.Kernel(variant.compiled.cubin, variant.source.kernel_name,
                        OP.geometry(shape, params, {}).dynamic_shared_bytes)
    bound = Bound(OP, shape, params, kernel, {}, OP.make_inputs(shape, {}, np.random.default_rng(5)))
    try:
        results = []
        for _ in range(10):
            bound.poison(stream)
            bound.enqueue(stream.handle)
            stream.synchronize()
            outputs, complaints = bound.outputs()
            assert not complaints, complaints
            results.append(outputs["C"].view(np.uint32).copy())
        assert all(np.array_equal(results[0], r) for r in results[1:])
    finally:
        bound.free()
        kernel.unload()


def test_the_gate_fails_a_split_k_kernel_that_does_not_reset_its_counters(device, stream):
    shape = OP.shape(m=1025, n=1033, k=1041)
    params = OP.params_from_dict({"bm": 64, "bn": 64, "consumers": 1, "split_k": 2, "grid": device.sms,
                                  "plant": "split_reset"})
    result = gate_on_gpu(OP, device, stream, shape, params)
    assert not result.passed and "words of counters not zero" in result.reason, result.reason


def test_split_k_at_m_16_is_timed_through_a_captured_graph(device):
    """Hot replays launch back to back on the counters each launch leaves zero."""
    from mage_gen.measure import Bench

    shape = OP.shape(m=16, n=4096, k=4096)
    params = OP.params_from_dict({"bm": 64, "bn": 64, "consumers": 1, "stages": 6, "epilogue": "tma",
                                  "grid": device.sms, "split_k": 2})
    evaluation = Bench(OP, shape, {}, seed=1).evaluate(build(OP, shape, params, device.arch), hot_replays=5,
                                                      cold_count=5)
    assert evaluation.gate.passed, evaluation.gate.reason
    assert evaluation.hot is not None and evaluation.hot.median_us > 0


# Swapped operands, fp8 (per-tensor and block scales), chains, stream K and split K summed in a cluster: the gate's random
# inputs against float64 within the tolerance e4m3's precision and K give (ops/gemm_sm90.py tolerance_of), at each tail
# shape
SWAPPED_AND_FP8 = [("bf16", {"bm": 64, "bn": 16, "consumers": 1, "swap": True}),
                   ("bf16", {"bm": 64, "bn": 32, "consumers": 1, "swap": True, "split_k": 2}),
                   ("bf16", {"bm": 128, "bn": 16, "schedule": "pingpong", "swap": True}),
                   ("e4m3", {}),
                   ("e4m3", {"bm": 64, "bn": 32, "consumers": 1, "split_k": 2}),
                   ("e4m3", {"bm": 64, "bn": 16, "consumers": 1, "swap": True}),
                   ("e4m3", {"schedule": "pingpong", "epilogue": "tma"}),
                   ("e4m3_block", {"inflight": 0}),
                   ("e4m3_block", {"bm": 64, "bn": 128, "consumers": 1, "inflight": 0, "split_k": 2}),
                   # chains: a stage's wgmma steps dealt over several accumulator sets
                   ("bf16", {"bm": 64, "bn": 64, "consumers": 1, "stages": 8, "chains": 4}),
                   ("bf16", {"bm": 64, "bn": 16, "consumers": 1, "swap": True, "chains": 4, "split_k": 2}),
                   ("bf16", {"chains": 2, "epilogue": "tma"}),
                   ("e4m3", {"bm": 64, "bn": 128, "consumers": 1, "chains": 2, "split_k": 2}),
                   # stream K: every tile's K steps dealt over the grid, pieces summed in CTA order
                   ("bf16", {"stream_k": True}),
                   ("bf16", {"stream_k": True, "bn": 256, "stages": 3, "epilogue": "tma"}),
                   ("bf16", {"stream_k": True, "schedule": "pingpong", "epilogue": "tma"}),
                   ("bf16", {"stream_k": True, "bm": 64, "bn": 32, "consumers": 1, "swap": True, "stages": 8}),
                   ("e4m3", {"stream_k": True, "bm": 64, "bn": 128, "consumers": 1, "stages": 8}),
                   # split K summed in a cluster's distributed shared memory (a CTA a slice: grid 0)
                   ("bf16", {"bm": 64, "bn": 128, "consumers": 1, "stages": 8, "split_k": 4, "split_sum": "cluster",
                             "grid": 0}),
                   ("bf16", {"split_k": 2, "split_sum": "cluster", "epilogue": "tma", "grid": 0}),
                   ("bf16", {"bm": 64, "bn": 16, "consumers": 1, "swap": True, "split_k": 8, "split_sum": "cluster",
                             "grid": 0}),
                   ("e4m3", {"bm": 64, "bn": 128, "consumers": 1, "split_k": 2, "split_sum": "cluster", "grid": 0}),
                   # early copies: the producer passes the setup barrier by arriving (a probe's switch)
                   ("bf16", {"bm": 64, "bn": 128, "consumers": 1, "stages": 8, "split_k": 4, "grid": 0,
                             "early_copies": True}),
                   ("bf16", {"schedule": "pingpong", "epilogue": "tma", "early_copies": True})]


@pytest.mark.parametrize("precision, values", SWAPPED_AND_FP8,
                         ids=lambda v: v if isinstance(v, str) else ",".join(f"{k}={x}" for k, x in v.items()) or "-")
@pytest.mark.parametrize("m, n, k", TAILS)
def test_swapped_and_fp8_and_chained_products_match_the_float64_reference_at_tails(device, stream, precision, values, m, n, k):
    shape = OP.shape(m=m, n=n, k=k, precision=precision)
    params = OP.params_from_dict({"grid": device.sms, **values})
    OP.validate(shape, params)
    result = gate_on_gpu(OP, device, stream, shape, params)
    assert result.passed, f"{params.label()} at {shape}: {result.reason}"


# The epilogue's work (ops/gemm_sm90.py: gate silu pairs B's halves in each tile, C half as wide; a bias before the
# gate, a residual last). A gated N is the tail's N rounded up to even, or, for a TMA store, to a multiple of 16, so
# that C's rows of N/2 lie on 16 bytes.
EPILOGUES = [({"gate": "silu"}, {}), ({"gate": "silu"}, {"epilogue": "tma", "bn": 256}),
             ({"gate": "silu"}, {"schedule": "pingpong", "epilogue": "tma"}),
             ({"gate": "silu"}, {"bm": 64, "bn": 128, "consumers": 1, "split_k": 2, "stages": 8}),
             ({"gate": "silu"}, {"cluster": 2, "epilogue": "tma", "bn": 256, "stages": 3}),
             ({"gate": "silu"}, {"cluster": 2, "multicast": "a", "epilogue": "tma", "bn": 256, "stages": 3}),
             ({"gate": "silu", "precision": "e4m3"}, {"epilogue": "tma"}),
             ({"bias": True, "residual": True}, {"epilogue": "tma"}),
             ({"bias": True, "residual": True, "gate": "silu"}, {"epilogue": "tma", "bn": 256}),
             ({"bias": True, "residual": True}, {"bm": 64, "bn": 32, "consumers": 1, "swap": True, "split_k": 2})]


@pytest.mark.parametrize("fields, values", EPILOGUES, ids=lambda v: ",".join(f"{k}={x}" for k, x in v.items()) or "-")
@pytest.mark.parametrize("m, n, k", TAILS)
def test_an_epilogue_matches_the_float64_reference_at_tails(device, stream, fields, values, m, n, k):
    if "gate" in fields:
        n += -n % 16 if values.get("epilogue") == "tma" else n % 2
    shape = OP.shape(m=m, n=n, k=k, **fields)
    params = OP.params_from_dict({"grid": device.sms, **values})
    OP.validate(shape, params)
    result = gate_on_gpu(OP, device, stream, shape, params)
    assert result.passed, f"{params.label()} at {shape}: {result.reason}"


def test_a_large_reference_is_computed_on_the_gpu_and_agrees_with_numpy(device):
    import numpy as np

    from mage_gen.dtypes import BFLOAT16, E4M3
    from mage_gen.measure import product_on_gpu
    from mage_gen.ops.base import Stored

    rng = np.random.default_rng(3)
    a, b = rng.standard_normal((300, 500)), rng.standard_normal((700, 500))
    assert np.allclose(product_on_gpu(a, b.T), a @ b.T, rtol=1e-12, atol=1e-12)
    # operands in their storage, rows of a padded buffer and B transposed, widened on the GPU
    for dtype in (BFLOAT16, E4M3):
        held_a, held_b = (dtype.round(x.astype(np.float32)) for x in (a, b))
        stored_a, stored_b = Stored(held_a[:, :480], dtype), Stored(held_b[:, :480], dtype).T
        assert np.allclose(product_on_gpu(stored_a, stored_b), stored_a.float64() @ stored_b.float64(), rtol=1e-12,
                           atol=1e-12), dtype.name


# (shape fields, params): a plain product at a tail, fp8 with per-tensor and with block scales, every epilogue term
DRAWN_ON_THE_GPU = [({}, {}), ({"precision": "e4m3"}, {}), ({"precision": "e4m3_block"}, {"inflight": 0}),
                    ({"bias": True, "residual": True, "gate": "silu"}, {"epilogue": "tma", "bn": 256})]


@pytest.mark.parametrize("fields, values", DRAWN_ON_THE_GPU,
                         ids=lambda v: ",".join(f"{k}={x}" for k, x in v.items()) or "-")
def test_a_case_drawn_on_the_gpu_is_the_host_reference_of_its_inputs_and_gates_as_the_host_does(
        device, stream, fields, values):
    import numpy as np

    from mage_gen.device_cases import gemm_sm90_case
    from mage_gen.measure import DeviceCases

    shape = OP.shape(m=1025, n=1040 if "gate" in fields else 1033, k=1041, **fields)
    drawn, reference = gemm_sm90_case(shape, {}, seed=11)
    host = OP.make_inputs(shape, {}, np.random.default_rng(11))
    inputs = {name: t.cpu().numpy().view(host[name].dtype) for name, t in drawn.items()}
    expected = OP.reference(shape, inputs, OP.scalars(shape, {}))["C"]
    assert np.allclose(reference["C"].cpu().numpy(), expected, rtol=1e-12, atol=1e-12 * np.abs(expected).max())

    params = OP.params_from_dict({"grid": device.sms, **values})
    cases = DeviceCases(OP, shape, np.random.default_rng(0))
    assert gate_on_gpu(OP, device, stream, shape, params, cases=cases).passed
    wrong = gate_on_gpu(OP, device, stream, shape, dataclasses.replace(params, plant="swizzle"), cases=cases)
    assert not wrong.passed and "relative error" in wrong.reason, wrong.reason


def test_the_gate_on_cases_drawn_on_the_gpu_fails_a_split_k_kernel_that_does_not_reset_its_counters(device, stream):
    import numpy as np

    from mage_gen.measure import DeviceCases

    shape = OP.shape(m=1025, n=1033, k=1041)
    cases = DeviceCases(OP, shape, np.random.default_rng(0))
    params = OP.params_from_dict({"bm": 64, "bn": 64, "consumers": 1, "split_k": 2, "grid": device.sms})
    assert gate_on_gpu(OP, device, stream, shape, params, cases=cases).passed
    result = gate_on_gpu(OP, device, stream, shape, dataclasses.replace(params, plant="split_reset"), cases=cases)
    assert not result.passed and "words of counters not zero" in result.reason, result.reason


@pytest.mark.parametrize("plant", ["swizzle", "sbo"])
def test_the_gate_rejects_a_wrong_descriptor(device, stream, plant):
    shape = OP.shape(m=1024, n=1032, k=1040)
    values = {"epilogue": "tma", "grid": device.sms}
    assert gate_on_gpu(OP, device, stream, shape, OP.params_from_dict(values)).passed
    result = gate_on_gpu(OP, device, stream, shape, OP.params_from_dict({**values, "plant": plant}))
    assert not result.passed and "relative error" in result.reason, result.reason


def test_a_missing_proxy_fence_is_refused_before_it_is_launched_and_the_next_trial_runs(device):
    """The H200 runs the kernel without the fence correctly (bench/NOTES.md, Hopper GEMM §3): the tuner's trial
    refuses it from its PTX, unlaunched, and goes on."""
    shape = OP.shape(m=1024, n=1032, k=1040)
    try:
        backend = gpu_backend(OP.name, shape, {}, 0)
    except NoGpuError as exc:
        pytest.skip(str(exc))
    values = {"epilogue": "tma", "grid": device.sms}
    bugged = backend.evaluate(build(OP, shape, OP.params_from_dict({**values, "plant": "proxy_fence"}), device.arch))
    assert not bugged.gate.passed and bugged.hot is None
    assert "no fence.proxy.async" in bugged.gate.reason and not bugged.gate.fault, bugged.gate.reason
    clean = backend.evaluate(build(OP, shape, OP.params_from_dict(values), device.arch))
    assert clean.gate.passed and clean.hot is not None, clean.gate.reason


def test_a_wait_on_the_wrong_phase_is_a_hang_and_the_next_trial_runs(device):
    shape = OP.shape(m=1024, n=1024, k=1024)
    try:
        worker = IsolatedBackend(functools.partial(gpu_backend, OP.name, shape, {}, 0), min_timeout_s=30.0)
    except NoGpuError as exc:
        pytest.skip(str(exc))
    try:
        clean = OP.params_from_dict({"watchdog_ms": 1000})
        hung = worker.evaluate(build(OP, shape, OP.params_from_dict({"watchdog_ms": 1000, "plant": "phase"}),
                                     worker.arch))
        assert not hung.gate.passed and "hang" in hung.gate.reason, hung.gate.reason
        after = worker.evaluate(build(OP, shape, clean, worker.arch))
        assert after.gate.passed, after.gate.reason
    finally:
        worker.close()


HOST_PROGRAM = r"""
#include <cmath>
#include <cstdio>
#include <cstring>
#include <vector>
#include "STEM.h"

// A, B: small whole numbers in bf16 (exact), rows LDA elements apart, NaN past K; C fp32: every sum is exact.
int main(int argc, char** argv)
{
    const int M = MM, N = NN, K = KK, LDA = LDAA;
    if (cuInit(0) != CUDA_SUCCESS) return 3;
    CUdevice device; CUcontext context; CUmodule module; CUfunction f;
    cuDeviceGet(&device, 0);
    cuDevicePrimaryCtxRetain(&context, device);
    cuCtxSetCurrent(context);
    if (cuModuleLoad(&module, argv[1]) != CUDA_SUCCESS) return 4;
    if (cuModuleGetFunction(&f, module, STEM_kernel_name) != CUDA_SUCCESS) return 5;
    std::vector<unsigned short> a((size_t)M * LDA, 0x7FC0), b((size_t)N * LDA, 0x7FC0);
    std::vector<float> av((size_t)M * K), bv((size_t)N * K), c((size_t)M * N);
    unsigned state = 12345;
    auto next = [&]() { state = state * 1664525u + 1013904223u; return (int)(state >> 29) - 3; };  // -3..4
    for (int i = 0; i < M; ++i) for (int j = 0; j < K; ++j) {
        float v = (float)next(); unsigned bits; std::memcpy(&bits, &v, 4);
        a[(size_t)i * LDA + j] = (unsigned short)(bits >> 16); av[(size_t)i * K + j] = v;
    }
    for (int i = 0; i < N; ++i) for (int j = 0; j < K; ++j) {
        float v = (float)next(); unsigned bits; std::memcpy(&bits, &v, 4);
        b[(size_t)i * LDA + j] = (unsigned short)(bits >> 16); bv[(size_t)i * K + j] = v;
    }
    CUdeviceptr da, db, dc;
    cuMemAlloc(&da, a.size() * 2); cuMemAlloc(&db, b.size() * 2); cuMemAlloc(&dc, c.size() * 4);
    cuMemcpyHtoD(da, a.data(), a.size() * 2); cuMemcpyHtoD(db, b.data(), b.size() * 2);
    cuMemsetD32(dc, 0x7FC00000, c.size());
    // a pointer off the alignment its stores need is refused, launching nothing
    if (STEM_launch(f, (float*)(dc + 2), (const unsigned short*)da, (const unsigned short*)db, 0) != CUDA_ERROR_INVALID_VALUE)
        return 6;
    if (STEM_launch(f, (float*)dc, (const unsigned short*)(da + 8), (const unsigned short*)db, 0) != CUDA_ERROR_INVALID_VALUE)
        return 6;
    CUresult launched = STEM_launch(f, (float*)dc, (const unsigned short*)da, (const unsigned short*)db, 0);
    if (launched != CUDA_SUCCESS || cuCtxSynchronize() != CUDA_SUCCESS) return 7;
    cuMemcpyDtoH(c.data(), dc, c.size() * 4);
    long wrong = 0;
    for (int i = 0; i < M; ++i) for (int j = 0; j < N; ++j) {
        double sum = 0;
        for (int k = 0; k < K; ++k) sum += (double)av[(size_t)i * K + k] * bv[(size_t)j * K + k];
        wrong += !(c[(size_t)i * N + j] == sum);
    }
    std::printf("%ld of %ld elements wrong\n", wrong, (long)M * N);
    return wrong ? 1 : 0;
}
"""


@pytest.mark.parametrize("epilogue, n, cluster", [("tma", 1032, 1), ("direct", 1033, 1), ("tma", 1032, 2)])
def test_a_cpp_program_from_the_emitted_header_and_cubin_alone_computes_c(device, tmp_path, epilogue, n, cluster):
    """cluster 2: the header launches with cuLaunchKernelEx and its cluster dimension attribute."""
    compiler = shutil.which("nvcc") or shutil.which("/usr/local/cuda/bin/nvcc")
    if compiler is None:
        pytest.skip("no nvcc to build the C++ program with")
    shape = OP.shape(m=1025, n=n, k=1041, c_dtype="fp32")
    params = OP.params_from_dict({"bn": 128, "stages": 4, "epilogue": epilogue, "grid": device.sms,
                                  "cluster": cluster})
    stem = "gemm"
    emit(OP, shape, params, device.arch, tmp_path, None, stem=stem)
    program = HOST_PROGRAM.replace("STEM", stem).replace("MM", str(shape.m)).replace("NN", str(shape.n)) \
        .replace("KK", str(shape.k)).replace("LDAA", str(shape.lda))
    (tmp_path / "main.cpp").write_text(program)
    built = subprocess.run([compiler, "-std=c++17", "-O1", "-o", str(tmp_path / "main"), str(tmp_path / "main.cpp"),
                            "-lcuda"], capture_output=True, text=True, cwd=tmp_path)
    assert built.returncode == 0, built.stderr
    ran = subprocess.run([str(tmp_path / "main"), str(tmp_path / f"{stem}.cubin")], capture_output=True, text=True,
                         timeout=120)
    assert ran.returncode == 0 and "0 of" in ran.stdout, (ran.returncode, ran.stdout, ran.stderr)
