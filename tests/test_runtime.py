"""The runtime and the PyTorch ops without a GPU: argument checks, default configs, alignment, the fake
implementation under torch.compile, and a CLI that starts without torch or Optuna."""

import subprocess
import sys

import pytest

from mage_gen import dispatch, runtime
from mage_gen.errors import LaunchError, NoGpuError
from mage_gen.ops import get_op
from mage_gen.variants import build

LN = get_op("layernorm")
torch = pytest.importorskip("torch")
FakeTensorMode = pytest.importorskip("torch._subclasses.fake_tensor").FakeTensorMode

import mage_gen.torch as mt  # noqa: E402


def test_a_default_config_exists_for_every_row_length_up_to_16384():
    # every d the GPU tests draw gets a kernel even where nothing is tuned
    for d in range(1, 16385):
        params = runtime._default_params(LN, LN.shape(d=d))
        LN.validate(LN.shape(d=d), params)


def test_misaligned_or_null_addresses_are_refused_before_a_launch():
    shape = LN.shape(d=768)
    alignments = {name: t["alignment_bytes"] for name, t in
                  LN.contract(shape, LN.params_from_dict({"vector": 16}))["tensors"].items()}
    assert alignments["x"] == 16
    good = {"y": 0x10000, "x": 0x20000, "w": 0x30000, "b": 0x40000}
    runtime.check_alignment("layernorm", alignments, good)
    with pytest.raises(LaunchError, match=r"x at 0x20004 is not a device address aligned to 16 bytes"):
        runtime.check_alignment("layernorm", alignments, {**good, "x": 0x20004})
    with pytest.raises(LaunchError, match="y at 0x0"):
        runtime.check_alignment("layernorm", alignments, {**good, "y": 0})


def test_a_gemm_whose_c_overlaps_a_or_b_is_refused_before_a_launch():
    a, b = 0x100000, 0x900000  # A: 16 rows of 4096 bf16 (128 KiB); B: 4096×4096 (32 MiB)
    with pytest.raises(LaunchError, match=r"^gemm_sm90: C \[0x110000, 0x130000\) overlaps A \[0x100000, 0x120000\)"):
        runtime.gemm(a + 0x10000, a, b, 16, 4096, 4096)
    with pytest.raises(LaunchError, match=r"overlaps B"):
        runtime.gemm(b + (1 << 20), a, b, 16, 4096, 4096)
    with pytest.raises(LaunchError, match=r"overlaps A"):  # K = 12: rows 32 bytes apart, the last one 24 bytes long
        runtime.gemm(a + 15 * 32 + 22, a, b, 16, 4096, 12)
    with pytest.raises(Exception) as info:  # right after A's last element: no overlap, so the launch is tried
        runtime.gemm(a + 15 * 32 + 24, a, b, 16, 4096, 12)
    assert "overlaps" not in str(info.value)


def test_an_e4m3_gemm_takes_its_two_scales_and_a_bf16_one_none_refused_before_a_launch():
    a, b, c = 0x100000, 0x900000, 0x4000000
    with pytest.raises(LaunchError, match=r"^gemm_sm90: scale_a at 0x0 is not a device address aligned to 4 bytes"):
        runtime.gemm(c, a, b, 16, 4096, 4096, precision="e4m3")
    with pytest.raises(LaunchError, match=r"^gemm_sm90: scale_a and scale_b multiply an e4m3 product; a bf16 one"):
        runtime.gemm(c, a, b, 16, 4096, 4096, scale_a=0x1000, scale_b=0x2000)
    with pytest.raises(LaunchError, match=r"^gemm_sm90: precision: an e4m3 wgmma reads both operands K-major"):
        runtime.gemm(c, a, b, 16, 4096, 4096, precision="e4m3", b_layout="kn", scale_a=0x1000, scale_b=0x2000)
    # A: 16 rows of 4096 e4m3 codes, 64 KiB; a C right after it does not overlap, one byte earlier does
    with pytest.raises(LaunchError, match=r"overlaps A \[0x100000, 0x110000\)"):
        runtime.gemm(a + 0x10000 - 2, a, b, 16, 4096, 4096, precision="e4m3", scale_a=0x1000, scale_b=0x2000)


def test_a_block_scaled_gemm_takes_its_scales_too():
    a, b, c = 0x100000, 0x900000, 0x4000000
    with pytest.raises(LaunchError, match=r"^gemm_sm90: scale_b at 0x0 is not a device address aligned to 4 bytes"):
        runtime.gemm(c, a, b, 16, 4096, 4096, precision="e4m3_block", scale_a=0x1000)


def test_without_a_driver_the_raw_runtime_says_a_gpu_is_needed():
    try:
        from mage_gen import gpu

        gpu.device_info(0)
    except NoGpuError:
        with pytest.raises(NoGpuError, match="needs an NVIDIA GPU"):
            runtime.layer_norm(0x10000, 0x20000, 0x30000, 0x40000, 4, 768)
    else:
        pytest.skip("a CUDA driver is present")


def fake(*shape, dtype=torch.float32, device="cuda"):
    return torch.empty(*shape, dtype=dtype, device=device)


