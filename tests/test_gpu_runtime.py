"""mage_gen.torch on the GPU: any d and M against float64 F.layer_norm, CUDA-graph capture, torch.compile
(fullgraph), refused arguments, and the tuned matmul shapes."""

import shutil
import warnings
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mage_gen.errors import LaunchError
from mage_gen.ops import get_op

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("torch sees no CUDA device", allow_module_level=True)

import mage_gen.torch as mt  # noqa: E402
from mage_gen.runtime import UntunedKernelWarning  # noqa: E402

LN, MM = get_op("layernorm"), get_op("matmul")


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float(torch.linalg.vector_norm(out.double() - ref) / torch.linalg.vector_norm(ref))


def inputs(m: int, d: int, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(m, d, device="cuda", generator=g) * 2 + 3  # an offset mean, as the gate draws
    return x, torch.randn(d, device="cuda", generator=g), torch.randn(d, device="cuda", generator=g)


def poisoned_layer_norm(x, w, b, eps=1e-5):
    # torch's caching allocator hands the freed NaN block back for the output: a row never written stays NaN
    torch.full_like(x, float("nan"))
    return mt.layer_norm(x, w, b, eps)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(d=st.integers(1, 16384), m=st.integers(1, 70000), seed=st.integers(0, 2**31 - 1))
def test_layer_norm_matches_float64_at_any_d_and_m(d, m, seed):
    if m * d > 1 << 28:  # keep one example under a gigabyte
        m = max(1, (1 << 28) // d)
    x, w, b = inputs(m, d, seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UntunedKernelWarning)
        y = poisoned_layer_norm(x, w, b)
    torch.cuda.synchronize()
    ref = torch.nn.functional.layer_norm(x.double(), (d,), w.double(), b.double(), 1e-5)
    assert not torch.isnan(y).any(), f"d={d} m={m}: NaN in the output"
    err = relative_error(y, ref)
    assert err <= LN.tolerance, f"d={d} m={m}: relative error {err:.3g}"


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(d=st.integers(1, 16384), m=st.integers(1, 70000), seed=st.integers(0, 2**31 - 1))
def test_rms_norm_matches_float64_at_any_d_and_m(d, m, seed):
    if m * d > 1 << 28:
        m = max(1, (1 << 28) // d)
    x, w, _ = inputs(m, d, seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UntunedKernelWarning)
        torch.full_like(x, float("nan"))
        y = mt.rms_norm(x, w, 1e-6)
    torch.cuda.synchronize()
    ref = torch.nn.functional.rms_norm(x.double(), (d,), w.double(), 1e-6)
    assert not torch.isnan(y).any(), f"d={d} m={m}: NaN in the output"
    err = relative_error(y, ref)
    assert err <= get_op("rmsnorm").tolerance, f"d={d} m={m}: relative error {err:.3g}"


def test_an_untuned_d_warns_once_and_still_computes():
    x, w, b = inputs(5, 1000 + 3, 1)
    with pytest.warns(UntunedKernelWarning, match="default config"):
        mt.layer_norm(x, w, b)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UntunedKernelWarning)
        y = mt.layer_norm(x, w, b)
    ref = torch.nn.functional.layer_norm(x.double(), (1003,), w.double(), b.double(), 1e-5)
    assert relative_error(y, ref) <= LN.tolerance


def test_inside_a_cuda_graph_replays_compute_fresh_inputs():
    x, w, b = inputs(4096, 768, 2)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        mt.layer_norm(x, w, b)  # load the kernel before capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = mt.layer_norm(x, w, b)
    for seed in (3, 4):
        fresh, _, _ = inputs(4096, 768, seed)
        x.copy_(fresh)
        y.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        ref = torch.nn.functional.layer_norm(x.double(), (768,), w.double(), b.double(), 1e-5)
        assert relative_error(y, ref) <= LN.tolerance


def test_torch_compile_fullgraph_runs_the_op_in_one_graph():
    from torch._dynamo.testing import CompileCounterWithBackend

    class Block(torch.nn.Module):
        def __init__(self, w, b):
            super().__init__()
            self.register_buffer("w", w)
            self.register_buffer("b", b)

        def forward(self, x):
            return mt.layer_norm(x * 2, self.w, self.b) + 1

    x, w, b = inputs(4096, 768, 5)
    counter = CompileCounterWithBackend("inductor")
    torch._dynamo.reset()
    compiled = torch.compile(Block(w, b), fullgraph=True, backend=counter)
    y = compiled(x)
    torch.cuda.synchronize()
    ref = torch.nn.functional.layer_norm(2 * x.double(), (768,), w.double(), b.double(), 1e-5) + 1
    assert relative_error(y, ref) <= LN.tolerance
    assert counter.frame_count == 1


def test_out_is_written_and_may_not_be_an_input():
    x, w, b = inputs(64, 768, 10)
    out = torch.full_like(x, float("nan"))
    assert mt.layer_norm(x, w, b, out=out) is out
    ref = torch.nn.functional.layer_norm(x.double(), (768,), w.double(), b.double(), 1e-5)
    assert relative_error(out, ref) <= LN.tolerance
    with pytest.raises(LaunchError, match="out overlaps an input"):
        mt.layer_norm(x, w, b, out=x)


def test_out_of_a_16_bit_norm_is_its_dtype_and_only_that():
    x = torch.randn(64, 4096, device="cuda").to(torch.bfloat16)
    w = torch.randn(4096, device="cuda").to(torch.bfloat16)
    out = torch.full_like(x, float("nan"))
    assert mt.rms_norm(x, w, out=out) is out
    assert torch.equal(out, mt.rms_norm(x, w))
    with pytest.raises(TypeError, match="out must be bfloat16, got torch.float32"):
        mt.rms_norm(x, w, out=torch.empty(64, 4096, device="cuda"))


def test_a_misaligned_view_is_refused_not_faulted():
    storage = torch.randn(4 * 768 + 1, device="cuda")
    x = storage[1:].view(4, 768)  # 4 bytes past an aligned start
    w, b = torch.ones(768, device="cuda"), torch.zeros(768, device="cuda")
    with pytest.raises(LaunchError, match="x at .* is not a device address aligned to"):
        mt.layer_norm(x, w, b)
    torch.cuda.synchronize()  # the context is still good
    y = mt.layer_norm(x.clone(), w, b)
    assert not torch.isnan(y).any()


def test_matmul_runs_a_tuned_shape_and_refuses_others(tmp_path, monkeypatch):
    # the H200's winners, stored for whichever GPU runs this, so that the test asks of the runtime the same on each
    from mage_gen.store import gpu_slug, store_file

    folder = tmp_path / gpu_slug(torch.cuda.get_device_name())
    folder.mkdir()
    shutil.copy(store_file("matmul", "NVIDIA H200", Path(__file__).parents[1] / "tuned"), folder / "matmul.json")
    monkeypatch.setenv("MAGE_GEN_TUNED", str(tmp_path))
    torch.backends.cuda.matmul.allow_tf32 = False
    g = torch.Generator(device="cuda").manual_seed(6)
    a = torch.randn(1024, 1024, device="cuda", generator=g)
    b = torch.randn(1024, 1024, device="cuda", generator=g)
    c = mt.matmul(a, b)
    assert relative_error(c, a.double() @ b.double()) <= MM.tolerance
    with pytest.raises(LaunchError, match="no tuned kernel"):
        mt.matmul(a[:512, :512].contiguous(), b[:512, :512].contiguous())


def test_raw_runtime_launches_on_a_stream_without_torch_wrappers():
    from mage_gen import runtime

    x, w, b = inputs(37, 768, 7)
    y = torch.full_like(x, float("nan"))
    stream = torch.cuda.Stream()
    runtime.layer_norm(y.data_ptr(), x.data_ptr(), w.data_ptr(), b.data_ptr(), 37, 768, 1e-5, stream.cuda_stream)
    stream.synchronize()
    ref = torch.nn.functional.layer_norm(x.double(), (768,), w.double(), b.double(), 1e-5)
    assert relative_error(y, ref) <= LN.tolerance
    assert np.isfinite(y.cpu().numpy()).all()


@pytest.mark.parametrize("element", ["float32", "bfloat16", "float16"])
def test_the_gpu_comparison_agrees_with_the_cpu_gate_and_fails_nan(element):
    from mage_gen import gpu
    from mage_gen.dtypes import dtype
    from mage_gen.measure import DeviceReference
    from mage_gen.verdict import compare_outputs

    kind = dtype(element)
    gpu.open_device()
    stream = gpu.Stream()
    rng = np.random.default_rng(8)
    exact = rng.standard_normal((300, 77))
    ref = kind.widen(kind.round(exact)).astype(np.float64)  # the reference rounded to the output's type
    out = kind.round(exact * (1 + 3e-6 * rng.standard_normal(exact.shape)))
    held = DeviceReference({"y": ref}, {"y": kind}, {"y": LN.tolerance_of(LN.shape(d=77), "y", kind)})
    buf = gpu.Buffer(out.nbytes)
    try:
        buf.upload(out)
        err, reason = held.compare_at({"y": buf.ptr}, stream)
        cpu_err, cpu_reason = compare_outputs(LN, LN.shape(d=77), {"y": out}, {"y": ref})
        assert not reason and not cpu_reason and abs(err - cpu_err) <= 1e-3 * cpu_err + 1e-12
        out[17, 3] = kind.round(np.array([np.nan]))[0]
        buf.upload(out)
        assert "1 NaN or infinite" in held.compare_at({"y": buf.ptr}, stream)[1]
        out[17, 3] = kind.round(np.array([ref[17, 3] + 100.0]))[0]  # past one bf16 ulp of the whole norm
        buf.upload(out)
        assert "relative error" in held.compare_at({"y": buf.ptr}, stream)[1]
    finally:
        buf.free()
        held.free()


def test_a_kernel_checked_at_a_dram_sized_run_sees_the_timing_inputs():
    # the timed-size check copies the timing inputs on the device first; a copy still in flight when the
    # kernel starts (an async copy on another stream) made good kernels fail here
    from mage_gen.measure import Bench
    from mage_gen.variants import build

    shape, run = LN.shape(d=4096), {"m": 32768}
    bench = Bench(LN, shape, run, seed=9)
    variant = build(LN, shape, LN.params_from_dict({"threads": 64, "vector": 16}), bench.device.arch)
    kernel = bench.load(variant)
    try:
        for _ in range(3):
            subject, checked = bench.checked_subject(variant, kernel)
            assert subject is not None, checked.reason
            subject.close()
    finally:
        kernel.unload()


@pytest.mark.parametrize("m", [16, 128, 512, 4096])
def test_raw_runtime_gemm_runs_a_stored_winner_against_torch(m):
    """runtime.gemm on torch's pointers at a shape tuned on the H200 (tuned/h200/gemm_sm90.json), bf16 C = A·Bᵀ:
    twice with new outputs and a new A (maps encoded for the new addresses, the weight's kept), then in a graph."""
    from mage_gen import gpu, runtime
    from mage_gen.dtypes import BFLOAT16

    if gpu.device_info(torch.cuda.current_device()).name != "NVIDIA H200":
        pytest.skip("the gemm_sm90 winners stored are the H200's")
    op = get_op("gemm_sm90")
    n = k = 4096
    tolerance = op.tolerance_of(op.shape(m=m, n=n, k=k), "C", BFLOAT16)
    g = torch.Generator(device="cuda").manual_seed(11)
    weight = torch.randn(n, k, device="cuda", generator=g).to(torch.bfloat16)

    def gemm(c, a):  # on torch's current stream: inside the graph block, the capturing one
        runtime.gemm(c.data_ptr(), a.data_ptr(), weight.data_ptr(), m, n, k, torch.cuda.current_stream().cuda_stream)

    for _ in range(2):
        a = torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16)
        c = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
        gemm(c, a)
        torch.cuda.synchronize()
        assert relative_error(c, a.double() @ weight.double().T) <= tolerance
        assert relative_error(c, (a @ weight.T).double()) <= tolerance  # torch's own bf16 matmul
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gemm(c, a)  # on the capture stream, torch's current one inside the block
    a.copy_(torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16))
    c.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert relative_error(c, a.double() @ weight.double().T) <= tolerance