@pytest.mark.parametrize("make, message", [
    (lambda: (fake(4, 768, dtype=torch.float64), fake(768), fake(768)),
     "x must be float32 or bfloat16 or float16, got torch.float64"),
    (lambda: (fake(4, 768, dtype=torch.bfloat16), fake(768, dtype=torch.float16), fake(768, dtype=torch.float16)),
     "weight must be bfloat16 or float32, got torch.float16"),
    (lambda: (fake(4, 768, dtype=torch.bfloat16), fake(768), fake(768, dtype=torch.bfloat16)),
     "bias must have weight's dtype torch.float32, got torch.bfloat16"),
    (lambda: (fake(4, 768, device="cpu"), fake(768, device="cpu"), fake(768, device="cpu")),
     "x must be on a CUDA device, got cpu"),
    (lambda: (fake(4, 768), fake(768, device="cpu"), fake(768)), "weight must be on a CUDA device"),
    (lambda: (fake(768, 4).t(), fake(768), fake(768)), "x must be contiguous"),
    (lambda: (fake(4, 768), fake(700), fake(768)), r"weight must have shape \(768,\)"),
    (lambda: (fake(4, 768), fake(768), fake(768, 1)), r"bias must have shape \(768,\)"),
    (lambda: (fake(0, 768), fake(768), fake(768)), "no rows to normalize"),
    (lambda: (fake(4, 0), fake(0), fake(0)), "no rows to normalize"),
    (lambda: (fake(4, 768), fake(768, dtype=torch.float64), fake(768)), "weight must be float32"),
])
def test_bad_arguments_name_the_argument(make, message):
    with FakeTensorMode():
        x, w, b = make()
        with pytest.raises((LaunchError, TypeError), match=message):
            mt.layer_norm(x, w, b)


@pytest.mark.parametrize("make, message", [
    (lambda: (fake(4, 768, dtype=torch.int32), fake(768)), "x must be float32 or bfloat16 or float16, got torch.int32"),
    (lambda: (fake(4, 768), fake(767)), r"weight must have shape \(768,\)"),
    (lambda: (fake(4, 768), fake(768, device="cpu")), "weight must be on a CUDA device"),
    (lambda: (fake(0, 768), fake(768)), r"x has shape \(0, 768\): no rows to normalize"),
])
def test_rms_norm_names_a_bad_argument(make, message):
    with FakeTensorMode():
        x, w = make()
        with pytest.raises((LaunchError, TypeError), match="^mage_gen.torch.rms_norm: " + message):
            mt.rms_norm(x, w)


@pytest.mark.parametrize("make, message", [
    (lambda: (fake(4, 768, dtype=torch.bfloat16), fake(4, 768), fake(768)),
     "residual must be bfloat16, got torch.float32"),
    (lambda: (fake(4, 768), fake(2, 768), fake(768)), r"residual must have x's shape \(4, 768\), got \(2, 768\)"),
    (lambda: (fake(4, 768), fake(768, 4).t(), fake(768)), "residual must be contiguous"),
])
def test_a_bad_residual_is_named(make, message):
    with FakeTensorMode():
        x, r, w = make()
        with pytest.raises((LaunchError, TypeError), match="^mage_gen.torch.rms_norm: " + message):
            mt.rms_norm(x, w, residual=r)


def test_the_residual_form_under_fake_tensors_gives_y_and_the_sum_in_xs_dtype():
    with FakeTensorMode():
        x, r, w, b = fake(3, 5, 768, dtype=torch.bfloat16), fake(3, 5, 768, dtype=torch.bfloat16), fake(768), fake(768)
        y, h = torch.ops.mage_gen.layer_norm_residual(x, r, w, b, 1e-5)
        assert y.shape == h.shape == x.shape and y.dtype == h.dtype == torch.bfloat16


def test_an_input_that_requires_grad_is_refused_not_silently_detached():
    # (a fake CUDA tensor cannot require grad without a CUDA build; the check comes first, so CPU shows it)
    x, w, b = torch.ones(4, 768, requires_grad=True), torch.ones(768), torch.zeros(768)
    with pytest.raises(LaunchError, match="x requires grad, and this op has no backward"):
        mt.layer_norm(x, w, b)
    with torch.no_grad(), pytest.raises(LaunchError, match="x must be on a CUDA device"):
        mt.layer_norm(x, w, b)


def test_out_must_match_x():
    with FakeTensorMode():
        with pytest.raises(LaunchError, match=r"out must have x's shape \(4, 768\), got \(4, 767\)"):
            mt.layer_norm(fake(4, 768), fake(768), fake(768), out=fake(4, 767))
        with pytest.raises(TypeError, match="out must be float32"):
            mt.layer_norm(fake(4, 768), fake(768), fake(768), out=fake(4, 768, dtype=torch.float64))


def test_matmul_arguments_are_checked():
    with FakeTensorMode():
        with pytest.raises(LaunchError, match=r"a must be \(M, K\) and b \(K, N\)"):
            mt.matmul(fake(8, 16), fake(8, 16))
        assert mt.matmul(fake(8, 16), fake(16, 32)).shape == (8, 32)


BF16 = torch.bfloat16


def bf16(*shape, device="cuda"):
    return fake(*shape, dtype=BF16, device=device)


# What F.linear would take but the Hopper kernel cannot, each refused in one line before anything reaches a GPU
# (the GPU tests run the same table on real tensors)
BAD_LINEAR = [
    (lambda: (fake(4, 64), bf16(32, 64), None), "x must be bfloat16 or float8_e4m3fn, got torch.float32"),
    (lambda: (bf16(4, 64), fake(32, 64, dtype=torch.float16), None), "weight must be bfloat16, got torch.float16"),
    (lambda: (bf16(4, 64), bf16(32, 64, device="cpu"), None), "weight must be on a CUDA device, got cpu"),
    (lambda: (bf16(4, 64), bf16(32, 48), None), r"x must be \(..., K\) and weight \(N, K\), got \(4, 64\) and \(32, 48\)"),
    (lambda: (bf16(4, 64), bf16(2, 32, 64), None), r"x must be \(..., K\) and weight \(N, K\)"),
    (lambda: (bf16(4, 60), bf16(32, 60), None), "K = 60 is not a multiple of 8"),
    (lambda: (bf16(4, 64), bf16(32, 64), bf16(33)), r"bias must have shape \(32,\)"),
    (lambda: (bf16(4, 64), bf16(32, 64), fake(32)), "bias must be bfloat16, got torch.float32"),
    (lambda: (bf16(64, 4).T, bf16(32, 64), None), "x must be contiguous"),
    (lambda: (bf16(4, 64), bf16(0, 64), None), r"weight \(0, 64\) is empty"),
    (lambda: (bf16(1 << 21, 8), bf16(32, 8), None), "m-range: m must be a whole number in 1..1048576"),
]