GEMM = get_op("gemm_sm90")


def on_h200() -> None:
    from mage_gen import gpu

    if gpu.device_info(torch.cuda.current_device()).name != "NVIDIA H200":
        pytest.skip("the gemm_sm90 winners stored are the H200's")


def prepared_kernel(shape, params):
    """runtime.Prepared of these params at this shape, built for this GPU: a config run as the runtime runs a
    winner, whatever tuned/ holds."""
    from mage_gen import gpu, runtime
    from mage_gen.variants import build

    variant = build(GEMM, shape, params, gpu.device_info(0).arch)
    kernel = gpu.Kernel(variant.compiled.cubin, variant.source.kernel_name,
                        GEMM.geometry(shape, params, {}).dynamic_shared_bytes)
    return runtime.Prepared(GEMM, shape, params, {}, kernel, variant.census)


def bf16_inputs(lead: tuple[int, ...], n: int, k: int, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(*lead, k, device="cuda", generator=g).to(torch.bfloat16)
    weight = (torch.randn(n, k, device="cuda", generator=g) / k ** 0.5).to(torch.bfloat16)
    return x, weight, torch.randn(n, device="cuda", generator=g).to(torch.bfloat16)


def linear_tolerance(m: int, n: int, k: int, bias: bool) -> float:
    from mage_gen.dtypes import BFLOAT16

    # a unit roundoff of margin where a bias is added
    return GEMM.tolerance_of(GEMM.shape(m=m, n=n, k=k), "C", BFLOAT16) + (2 ** -8 if bias else 0)


@pytest.mark.parametrize("lead, with_bias", [((1,), False), ((16,), False), ((5, 8), True), ((128,), False),
                                             ((300,), True), ((512,), False), ((2, 1024), False), ((4096,), True)])
def test_linear_matches_float64_at_any_m_of_a_tuned_n_k(lead, with_bias):
    """N = K = 4096 is tuned at M = 16, 128, 512 and 4096: every other M runs the nearest class's params."""
    on_h200()
    n = k = 4096
    x, weight, bias = bf16_inputs(lead, n, k, sum(lead))
    torch.full((*lead, n), float("nan"), device="cuda", dtype=torch.bfloat16)  # the block y will reuse
    y = mt.linear(x, weight, bias if with_bias else None)
    torch.cuda.synchronize()
    ref = torch.nn.functional.linear(x.double(), weight.double(), bias.double() if with_bias else None)
    assert y.shape == (*lead, n) and y.dtype == torch.bfloat16
    assert not torch.isnan(y).any()
    m = x.numel() // k
    assert relative_error(y, ref) <= linear_tolerance(m, n, k, with_bias), f"M={m}"


def test_linear_runs_cublas_where_asked_only_at_an_m_whose_tune_saw_cublas_win():
    """N = K = 4096 at M = 16 and 128 (classes whose tunes cuBLAS and the kernel won, in tuned/h200): with the flag,
    exactly F.linear's bits where the serving entry's tune saw cuBLAS win, the kernel's elsewhere."""
    from mage_gen import dispatch, gpu, runtime

    on_h200()
    device = gpu.device_info(torch.cuda.current_device())
    for m in (16, 128):
        shape = GEMM.shape(m=m, n=4096, k=4096)
        cublas_won = dispatch.cublas_serves(GEMM, shape, runtime.choose(GEMM, shape, {}, device, True)[1])
        x, weight, bias = bf16_inputs((m,), 4096, 4096, 50 + m)
        kernel = mt.linear(x, weight, bias)
        routed = mt.linear(x, weight, bias, cublas_where_faster=True)
        expected = torch.nn.functional.linear(x, weight, bias) if cublas_won else kernel
        assert torch.equal(routed, expected), f"M={m}"


def test_linear_replays_in_a_cuda_graph_on_fresh_inputs():
    on_h200()
    x, weight, bias = bf16_inputs((200,), 4096, 4096, 21)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        mt.linear(x, weight, bias)  # compile and load before capture, as torch asks of any warm-up
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = mt.linear(x, weight, bias)
    for seed in (22, 23):
        x.copy_(bf16_inputs((200,), 4096, 4096, seed)[0])
        y.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        ref = torch.nn.functional.linear(x.double(), weight.double(), bias.double())
        assert relative_error(y, ref) <= linear_tolerance(200, 4096, 4096, True)


def test_linear_compiles_in_one_graph_with_inductor():
    from torch._dynamo.testing import CompileCounterWithBackend

    on_h200()

    class Mlp(torch.nn.Module):
        def __init__(self, up, down):
            super().__init__()
            self.register_buffer("up", up)
            self.register_buffer("down", down)

        def forward(self, x):
            return mt.linear(torch.relu(mt.linear(x * 2, self.up)), self.down) + 1

    x, up, _ = bf16_inputs((3, 40), 4096, 4096, 31)
    down = bf16_inputs((1,), 4096, 4096, 32)[1]
    counter = CompileCounterWithBackend("inductor")
    torch._dynamo.reset()
    y = torch.compile(Mlp(up, down), fullgraph=True, backend=counter)(x)
    torch.cuda.synchronize()
    hidden = torch.nn.functional.linear(2 * x.double(), up.double()).relu().to(torch.bfloat16)  # rounded as ours
    ref = torch.nn.functional.linear(hidden.double(), down.double()) + 1
    assert counter.frame_count == 1
    assert relative_error(y, ref) <= 2 * linear_tolerance(120, 4096, 4096, True)


def test_linear_refuses_bad_input_in_one_line_without_reaching_the_gpu(monkeypatch):
    from test_runtime import BAD_LINEAR  # the CPU test's table, here on real tensors

    monkeypatch.setattr(mt, "_prepare", lambda *args, **kw: pytest.fail("prepared a launch for bad input"))
    monkeypatch.setattr(mt, "_launch", lambda *args: pytest.fail("launched on bad input"))
    for make, message in BAD_LINEAR:
        x, weight, bias = make()
        for call in (lambda: mt.linear(x, weight, bias), lambda: torch.ops.mage_gen.linear(x, weight, bias)):
            with pytest.raises((LaunchError, TypeError), match="^mage_gen.torch.linear: " + message) as info:
                call()
            assert "\n" not in str(info.value)
    with pytest.raises(LaunchError, match="requires grad"):
        mt.linear(torch.ones(4, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True),
                  torch.ones(32, 64, device="cuda", dtype=torch.bfloat16))


def test_an_untuned_n_k_and_a_misaligned_x_are_refused_in_one_line():
    on_h200()
    x, weight, _ = bf16_inputs((16,), 1024, 4096, 41)
    with pytest.raises(LaunchError, match=r"^gemm_sm90: nothing is tuned for n=1024, k=4096 at any M on NVIDIA H200; tune it") as info:
        mt.linear(x, weight)
    assert "\n" not in str(info.value)
    x, weight, _ = bf16_inputs((16 * 4096 + 8,), 4096, 1, 42)
    shifted = x.view(-1)[4:4 + 16 * 4096].view(16, 4096)  # contiguous, 8 bytes past a 16-byte boundary
    with pytest.raises(LaunchError, match="^mage_gen.torch.linear: x starts at 0x[0-9a-f]+, not on 16 bytes"):
        mt.linear(shifted, bf16_inputs((1,), 4096, 4096, 43)[1])


def test_a_split_k_kernel_from_the_runtime_computes_on_two_streams_and_in_a_graph():
    """The runtime's working buffers: a workspace and counters per stream (cleared on its first launch, left zero by
    each), and a graph's own, cleared when it is captured: the graph holds the kernel alone, no memset to run before
    every replay."""
    from cuda.bindings import driver as cu

    from mage_gen import gpu

    on_h200()
    m, n, k = 40, 4096, 4096
    shape = GEMM.shape(m=m, n=n, k=k)
    params = GEMM.params_from_dict({"bm": 64, "bn": 128, "consumers": 1, "stages": 8, "split_k": 4, "grid": 132})
    prepared = prepared_kernel(shape, params)
    x, weight, _ = bf16_inputs((m,), n, k, 51)
    ref = torch.nn.functional.linear(x.double(), weight.double())
    tolerance = linear_tolerance(m, n, k, False)
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    outs = [torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16) for _ in range(4)]
    for i, out in enumerate(outs):  # two launches on each stream, the streams running at once
        stream = streams[i % 2]
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            prepared.launch((out.data_ptr(), x.data_ptr(), weight.data_ptr()), stream.cuda_stream)
    torch.cuda.synchronize()
    for out in outs:
        assert relative_error(out, ref) <= tolerance
    graph = torch.cuda.CUDAGraph()
    y = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    with torch.cuda.graph(graph):
        prepared.launch((y.data_ptr(), x.data_ptr(), weight.data_ptr()), torch.cuda.current_stream().cuda_stream)
    for seed in (52, 53):
        x.copy_(bf16_inputs((m,), n, k, seed)[0])
        y.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert relative_error(y, torch.nn.functional.linear(x.double(), weight.double())) <= tolerance
    # a graph captured on a stream of the driver's: one node, the kernel
    stream = gpu.Stream()
    own = stream.capture(lambda handle: prepared.launch((y.data_ptr(), x.data_ptr(), weight.data_ptr()), int(handle)))
    try:
        _, count = gpu.check(cu.cuGraphGetNodes(own.graph, 0), "cuGraphGetNodes")
        assert count == 1
        x.copy_(bf16_inputs((m,), n, k, 54)[0])
        y.fill_(float("nan"))
        torch.cuda.synchronize()
        for _ in range(2):  # the second replay reads the counters the first left zero
            own.launch(stream)
        stream.synchronize()
        assert relative_error(y, torch.nn.functional.linear(x.double(), weight.double())) <= tolerance
    finally:
        own.destroy()
        stream.destroy()


def test_a_patched_layer_compiled_by_inductor_matches_float32_and_fuses_its_add_and_where_the_kernel_serves_it_its_gate():
    import copy

    import torch._inductor.config as inductor

    from bench.decoder_layer import TOLERANCE, LlamaLayer, inputs
    from mage_gen.patch import Fusions

    on_h200()
    torch.manual_seed(0)
    # qkv and o are tuned, and so gate_up (6144×4096: 3072 rows each of gate and up, qkv's weight shape, whose plain
    # entries serve the gated product); down (4096×3072) is not
    reference = LlamaLayer(hidden=3072).cuda().eval()
    layer = copy.deepcopy(reference).to(torch.bfloat16)
    routes = mt.patch(layer)
    assert routes.linear == ["qkv", "o", "gate_up"] and routes.norm == ["input_norm", "post_norm"]
    assert set(routes.left) == {"down"}
    # the gate is fused where its serving entry timed the kernel faster (2048 tokens: the class tuned there), and left
    # to Inductor where cuBLAS serves it (256 tokens: the classes at 128 and 512 timed cuBLAS faster)
    serves = {tokens: mt.serves_cublas(0, tokens, 6144, 4096, gate="silu") for tokens in (2048, 256)}
    assert serves == {2048: False, 256: True}
    for tokens in serves:
        seen = []
        # set and put back by hand: after monkeypatch's undo, Inductor's config module reports the attribute as missing
        # to every later compile
        was = inductor.post_grad_custom_pre_pass
        inductor.post_grad_custom_pre_pass = Fusions(then=lambda graph: seen.extend((n.target, n.args)
                                                                                    for n in graph.nodes))
        args = inputs(4096, 128, tokens, torch.bfloat16)
        torch._dynamo.reset()
        try:
            with torch.inference_mode():
                y = torch.compile(layer)(*args)
                ref = reference(*(a.float() for a in args))
        finally:
            inductor.post_grad_custom_pre_pass = was
        targets = [target for target, _ in seen]
        assert torch.ops.mage_gen.rms_norm_residual.default in targets
        gated = [a for target, a in seen if target is torch.ops.mage_gen.linear.default and "silu" in a]
        # gate_up's product, split in halves into silu(gate) · up
        assert len(gated) == (0 if serves[tokens] else 1), tokens
        assert relative_error(y, ref) <= TOLERANCE, tokens