F8 = torch.float8_e4m3fn


def f8(*shape):
    return fake(*shape, dtype=F8)


def scale():
    return fake(1)


# fp8 x and weight: (x, weight, bias, scale_x, scale_weight)
BAD_FP8_LINEAR = [
    (lambda: (f8(4, 64), f8(32, 64), None, None, scale()), "an fp8 x and weight need scale_x and scale_weight"),
    (lambda: (f8(4, 64), bf16(32, 64), None, scale(), scale()), "weight must be float8_e4m3fn, got torch.bfloat16"),
    (lambda: (bf16(4, 64), bf16(32, 64), None, scale(), None), "scale_x scales an fp8 product; x is torch.bfloat16"),
    (lambda: (f8(4, 64), f8(32, 64), None, fake(2), scale()), r"scale_x is one float32 \(a per-tensor scale\)"),
    (lambda: (f8(4, 64), f8(32, 64), None, scale(), bf16(1)), "scale_weight must be float32, got torch.bfloat16"),
    (lambda: (f8(4, 40), f8(32, 40), None, scale(), scale()), "K = 40 is not a multiple of 16"),
]


@pytest.mark.parametrize("make, message", BAD_FP8_LINEAR)
def test_an_fp8_linear_refuses_what_the_kernel_cannot_take_in_one_line(make, message):
    with FakeTensorMode():
        x, weight, bias, scale_x, scale_weight = make()
        for call in (lambda: mt.linear(x, weight, bias, scale_x=scale_x, scale_weight=scale_weight),
                     lambda: torch.ops.mage_gen.linear(x, weight, bias, scale_x, scale_weight)):
            with pytest.raises((LaunchError, TypeError), match="^mage_gen.torch.linear: " + message) as info:
                call()
            assert "\n" not in str(info.value)


def test_an_fp8_linear_under_fake_tensors_gives_bf16():
    with FakeTensorMode():
        y = torch.ops.mage_gen.linear(f8(2, 3, 4096), f8(6144, 4096), None, scale(), scale())
        assert y.shape == (2, 3, 6144) and y.dtype == BF16


# the epilogue's arguments: (x, weight, gate, residual)
BAD_EPILOGUE_LINEAR = [
    (lambda: (bf16(4, 64), bf16(33, 64), "silu", None), "gate silu takes a weight of an even number of rows .*, got 33"),
    (lambda: (bf16(4, 64), bf16(32, 64), "gelu", None), r"gate is one of \('none', 'silu'\), got 'gelu'"),
    (lambda: (bf16(4, 64), bf16(32, 64), "silu", bf16(4, 32)), r"residual must have the result's shape \(4, 16\)"),
    (lambda: (bf16(2, 3, 64), bf16(32, 64), "none", bf16(6, 32)), r"residual must have the result's shape \(2, 3, 32\)"),
    (lambda: (bf16(4, 64), bf16(32, 64), "none", fake(4, 32)), "residual must be bfloat16, got torch.float32"),
    (lambda: (bf16(4, 64), bf16(32, 64), "none", bf16(32, 4).T), "residual must be contiguous"),
]


@pytest.mark.parametrize("make, message", BAD_EPILOGUE_LINEAR)
def test_a_linear_refuses_an_epilogue_the_kernel_cannot_take_in_one_line(make, message):
    with FakeTensorMode():
        x, weight, gate, residual = make()
        for call in (lambda: mt.linear(x, weight, gate=gate, residual=residual),
                     lambda: torch.ops.mage_gen.linear(x, weight, None, None, None, False, gate, residual)):
            with pytest.raises((LaunchError, TypeError), match="^mage_gen.torch.linear: " + message) as info:
                call()
            assert "\n" not in str(info.value)


def test_a_gated_linear_under_fake_tensors_gives_half_the_weights_rows():
    with FakeTensorMode():
        y = torch.ops.mage_gen.linear(bf16(2, 3, 4096), bf16(6144, 4096), None, None, None, True, "silu")
        assert y.shape == (2, 3, 3072) and y.dtype == BF16
        assert mt.linear(bf16(0, 4096), bf16(32, 4096), gate="silu").shape == (0, 16)
        y = mt.linear(bf16(5, 4096), bf16(32, 4096), bf16(32), gate="silu", residual=bf16(5, 16))
        assert y.shape == (5, 16)  # a bias before the gate, a residual after it


@pytest.mark.parametrize("make, message", BAD_LINEAR)
def test_linear_refuses_what_the_kernel_cannot_take_in_one_line(make, message):
    with FakeTensorMode():
        x, weight, bias = make()
        for call in (lambda: mt.linear(x, weight, bias), lambda: torch.ops.mage_gen.linear(x, weight, bias)):
            with pytest.raises((LaunchError, TypeError), match="^mage_gen.torch.linear: " + message) as info:
                call()
            assert "\n" not in str(info.value)


def test_linear_under_fake_tensors_keeps_the_leading_dims_and_takes_no_rows():
    with FakeTensorMode():
        y = torch.ops.mage_gen.linear(bf16(2, 3, 4096), bf16(6144, 4096), None)
        assert y.shape == (2, 3, 6144) and y.dtype == BF16
        assert torch.ops.mage_gen.linear(bf16(0, 4096), bf16(32, 4096), bf16(32)).shape == (0, 32)


def test_a_bf16_matmul_needs_n_and_k_in_whole_16_bytes():
    with FakeTensorMode():
        assert mt.matmul(bf16(16, 64), bf16(64, 32)).shape == (16, 32)
        with pytest.raises(LaunchError, match="^mage_gen.torch.matmul: N = 36 is not a multiple of 8"):
            mt.matmul(bf16(16, 64), bf16(64, 36))
        with pytest.raises(TypeError, match="b must be bfloat16, got torch.float32"):
            mt.matmul(bf16(16, 64), fake(64, 32))