def test_a_hugging_face_mlp_patched_runs_one_gated_kernel_and_matches_float32():
    """A Llama MLP of the Hugging Face kind (gate_proj, up_proj, down_proj, SiLU): patch joins gate and up into one
    weight (6144×4096, qkv's shape, whose plain entries serve the gated product), eagerly and under torch.compile."""
    import copy

    from bench.decoder_layer import TOLERANCE
    from mage_gen.patch import GatedMLP

    class LlamaMLP(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.gate_proj, self.up_proj = (torch.nn.Linear(4096, 3072, bias=False) for _ in range(2))
            self.down_proj = torch.nn.Linear(3072, 4096, bias=False)
            self.act_fn = torch.nn.SiLU()

        def forward(self, x):
            return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))

    on_h200()
    torch.manual_seed(0)
    reference = LlamaMLP().cuda().eval()
    model = torch.nn.Sequential(copy.deepcopy(reference).to(torch.bfloat16))
    routes = mt.patch(model)
    assert isinstance(model[0], GatedMLP) and routes.gated == ["0"]
    x = torch.randn(300, 4096, device="cuda")
    with torch.inference_mode():
        ref = reference(x)
        eager = model(x.to(torch.bfloat16))
        torch._dynamo.reset()
        compiled = torch.compile(model, fullgraph=True)(x.to(torch.bfloat16))
    assert relative_error(eager, ref) <= TOLERANCE and relative_error(compiled, ref) <= TOLERANCE


def test_a_gated_linear_matches_float64_in_a_graph_and_under_compile():
    """linear(x, gate_up, gate="silu"): silu(x·W_gateᵀ) ⊙ x·W_upᵀ from one kernel, the params of the plain entry of
    the same weight (6144×4096), at M on both sides of a class, eagerly (with a residual added in the kernel too), in
    a CUDA graph and under torch.compile."""
    from mage_gen.dtypes import BFLOAT16

    on_h200()
    n, k = 6144, 4096
    g = torch.Generator(device="cuda").manual_seed(71)
    weight = (torch.randn(n, k, device="cuda", generator=g) / k ** 0.5).to(torch.bfloat16)
    for m in (16, 200, 2048):
        x = torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16)
        product = x.double() @ weight.double().T
        ref = torch.nn.functional.silu(product[:, :n // 2]) * product[:, n // 2:]
        tolerance = GEMM.tolerance_of(GEMM.shape(m=m, n=n, k=k, gate="silu"), "C", BFLOAT16)
        assert relative_error(mt.linear(x, weight, gate="silu"), ref) <= tolerance, m
        r = torch.randn(m, n // 2, device="cuda", generator=g).to(torch.bfloat16)
        summed = GEMM.tolerance_of(GEMM.shape(m=m, n=n, k=k, gate="silu", residual=True), "C", BFLOAT16)
        assert relative_error(mt.linear(x, weight, gate="silu", residual=r), ref + r.double()) <= summed, m
        y = torch.empty(m, n // 2, device="cuda", dtype=torch.bfloat16)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y.copy_(mt.linear(x, weight, gate="silu"))
        y.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert relative_error(y, ref) <= tolerance, m
    torch._dynamo.reset()
    compiled = torch.compile(lambda x: mt.linear(x, weight, gate="silu"), fullgraph=True)
    assert relative_error(compiled(x), ref) <= tolerance


def test_an_e4m3_kernel_from_the_runtime_matches_float64_and_torch_scaled_mm():
    """fp8 with per-tensor scales through runtime.Prepared (no e4m3 class is tuned yet): against the dequantized
    product in float64 within the op's tolerance, and against torch._scaled_mm."""
    from mage_gen.dtypes import BFLOAT16

    on_h200()
    m, n, k = 100, 4096, 4096
    shape = GEMM.shape(m=m, n=n, k=k, precision="e4m3")
    for values in ({"bm": 64, "bn": 128, "consumers": 1, "stages": 8, "grid": 132},
                   {"bm": 64, "bn": 128, "consumers": 1, "stages": 8, "split_k": 2, "grid": 132},
                   {"bm": 128, "bn": 32, "consumers": 2, "schedule": "pingpong", "swap": True, "grid": 132}):
        params = GEMM.params_from_dict(values)
        prepared = prepared_kernel(shape, params)
        g = torch.Generator(device="cuda").manual_seed(61)
        x = (8 * torch.randn(m, k, device="cuda", generator=g)).to(torch.float8_e4m3fn)
        w = (8 * torch.randn(n, k, device="cuda", generator=g)).to(torch.float8_e4m3fn)
        sx, sw = torch.tensor([0.75], device="cuda"), torch.tensor([1.5], device="cuda")
        y = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
        prepared.launch((y.data_ptr(), x.data_ptr(), w.data_ptr(), sx.data_ptr(), sw.data_ptr()),
                        torch.cuda.current_stream().cuda_stream)
        torch.cuda.synchronize()
        ref = (x.double() @ w.double().T) * 0.75 * 1.5
        tolerance = GEMM.tolerance_of(shape, "C", BFLOAT16)
        assert relative_error(y, ref) <= tolerance, params.label()
        theirs = torch._scaled_mm(x, w.t(), sx.reshape(()), sw.reshape(()), out_dtype=torch.bfloat16)
        assert relative_error(y, theirs.double()) <= 2 * tolerance, params.label()


def test_an_e4m3_block_scaled_kernel_from_the_runtime_matches_float64():
    """DeepGEMM's scales (A per row and 128 of K, B per 128×128 block) through runtime.Prepared, against the
    dequantized product in float64 within the op's tolerance."""
    from mage_gen.dtypes import BFLOAT16

    on_h200()
    m, n, k = 200, 1024, 4096
    shape = GEMM.shape(m=m, n=n, k=k, precision="e4m3_block")
    params = GEMM.params_from_dict({"bm": 64, "bn": 128, "consumers": 1, "stages": 6, "inflight": 0, "grid": 132})
    prepared = prepared_kernel(shape, params)
    g = torch.Generator(device="cuda").manual_seed(71)
    x = (8 * torch.randn(m, k, device="cuda", generator=g)).to(torch.float8_e4m3fn)
    w = (8 * torch.randn(n, k, device="cuda", generator=g)).to(torch.float8_e4m3fn)
    sx = torch.rand(m, k // 128, device="cuda", generator=g) + 0.5
    sw = torch.rand(n // 128, k // 128, device="cuda", generator=g) + 0.5
    y = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
    prepared.launch((y.data_ptr(), x.data_ptr(), w.data_ptr(), sx.data_ptr(), sw.data_ptr()),
                    torch.cuda.current_stream().cuda_stream)
    torch.cuda.synchronize()
    xs = x.double().view(m, k // 128, 128) * sx.double()[:, :, None]
    ws = w.double().view(n // 128, 128, k // 128, 128) * sw.double()[:, None, :, None]
    ref = xs.reshape(m, k) @ ws.reshape(n, k).T
    assert relative_error(y, ref) <= GEMM.tolerance_of(shape, "C", BFLOAT16)