class Mlp(torch.nn.Module):
    def __init__(self, d: int, hidden: int):
        super().__init__()
        self.register_buffer("up", bf16(hidden, d))  # nn.Linear's layout: (out features, in features)
        self.register_buffer("down", bf16(d, hidden))
        self.register_buffer("bias", bf16(d))

    def forward(self, x):
        return mt.linear(torch.relu(mt.linear(x, self.up)), self.down, self.bias)


def test_torch_compile_fullgraph_keeps_linear_in_one_graph():
    y, targets = compile_in_one_graph(lambda: Mlp(256, 512), 2, 7, 256, dtype=BF16)
    assert y.shape == (2, 7, 256) and y.dtype == BF16
    assert targets.count(torch.ops.mage_gen.linear.default) == 2


class Block(torch.nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.register_buffer("w", torch.ones(d, device="cuda"))
        self.register_buffer("b", torch.zeros(d, device="cuda"))

    def forward(self, x):
        return mt.layer_norm(x * 2, self.w, self.b) + 1


def compile_in_one_graph(make_module, *shape: int, dtype=torch.float32) -> tuple[torch.Tensor, list]:
    """make_module() compiled with fullgraph=True and run on a fake CUDA tensor of `shape`: (its output, the
    functions its one graph calls)."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    with FakeTensorMode():
        y = torch.compile(make_module(), fullgraph=True, backend=backend)(fake(*shape, dtype=dtype))
    (graph,) = graphs
    return y, [node.target for node in graph.graph.nodes if node.op == "call_function"]


def test_torch_compile_fullgraph_keeps_the_op_in_one_graph():
    y, targets = compile_in_one_graph(lambda: Block(768), 3, 5, 768)
    assert y.shape == (3, 5, 768) and y.device.type == "cuda"
    assert torch.ops.mage_gen.layer_norm.default in targets and len(targets) == 3


class RMSBlock(torch.nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.register_buffer("w", torch.ones(d, device="cuda"))

    def forward(self, x):
        return mt.rms_norm(x + 1, self.w, 1e-6) * 2


def test_torch_compile_fullgraph_keeps_rms_norm_in_one_graph():
    y, targets = compile_in_one_graph(lambda: RMSBlock(4096), 2, 7, 4096)
    assert y.shape == (2, 7, 4096)
    assert torch.ops.mage_gen.rms_norm.default in targets and len(targets) == 3
    with FakeTensorMode(), pytest.raises(LaunchError, match=r"weight must have shape \(4096,\)"):
        torch.ops.mage_gen.rms_norm(fake(4, 4096), fake(4095), 1e-6)


def test_the_fake_implementation_checks_what_the_real_one_does():
    with FakeTensorMode():
        with pytest.raises(LaunchError, match=r"weight must have shape \(768,\)"):
            torch.ops.mage_gen.layer_norm(fake(4, 768), fake(769), fake(768), 1e-5)
        out = torch.ops.mage_gen.layer_norm(fake(2, 3, 768), fake(768), fake(768), 1e-5)
        assert out.shape == (2, 3, 768) and out.dtype == torch.float32


def test_the_command_line_starts_without_torch_optuna_or_triton():
    code = ("import sys, mage_gen.cli; heavy = {'torch', 'optuna', 'triton'} & set(sys.modules); "
            "assert not heavy, heavy")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_the_cli_states_the_tuner_defaults_it_does_not_import():
    from mage_gen import cli_tune, tune

    assert (cli_tune.EXHAUSTIVE_LIMIT, cli_tune.DEFAULT_TPE_TRIALS) == (tune.EXHAUSTIVE_LIMIT, tune.DEFAULT_TPE_TRIALS)


@pytest.fixture
def stub_driver(tmp_path, monkeypatch):
    """A stand-in for libcuda's cuLaunchKernel that records what it was given."""
    import ctypes
    import shutil

    from mage_gen import gpu

    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler")
    (tmp_path / "stub.c").write_text(
        "static unsigned g[7]; static void** p; static void* last; static int calls;\n"
        "int cuLaunchKernel(void* f, unsigned a, unsigned b, unsigned c, unsigned d, unsigned e, unsigned h,"
        " unsigned s, void* st, void** params, void** extra)"
        " { g[0]=a; g[1]=b; g[2]=c; g[3]=d; g[4]=e; g[5]=h; g[6]=s; p = params; last = st; calls++; return 0; }\n"
        "unsigned grid(int i) { return g[i]; }\nvoid* param(int i) { return p[i]; }\nint count(void) { return calls; }\n"
        "void* stream(void) { return last; }\n")
    subprocess.run([compiler, "-shared", "-fPIC", "-o", str(tmp_path / "stub.so"), str(tmp_path / "stub.c")],
                   check=True)
    stub = ctypes.CDLL(str(tmp_path / "stub.so"))
    stub.cuLaunchKernel.restype = ctypes.c_int
    stub.param.restype = stub.stream.restype = ctypes.c_void_p
    monkeypatch.setattr(gpu, "_driver_launch", lambda: stub.cuLaunchKernel)
    return stub


class _Loaded:
    function, name = 1234, "k"


def test_a_fixed_launch_packs_each_value_where_its_parameter_pointer_points(stub_driver):
    import ctypes

    from mage_gen import gpu

    stub = stub_driver
    launch = gpu.FixedLaunch(_Loaded(), (19, 2, 1), (128, 1, 1), 4096, ["i32", "ptr", "f32", "i64", "ptr"])
    launch.launch((-3, 0xDEAD0000BEEF, 1e-5, 1 << 40, 16), 7)
    assert [stub.grid(i) for i in range(7)] == [19, 2, 1, 128, 1, 1, 4096]
    kinds = [ctypes.c_int32, ctypes.c_uint64, ctypes.c_float, ctypes.c_int64, ctypes.c_uint64]
    got = [ctypes.cast(stub.param(i), ctypes.POINTER(kind)).contents.value for i, kind in enumerate(kinds)]
    assert got == [-3, 0xDEAD0000BEEF, pytest.approx(1e-5), 1 << 40, 16]
    for i, kind in enumerate(kinds):  # each value at its natural alignment, as a C struct lays them out
        assert stub.param(i) % ctypes.sizeof(kind) == 0
    assert stub.stream() == 7
    for stream in (0xFFFF_8000_0000_1000, 7):  # each launch on the stream it names, not the one before
        launch.launch((-3, 0xDEAD0000BEEF, 1e-5, 1 << 40, 16), stream)
        assert stub.stream() == stream


def _cluster_of(config) -> tuple:
    """What a CUlaunchConfig says: grid, block, shared memory, stream, and each attribute's id and cluster shape."""
    return ((config.gridDimX, config.gridDimY, config.gridDimZ), (config.blockDimX, config.blockDimY, config.blockDimZ),
            config.sharedMemBytes, int(config.hStream),
            [(a.id, (a.value.clusterDim.x, a.value.clusterDim.y, a.value.clusterDim.z))
             for a in config.attrs[:config.numAttrs]])


def test_a_launch_config_carries_the_cluster_dimension():
    from cuda.bindings import driver as cu

    from mage_gen import gpu

    config = gpu.launch_config((90, 1, 1), (384, 1, 1), 197696, 7, (2, 1, 1))
    assert _cluster_of(config) == ((90, 1, 1), (384, 1, 1), 197696, 7,
                                   [(cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION, (2, 1, 1))])


@pytest.fixture
def launch_ex(monkeypatch):
    """A stand-in for the binding's cuLaunchKernelEx that records what it was given."""
    from cuda.bindings import driver as cu

    from mage_gen import gpu

    seen = []

    def record(config, function, params, extra):
        seen.append((_cluster_of(config), function, params, extra))
        return (cu.CUresult.CUDA_SUCCESS,)

    monkeypatch.setattr(gpu.cu, "cuLaunchKernelEx", record)
    return seen


def test_a_clustered_fixed_launch_goes_through_cuLaunchKernelEx_with_its_cluster(stub_driver, launch_ex):
    import ctypes

    from cuda.bindings import driver as cu

    from mage_gen import gpu

    launch = gpu.FixedLaunch(_Loaded(), (90, 1, 1), (384, 1, 1), 4096, ["ptr", "i32"], cluster=(2, 1, 1))
    for stream in (7, 7, 9):
        launch.launch((0xDEAD0000BEEF, -3), stream)
    assert stub_driver.count() == 0  # never the plain cuLaunchKernel
    cluster = [(cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION, (2, 1, 1))]
    assert [seen[0] for seen in launch_ex] == [((90, 1, 1), (384, 1, 1), 4096, s, cluster) for s in (7, 7, 9)]
    config, function, params, extra = launch_ex[-1]
    assert function == 1234 and extra == 0
    values = ctypes.cast(params, ctypes.POINTER(ctypes.c_void_p))  # the packed values, as the fast path packs them
    assert ctypes.cast(values[0], ctypes.POINTER(ctypes.c_uint64)).contents.value == 0xDEAD0000BEEF
    assert ctypes.cast(values[1], ctypes.POINTER(ctypes.c_int32)).contents.value == -3
    single = gpu.FixedLaunch(_Loaded(), (90, 1, 1), (384, 1, 1), 4096, ["ptr", "i32"], cluster=(1, 1, 1))
    single.launch((0xDEAD0000BEEF, -3), 7)
    assert stub_driver.count() == 1 and len(launch_ex) == 3


def test_a_kernel_with_a_cluster_is_launched_with_its_attribute_and_one_without_plainly(launch_ex, monkeypatch):
    from cuda.bindings import driver as cu

    from mage_gen import gpu

    plain = []
    monkeypatch.setattr(gpu.cu, "cuLaunchKernel", lambda *args: plain.append(args) or (cu.CUresult.CUDA_SUCCESS,))
    kernel = object.__new__(gpu.Kernel)  # no GPU here: a loaded kernel's handle and name are all a launch reads
    kernel.function, kernel.name = 1234, "k"
    args = gpu.KernelArgs([("ptr", 16), ("i32", 3)])
    kernel.launch((90, 1, 1), (384, 1, 1), 4096, args, 5, (2, 1, 1))
    kernel.launch((81, 1, 1), (384, 1, 1), 4096, args, 5)
    cluster = [(cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION, (2, 1, 1))]
    assert [seen[:3] for seen in launch_ex] == [(((90, 1, 1), (384, 1, 1), 4096, 5, cluster), 1234, args.address)]
    assert plain == [(1234, 81, 1, 1, 384, 1, 1, 4096, 5, args.address, 0)]


def test_each_address_is_held_to_its_own_alignment_not_the_strictest(stub_driver):
    # matmul 512³'s default config reads A four bytes at a time and B, C sixteen
    mm = get_op("matmul")
    shape = mm.shape(m=512, n=512, k=512)
    params = mm.params_from_dict(mm.defaults(shape))
    alignments = {name: t["alignment_bytes"] for name, t in mm.contract(shape, params)["tensors"].items()}
    assert alignments == {"C": 16, "A": 4, "B": 16}
    prepared = runtime.Prepared(mm, shape, params, {}, _Loaded(), build(mm, shape, params, "sm_90").census)
    prepared.launch((0x10000, 0x20004, 0x30000), 7)  # A at 4 bytes past a 16: allowed
    assert stub_driver.count() == 1
    for bad in ((0x10004, 0x20000, 0x30000), (0x10000, 0x20002, 0x30000), (0x10000, 0x20000, 0)):
        with pytest.raises(LaunchError, match="is not a device address aligned to"):
            prepared.launch(bad, 7)
    assert stub_driver.count() == 1


def _ptx_params(ptx: str) -> list[tuple[int, int]]:
    """(alignment, bytes) of each .param of the PTX's entry, as it declares them."""
    import re

    entry = ptx[ptx.index(".entry"):]
    found = []
    for declaration in re.findall(r"\.param ([^,)]+)", entry[:entry.index(")")]):
        array = re.match(r"\.align (\d+) \.b8 \S+\[(\d+)\]", declaration)
        if array:
            found.append((int(array[1]), int(array[2])))
        else:
            size = int(re.match(r"\.[usbf](\d+)", declaration)[1]) // 8
            found.append((size, size))
    return found


@pytest.fixture(scope="module")
def gemm_kernel():
    """gemm_sm90 at 128³ with a TMA store (three tensor maps after three pointers), built for sm_90a on this CPU."""
    op = get_op("gemm_sm90")
    shape = op.shape(m=128, n=128, k=128)
    params = op.params_from_dict({"epilogue": "tma"})
    return op, shape, params, build(op, shape, params, "sm_90a")


def test_tensor_maps_are_packed_where_the_kernels_ptx_declares_them(stub_driver, gemm_kernel):
    import ctypes

    from mage_gen import gpu

    op, shape, params, variant = gemm_kernel
    declared = _ptx_params(variant.compiled.ptx)
    kinds = ["ptr"] * 3 + ["tmap"] * 3
    assert declared == [(8, 8)] * 3 + [(64, gpu.TENSOR_MAP_BYTES)] * 3
    launch = gpu.FixedLaunch(_Loaded(), (1, 1, 1), (384, 1, 1), 0, kinds)
    offset = 0  # the offsets C gives a struct of the declared parameters
    for (align, size), at in zip(declared, launch.offsets):
        offset = -(-offset // align) * align
        assert at == offset
        offset += size
    assert launch.offsets == [0, 8, 16, 64, 192, 320]
    maps = [bytes(range(i, i + 128)) for i in (1, 50, 99)]
    launch.launch((0x1000, 0x2000, 0x3000, *maps), 0)
    for i in range(3):
        assert ctypes.cast(stub_driver.param(i), ctypes.POINTER(ctypes.c_uint64)).contents.value == 0x1000 * (i + 1)
    for i, encoded in enumerate(maps):
        assert stub_driver.param(3 + i) % 64 == 0
        assert ctypes.string_at(stub_driver.param(3 + i), gpu.TENSOR_MAP_BYTES) == encoded


def test_a_prepared_gemm_encodes_each_map_once_per_address(stub_driver, gemm_kernel, monkeypatch):
    import ctypes

    from mage_gen import gpu

    op, shape, params, variant = gemm_kernel
    encoded = []

    def encode(address, spec):
        encoded.append((spec.tensor, address))
        return f"{spec.tensor}@{address:#x}".encode().ljust(gpu.TENSOR_MAP_BYTES, b"\0")

    monkeypatch.setattr(gpu, "tensor_map", encode)
    prepared = runtime.Prepared(op, shape, params, {}, _Loaded(), variant.census)
    a, b = 0x7000_0000, 0x7100_0000
    for c in (0x1000, 0x2000, 0x1000, 0x2000):  # the same weights and activations, two outputs in turn
        prepared.launch((c, a, b), 7)
        got = [ctypes.string_at(stub_driver.param(3 + i), gpu.TENSOR_MAP_BYTES).rstrip(b"\0") for i in range(3)]
        assert got == [f"A@{a:#x}".encode(), f"B@{b:#x}".encode(), f"C@{c:#x}".encode()]
    assert encoded == [("A", a), ("B", b), ("C", 0x1000), ("C", 0x2000)] and stub_driver.count() == 4
    monkeypatch.setattr(runtime, "MAP_CACHE", 3)  # the least recently used map is dropped past the limit
    prepared.launch((0x3000, a, b), 7)
    prepared.launch((0x1000, a, b), 7)
    assert encoded[4:] == [("C", 0x3000), ("C", 0x1000)] and len(prepared._encoded) == 3


def test_a_prepared_gemm_refuses_an_address_tma_cannot_take(stub_driver, gemm_kernel, monkeypatch):
    from mage_gen import gpu

    op, shape, params, variant = gemm_kernel
    monkeypatch.setattr(gpu, "tensor_map", lambda address, spec: pytest.fail("encoded a map for a refused launch"))
    prepared = runtime.Prepared(op, shape, params, {}, _Loaded(), variant.census)
    assert prepared._alignments == {"C": 16, "A": 16, "B": 16}
    for bad in ((0x1000, 0x2008, 0x3000), (0x1000, 0x2000, 0x3002), (0x1008, 0x2000, 0x3000), (0, 0x2000, 0x3000)):
        with pytest.raises(LaunchError, match="is not a device address aligned to 16 bytes"):
            prepared.launch(bad, 7)
    assert stub_driver.count() == 0


@pytest.fixture
def no_driver_calls(monkeypatch):
    from mage_gen import gpu

    for name in ("current_context", "device_info", "current_device", "make_primary_current"):
        monkeypatch.setattr(gpu, name, lambda *args, name=name: pytest.fail(f"reached the driver ({name})"))


@pytest.mark.parametrize("change, message", [
    ({"m": 0}, "m must be a whole number in 1..1048576, got 0"),
    ({"k": 1 << 21}, "k must be a whole number"),
    ({"n": 4096.0}, "n must be a whole number"),
    ({"c_dtype": "fp16"}, r"c_dtype \(C's element type\) is one of \('bf16', 'fp32'\), got 'fp16'"),
    ({"b_layout": "mk"}, "b_layout is one of"),
    ({"a": 0x2000_0008}, "A at 0x20000008 is not a device address aligned to 16 bytes"),
    ({"b": 0x3000_0004}, "B at 0x30000004 is not a device address aligned to 16 bytes"),
    ({"c": 0}, "C at 0x0 is not a device address"),
])
def test_gemm_refuses_what_the_kernel_cannot_take_before_the_driver(no_driver_calls, change, message):
    call = {"c": 0x1000_0000, "a": 0x2000_0000, "b": 0x3000_0000, "m": 128, "n": 4096, "k": 4096, **change}
    with pytest.raises(LaunchError, match="^gemm_sm90: .*" + message):
        runtime.gemm(**call)


def test_a_split_k_launch_gets_working_buffers_of_its_own_stream_and_a_graph_its_own(stub_driver, monkeypatch):
    import contextlib
    import ctypes

    from mage_gen import gpu
    from mage_gen.ops.gemm_sm90 import counters, workspace_floats
    from mage_gen.variants import build

    op = get_op("gemm_sm90")
    shape = op.shape(m=16, n=4096, k=4096)
    params = op.params_from_dict({"split_k": 2, "bm": 64, "consumers": 1})
    made, capturing, side = [], set(), []

    class Buffer:  # cuMemAlloc and cuMemsetD32Async, recorded
        def __init__(self, nbytes):
            self.nbytes, self.ptr, self.fills = nbytes, 0x100000 * (len(made) + 1), []
            made.append(self)

        def fill32(self, bits, stream=0):
            self.fills.append((bits, stream))
            side.append(("fill", stream))

    class Stream:  # cuStreamCreate, cuStreamSynchronize and cuStreamDestroy, recorded
        def __init__(self):
            self.handle = 100 + len(side)
            side.append(("create", self.handle))

        def synchronize(self):
            side.append(("synchronize", self.handle))

        def destroy(self):
            side.append(("destroy", self.handle))

    monkeypatch.setattr(gpu, "Buffer", Buffer)
    monkeypatch.setattr(gpu, "Stream", Stream)
    monkeypatch.setattr(gpu, "capturing", lambda stream: stream in capturing)
    monkeypatch.setattr(gpu, "relaxed_capture", contextlib.nullcontext)
    monkeypatch.setattr(gpu, "tensor_map", lambda address, spec: bytes(gpu.TENSOR_MAP_BYTES))
    prepared = runtime.Prepared(op, shape, params, {}, _Loaded(), build(op, shape, params, "sm_90").census)

    def launch(stream):  # -> the workspace and counters addresses the kernel was given (its 4th and 5th parameters)
        prepared.launch((0x1000, 0x2000, 0x3000), stream)
        return [ctypes.cast(stub_driver.param(i), ctypes.POINTER(ctypes.c_uint64)).contents.value for i in (3, 4)]

    assert launch(7) == [made[0].ptr, made[1].ptr] == launch(7)  # made once for the stream, then reused
    assert [b.nbytes for b in made] == [4 * workspace_floats(shape, params), 4 * counters(shape, params)]
    assert made[0].fills == [] and made[1].fills == [(0, 7)]  # the counters cleared on the stream, before the launch
    assert launch(8) == [made[2].ptr, made[3].ptr] and made[3].fills == [(0, 8)]  # another stream, its own
    capturing.add(9)
    del side[:]
    assert launch(9) == [made[4].ptr, made[5].ptr] and launch(9) == [made[6].ptr, made[7].ptr]  # each graph its own
    # cleared at capture on a stream beside it, and waited for: nothing is recorded into the graph to run at each replay
    assert made[5].fills == [(0, 100)] and made[7].fills == [(0, 104)]
    assert side == [(event, stream) for stream in (100, 104)
                    for event in ("create", "fill", "synchronize", "destroy")]
    assert launch(7) == [made[0].ptr, made[1].ptr] and len(made) == 8


def test_the_runtime_builds_a_hopper_kernel_for_sm_90a_on_an_sm_90_gpu(monkeypatch):
    """wgmma exists on sm_90a alone: a kernel NVRTC built for plain sm_90 would not assemble."""
    from mage_gen import gpu, variants

    op = get_op("gemm_sm90")
    device = gpu.DeviceInfo("NVIDIA H200", (9, 0), 132, 60 << 20, 232448, "13.0")
    built, loaded = [], []
    monkeypatch.setattr(gpu, "current_device", lambda: 0)
    monkeypatch.setattr(gpu, "device_info", lambda ordinal=0: device)
    monkeypatch.setattr(runtime, "choose", lambda *args: (op.params_from_dict({"bm": 64, "consumers": 1}), None))
    monkeypatch.setattr(runtime, "build", lambda *args: built.append(variants.build(*args)) or built[-1])
    monkeypatch.setattr(gpu, "Kernel", lambda cubin, name, shared: loaded.append(name) or name)
    monkeypatch.setattr(runtime, "Prepared", lambda *args, **kw: args)
    runtime._prepare(op, {"m": 16, "n": 4096, "k": 4096}, {}, 7, True)
    (variant,) = built
    assert variant.compiled.arch == "sm_90a" and loaded == [variant.source.kernel_name]


def test_a_gemm_at_an_untuned_m_runs_the_nearest_class_and_an_untuned_n_k_says_how_to_tune_it():
    from mage_gen import gpu
    from mage_gen.store import load_winner

    op = get_op("gemm_sm90")
    h200 = gpu.DeviceInfo("NVIDIA H200", (9, 0), 132, 60 << 20, 232448, "13.0")
    for m, tuned_at in ((1, 16), (40, 32), (300, 256), (400, 512), (2048, 4096), (6000, 8192), (100000, 8192)):
        served = load_winner(op, op.shape(m=tuned_at, n=4096, k=4096), h200.name)
        assert runtime.choose(op, op.shape(m=m, n=4096, k=4096), {}, h200, True) == (served.params, served.entry)
    with pytest.raises(LaunchError, match=r"^gemm_sm90: nothing is tuned for n=4096, k=4096, b_layout=kn at any M on "
                                          r"NVIDIA H200; tune it, e\.g\. `mage-gen tune gemm_sm90 --m 8 --n 4096 "
                                          r"--k 4096 --config b_layout=kn`"):
        runtime.choose(op, op.shape(m=8, n=4096, k=4096, b_layout="kn"), {}, h200, True)


@pytest.mark.parametrize("asked, cublas_faster, scaled, runs", [
    (True, True, False, "cublas"), (True, False, False, "kernel"), (False, True, False, "kernel"),
    (True, True, True, "kernel"),  # fp8: the rule is bf16's
])
def test_linear_calls_cublas_only_where_asked_and_the_serving_tune_saw_cublas_win(monkeypatch, asked, cublas_faster,
                                                                                   scaled, runs):
    prepared, launched = type("Served", (), {"cublas_faster": cublas_faster})(), []
    monkeypatch.setattr(mt, "_check_linear", lambda x, weight, *rest: (x.shape[0], weight.shape[0], x.shape[1]))
    monkeypatch.setattr(mt, "_gemm_launch", lambda *args: prepared)
    monkeypatch.setattr(mt, "_gemm", lambda index, served, c, *rest: launched.append(served) or c.fill_(7))
    x, weight = torch.randn(4, 64).to(BF16), torch.randn(32, 64).to(BF16)
    scales = (torch.ones(1), torch.ones(1)) if scaled else (None, None)
    y = mt._linear_impl(x, weight, None, *scales, cublas_where_faster=asked)
    expected = torch.nn.functional.linear(x, weight) if runs == "cublas" else torch.full((4, 32), 7.0, dtype=BF16)
    assert torch.equal(y, expected) and launched == ([] if runs == "cublas" else [prepared])


@pytest.mark.parametrize("cublas_faster", [True, False])
def test_an_epilogue_where_cublas_won_is_torchs_product_bias_gate_and_residual(monkeypatch, cublas_faster):
    prepared, asked, launched = type("Served", (), {"cublas_faster": cublas_faster})(), [], []
    monkeypatch.setattr(mt, "_check_linear", lambda x, weight, *rest: (x.shape[0], weight.shape[0], x.shape[1]))
    monkeypatch.setattr(mt, "_gemm_launch", lambda *args: asked.append(args[6:]) or prepared)
    monkeypatch.setattr(mt, "_gemm", lambda index, served, c, *rest: launched.append(rest[-1]) or c.fill_(7))
    x, weight, bias = torch.randn(4, 64).to(BF16), torch.randn(32, 64).to(BF16), torch.randn(32).to(BF16)
    residual = torch.randn(4, 16).to(BF16)
    y = mt._linear_impl(x, weight, bias, cublas_where_faster=True, gate="silu", residual=residual)
    product = torch.nn.functional.linear(x, weight, bias)
    expected = (torch.nn.functional.silu(product[:, :16]) * product[:, 16:] + residual if cublas_faster
                else torch.full((4, 16), 7.0, dtype=BF16))
    assert asked == [("silu", True, True)] and torch.equal(y, expected)
    assert launched == ([] if cublas_faster else [(bias, residual)])  # the kernel takes both, in that order


def test_a_gated_gemm_with_no_entry_of_its_own_runs_its_plain_weights_unless_they_cannot_pair_sums():
    from mage_gen import gpu
    from mage_gen.store import load_winner

    op = get_op("gemm_sm90")
    h200 = gpu.DeviceInfo("NVIDIA H200", (9, 0), 132, 60 << 20, 232448, "13.0")
    served = load_winner(op, op.shape(m=2048, n=6144, k=4096), h200.name)
    assert not served.params.swap
    assert runtime.choose(op, op.shape(m=2000, n=6144, k=4096, gate="silu"), {}, h200, True) == (served.params,
                                                                                                  served.entry)
    tuned = {op.shape(m=16, n=6144, k=4096): op.params_from_dict({"bm": 128, "bn": 32, "swap": True}),
             op.shape(m=512, n=6144, k=4096): op.params_from_dict({"bm": 128, "bn": 128})}
    gated_16 = op.shape(m=16, n=6144, k=4096, gate="silu")
    assert dispatch.choose_class(op, gated_16, tuned)[0].m == 512  # the swapped class at 16 cannot pair its sums
    own = op.shape(m=256, n=6144, k=4096, gate="silu")
    assert dispatch.choose_class(op, gated_16, {**tuned, own: op.params_from_dict({"bm": 64, "bn": 64, "consumers": 1})})[0] == own


def test_whether_cublas_serves_a_product_is_read_from_its_serving_entry_without_compiling(monkeypatch):
    from mage_gen import dispatch, gpu
    from mage_gen.errors import NoGpuError

    op = get_op("gemm_sm90")
    h200 = gpu.DeviceInfo("NVIDIA H200", (9, 0), 132, 60 << 20, 232448, "13.0")
    monkeypatch.setattr(gpu, "device_info", lambda ordinal=0: h200)
    monkeypatch.setattr(runtime, "build", lambda *args: pytest.fail("compiled a kernel"))
    served = {}
    for m in (16, 40, 2048, 6000):
        dims = {"m": m, "n": 6144, "k": 4096, "gate": "silu" if m == 40 else "none"}
        served[m] = runtime.peer_serves("gemm_sm90", dims, 0)
        assert served[m] == dispatch.cublas_serves(op, op.shape(**dims),
                                                   runtime.choose(op, op.shape(**dims), {}, h200, True)[1])
    assert set(served.values()) == {True, False}  # the stored tunes saw cuBLAS win at some M and lose at others
    assert not runtime.peer_serves("gemm_sm90", {"m": 16, "n": 1000, "k": 4096}, 0)  # nothing tuned: the launch raises

    def no_gpu(ordinal=0):
        raise NoGpuError("no CUDA driver on this machine")

    monkeypatch.setattr(gpu, "device_info", no_gpu)
    assert not runtime.peer_serves("gemm_sm90", {"m": 16, "n": 6144, "k": 4096}, 0)
