"""mage-gen's tuned kernels as PyTorch ops.

    from mage_gen.torch import layer_norm, linear, matmul, rms_norm
    y = layer_norm(x, weight, bias, eps=1e-5)   # x: (..., d) CUDA; weight, bias: (d,)
    y = rms_norm(x, weight, eps=1e-6)           # x: (..., d) CUDA; weight: (d,)
    y, h = rms_norm(x, weight, residual=r)      # h = x + r (rounded as torch rounds it), y = rms_norm(h)
    y = linear(x, weight, bias=None)            # x: (..., K), weight: (N, K) bf16 CUDA, an (N, K) tuned at some M
    y = linear(x8, w8, scale_x=sx, scale_weight=sw)  # fp8 e4m3 with per-tensor scales, as torch._scaled_mm
    a = linear(x, gate_up, gate="silu")         # silu(x·W_gateᵀ) ⊙ x·W_upᵀ, gate_up = [W_gate; W_up], one kernel
    h = linear(a, down, residual=h)             # h + a·downᵀ, the add in the kernel's epilogue
    c = matmul(a, b)                            # a: (M, K), b: (K, N): float32 at a tuned (M, N, K); bf16 as linear
    routes = patch(model)                       # a model's linear layers and norms, where tuned, in place

x (and residual) are float32, bfloat16 or float16; weight and bias x's dtype or float32; the statistics are
fp32 whatever the dtype. They are torch.library custom ops (mage_gen::layer_norm, mage_gen::rms_norm, their
_residual forms, mage_gen::linear, mage_gen::matmul) with fake implementations, so torch.compile(fullgraph=True)
keeps them in its graph. They launch through mage_gen.runtime on torch's
current stream (inside torch.cuda.graph capture too). In eager mode, with plain tensors and no dispatch mode
active, the wrappers call the implementation directly: the dispatcher's round trip would cost more than the
kernel at small sizes.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as _F
from torch.utils._python_dispatch import _get_current_dispatch_mode

from mage_gen import gpu, runtime
from mage_gen.errors import ConfigError, GpuError, LaunchError
from mage_gen.ops import Op, get_op
from mage_gen.ops.gemm_sm90 import GATES as _GATES
from mage_gen.ops.layernorm import MAX_ROWS

# Looked up once: an eager call's checks and launch are a good part of its cost at small sizes.
_Tensor, _float32, _bfloat16, _float8, _grad_enabled, _is_compiling = torch.Tensor, torch.float32, torch.bfloat16, torch.float8_e4m3fn, torch.is_grad_enabled, torch.compiler.is_compiling
_ACTIVATIONS = (torch.float32, torch.bfloat16, torch.float16)  # what a norm's x may be
_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
# A CPU-only torch has neither, and no CUDA tensor that could reach a launch.
_current_device = getattr(torch._C, "_cuda_getDevice", None)
_current_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)
# The ops served here; each names the function of this module that launches it (Op.torch_name), as errors say
_LAYER_NORM, _RMS_NORM, _MATMUL = get_op("layernorm"), get_op("rmsnorm"), get_op("matmul")
_GEMM = get_op("gemm_sm90")  # Hopper's tensor cores: linear, and matmul in bf16


def _check_tensor(fn: str, name: str, t: torch.Tensor, device: torch.device | None = None,
                  dtypes: tuple = (torch.float32,)) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{fn}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.requires_grad and torch.is_grad_enabled():
        # The kernels have no backward: an output with no grad_fn would silently stop gradients here.
        raise LaunchError(f"{fn}: {name} requires grad, and this op has no backward; call it under "
                          f"torch.no_grad() or torch.inference_mode(), or detach {name}")
    if t.dtype not in dtypes:
        allowed = " or ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise TypeError(f"{fn}: {name} must be {allowed}, got {t.dtype}; convert it with {name}.to(...)")
    if t.device.type != "cuda":
        raise LaunchError(f"{fn}: {name} must be on a CUDA device, got {t.device}; move it with {name}.cuda()")
    if device is not None and t.device != device:
        raise LaunchError(f"{fn}: {name} is on {t.device} but x is on {device}; put them on one device")
    if not t.is_contiguous():
        raise LaunchError(f"{fn}: {name} must be contiguous (strides {tuple(t.stride())}); "
                          f"pass {name}.contiguous()")


def check_norm(fn: str, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                residual: torch.Tensor | None = None) -> tuple[int, int]:
    """(rows, d) of a row norm's arguments (bias None: RMSNorm), or an error naming the argument."""
    # The common case in one expression (an eager call's checks are a good part of its cost); anything else
    # goes through the checks below, which name what is wrong.
    d = weight.numel()
    n = x.numel()
    act, wd = x.dtype, weight.dtype
    if ((act is _float32 is wd or (act in _ACTIVATIONS and (wd is act or wd is _float32)))
            and x.is_cuda and x.get_device() == weight.get_device()
            and x.is_contiguous() and weight.is_contiguous() and weight.dim() == 1 and x.dim() and x.shape[-1] == d
            and 0 < n <= MAX_ROWS * d and not (_grad_enabled() and (x.requires_grad or weight.requires_grad))
            and (bias is None or (bias.dtype is wd and bias.get_device() == x.get_device()
                                  and bias.is_contiguous() and bias.dim() == 1 and bias.numel() == d
                                  and not (_grad_enabled() and bias.requires_grad)))
            and (residual is None or (residual.dtype is act and residual.shape == x.shape and residual.is_contiguous()
                                      and residual.get_device() == x.get_device()
                                      and not (_grad_enabled() and residual.requires_grad)))):
        return n // d, d
    vectors = (("weight", weight),) + ((("bias", bias),) if bias is not None else ())
    _check_tensor(fn, "x", x, dtypes=_ACTIVATIONS)
    for name, t in vectors:
        _check_tensor(fn, name, t, x.device, dtypes=tuple(dict.fromkeys((x.dtype, torch.float32))))
    if bias is not None and bias.dtype != weight.dtype:
        raise TypeError(f"{fn}: bias must have weight's dtype {weight.dtype}, got {bias.dtype}")
    if residual is not None:
        _check_tensor(fn, "residual", residual, x.device, dtypes=(x.dtype,))
        if residual.shape != x.shape:
            raise LaunchError(f"{fn}: residual must have x's shape {tuple(x.shape)}, got {tuple(residual.shape)}")
    if x.dim() < 1:
        raise LaunchError(f"{fn}: x must have at least one dimension (rows × d), got a 0-d tensor")
    d = x.shape[-1]
    for name, t in vectors:
        if tuple(t.shape) != (d,):
            raise LaunchError(f"{fn}: {name} must have shape ({d},) to match x's last dimension, got {tuple(t.shape)}")
    m = x.numel() // d if d else 0
    if m < 1 or d < 1:
        raise LaunchError(f"{fn}: x has shape {tuple(x.shape)}: no rows to normalize (M = {m}, d = {d}); "
                          "give at least one row of at least one element")
    if m > MAX_ROWS:
        raise LaunchError(f"{fn}: x has {m} rows, more than the {MAX_ROWS} a launch takes; split it")
    return m, d


@torch.library.custom_op("mage_gen::layer_norm", mutates_args=())
def _layer_norm_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    return _norm_impl(_LAYER_NORM, x, weight, bias, eps)


@_layer_norm_op.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    check_norm(_LAYER_NORM.torch_name, x, weight, bias)
    return torch.empty_like(x)


@torch.library.custom_op("mage_gen::rms_norm", mutates_args=())
def _rms_norm_op(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _norm_impl(_RMS_NORM, x, weight, None, eps)


@_rms_norm_op.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    check_norm(_RMS_NORM.torch_name, x, weight)
    return torch.empty_like(x)


@torch.library.custom_op("mage_gen::layer_norm_residual", mutates_args=())
def _layer_norm_residual_op(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                            eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    return _norm_impl(_LAYER_NORM, x, weight, bias, eps, residual=residual)


@_layer_norm_residual_op.register_fake
def _(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
      eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    check_norm(_LAYER_NORM.torch_name, x, weight, bias, residual)
    return torch.empty_like(x), torch.empty_like(x)


@torch.library.custom_op("mage_gen::rms_norm_residual", mutates_args=())
def _rms_norm_residual_op(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                          eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    return _norm_impl(_RMS_NORM, x, weight, None, eps, residual=residual)


@_rms_norm_residual_op.register_fake
def _(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    check_norm(_RMS_NORM.torch_name, x, weight, None, residual)
    return torch.empty_like(x), torch.empty_like(x)


def _norm_impl(op: Op, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float,
               out: torch.Tensor | None = None, residual: torch.Tensor | None = None) -> Any:
    """y, or (y, x + residual) where residual is given."""
    fn = op.torch_name
    m, d = check_norm(fn, x, weight, bias, residual)
    if out is None:
        y = torch.empty_like(x)
    else:
        _check_out(fn, x, out)
        if any(_overlap(out, t) for t in (x, weight, bias, residual) if t is not None):
            raise LaunchError(f"{fn}: out overlaps an input; the kernel reads each input while it writes out, so "
                              "give out its own memory")
        y = out
    index = x.get_device()
    act, wd = x.dtype, weight.dtype
    key = (index, op.name, d, m) if act is _float32 is wd and residual is None else \
        (index, op.name, d, m, act, wd, residual is not None)
    prepared = launches.get(key)
    if prepared is None:
        dims = {"d": d} if len(key) == 4 else {"d": d, "dtype": _NAMES[act], "weight_dtype": _NAMES[wd],
                                               "residual": residual is not None}
        prepared = launches[key] = _prepare(index, op.name, dims, {"m": m})
    weights = (weight.data_ptr(),) if bias is None else (weight.data_ptr(), bias.data_ptr())
    if residual is None:
        _launch(prepared, index, (y.data_ptr(), x.data_ptr(), *weights, m, float(eps)))
        return y
    h = torch.empty_like(x)
    _launch(prepared, index, (y.data_ptr(), h.data_ptr(), x.data_ptr(), residual.data_ptr(), *weights, m, float(eps)))
    return y, h


def _check_out(fn: str, x: torch.Tensor, out: torch.Tensor) -> None:
    _check_tensor(fn, "out", out, x.device, dtypes=(x.dtype,))  # y is written in x's dtype
    if out.shape != x.shape:
        raise LaunchError(f"{fn}: out must have x's shape {tuple(x.shape)}, got {tuple(out.shape)}")


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    start_a, start_b = a.data_ptr(), b.data_ptr()
    return start_a < start_b + b.numel() * b.element_size() and start_b < start_a + a.numel() * a.element_size()


# (device index, op, shape, run size) -> its launch in the device's primary context, the one torch uses
launches: dict[tuple, runtime.Prepared] = {}


def _launch(prepared: runtime.Prepared, index: int, values: tuple) -> None:
    if index != _current_device():  # initialized: the tensors are on the device
        with torch.cuda.device(index):
            return _launch(prepared, index, values)
    stream = _current_stream(index)
    try:
        prepared.launch(values, stream)
    except GpuError:
        # A thread in which torch never made the device's context current yet: make it so, and again.
        gpu.make_primary_current(index)
        prepared.launch(values, stream)


def _prepare(index: int, op_name: str, dims: dict[str, Any], run: dict[str, int],
             tuned_only: bool = False) -> runtime.Prepared:
    """The launch of this shape and run size on device `index` (the caller keeps it in launches)."""
    with torch.cuda.device(index):
        torch.cuda.init()
        gpu.make_primary_current(index)  # torch's context: the device's primary one
        return runtime.prepare(op_name, dims, run, device=index, tuned_only=tuned_only)


def is_eager(*tensors: torch.Tensor) -> bool:
    """Plain tensors, not under torch.compile, make_fx or any other dispatch mode: the op need not be traced."""
    return (not _is_compiling() and _get_current_dispatch_mode() is None
            and all(type(t) is _Tensor for t in tensors))


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float = 1e-5, *,
               residual: torch.Tensor | None = None, out: torch.Tensor | None = None) -> Any:
    """F.layer_norm(x, (d,), weight, bias, eps) for CUDA x of any leading shape, with this GPU's tuned kernel
    for d, the dtypes and the number of rows. residual: normalize h = x + residual instead, and return
    (y, h). out: write y into this tensor (x's shape, contiguous, not overlapping an input) instead of a new
    one, as a CUDA graph replaying into fixed buffers wants."""
    if (type(x) is _Tensor and type(weight) is _Tensor and type(bias) is _Tensor  # is_eager, inline
            and (out is None or type(out) is _Tensor) and not _is_compiling() and _get_current_dispatch_mode() is None
            and (residual is None or type(residual) is _Tensor)):
        return _norm_impl(_LAYER_NORM, x, weight, bias, eps, out, residual)
    if out is not None:
        _check_out(_LAYER_NORM.torch_name, x, out)
    if residual is not None:
        y, h = _layer_norm_residual_op(x, residual, weight, bias, eps)
        return (y if out is None else out.copy_(y)), h
    y = _layer_norm_op(x, weight, bias, eps)
    return y if out is None else out.copy_(y)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, *, residual: torch.Tensor | None = None,
             out: torch.Tensor | None = None) -> Any:
    """F.rms_norm(x, (d,), weight, eps) for CUDA x of any leading shape, with this GPU's tuned kernel for d,
    the dtypes and the number of rows; residual and out as for layer_norm."""
    if (type(x) is _Tensor and type(weight) is _Tensor and (out is None or type(out) is _Tensor)
            and not _is_compiling() and _get_current_dispatch_mode() is None
            and (residual is None or type(residual) is _Tensor)):
        return _norm_impl(_RMS_NORM, x, weight, None, eps, out, residual)
    if out is not None:
        _check_out(_RMS_NORM.torch_name, x, out)
    if residual is not None:
        y, h = _rms_norm_residual_op(x, residual, weight, eps)
        return (y if out is None else out.copy_(y)), h
    y = _rms_norm_op(x, weight, eps)
    return y if out is None else out.copy_(y)


def _check_matmul(a: torch.Tensor, b: torch.Tensor) -> tuple[int, int, int]:
    fn = _MATMUL.torch_name
    _check_tensor(fn, "a", a, dtypes=(torch.float32, _bfloat16))
    _check_tensor(fn, "b", b, a.device, dtypes=(a.dtype,))
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[0]:
        raise LaunchError(f"{fn}: a must be (M, K) and b (K, N), got {tuple(a.shape)} and {tuple(b.shape)}")
    (m, k), n = a.shape, b.shape[1]
    if min(m, n, k) < 1:
        raise LaunchError(f"{fn}: empty product {m}×{k} · {k}×{n}; every size must be at least 1")
    if a.dtype is _bfloat16:
        _check_gemm(fn, m, n, k, "kn")
    return m, n, k


@torch.library.custom_op("mage_gen::matmul", mutates_args=())
def _matmul_op(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return _matmul_impl(a, b)


@_matmul_op.register_fake
def _(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    m, n, _ = _check_matmul(a, b)
    return a.new_empty((m, n))


def _matmul_impl(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    m, n, k = _check_matmul(a, b)
    c = torch.empty((m, n), dtype=a.dtype, device=a.device)
    index = a.get_device()
    if a.dtype is _bfloat16:
        _gemm(index, _gemm_launch(index, m, n, k, "kn", "bf16"), c, a, b, "kn")
        return c
    prepared = launches.get((index, _MATMUL.name, m, n, k))
    if prepared is None:
        prepared = launches[(index, _MATMUL.name, m, n, k)] = _prepare(index, _MATMUL.name, {"m": m, "n": n, "k": k},
                                                                        {}, tuned_only=True)
    _launch(prepared, index, (c.data_ptr(), a.data_ptr(), b.data_ptr()))
    return c


def matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b for a (M, K) and b (K, N). float32: fused multiply-adds, never TF32, for an (M, N, K) tuned on this
    GPU; bfloat16: on Hopper's tensor cores (fp32 accumulation, a bf16 result), for an (N, K) tuned at some M
    (the entry tuned at the nearest M runs; K and N multiples of 8). Other shapes are refused."""
    if is_eager(a, b):
        return _matmul_impl(a, b)
    return _matmul_op(a, b)


def _check_gemm(fn: str, m: int, n: int, k: int, b_layout: str, precision: str = "bf16") -> None:
    """Refuse what the Hopper kernel cannot take, before anything reaches the GPU."""
    # TMA reads rows that start on 16 bytes: a contiguous tensor's rows are K (for a K×N b, N) elements apart
    per = 16 if precision == "e4m3" else 8
    for name, size in (("K", k),) + ((("N", n),) if b_layout == "kn" else ()):
        if size % per:
            raise LaunchError(f"{fn}: {name} = {size} is not a multiple of {per}, and the kernel reads rows of 16 bytes "
                              f"(TMA); pad {name} to a multiple of {per} with zeros, or use torch for this layer")
    try:
        _GEMM.shape(m=m, n=n, k=k, b_layout=b_layout, precision=precision)
    except ConfigError as exc:
        raise LaunchError(f"{fn}: {exc}") from None


def _check_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  scale_x: torch.Tensor | None = None, scale_weight: torch.Tensor | None = None,
                  gate: str = "none", residual: torch.Tensor | None = None) -> tuple[int, int, int]:
    """(M, N, K) of F.linear(x, weight, bias) (fp8: scaled; gated: N the weight's rows) for the Hopper kernel, or an
    error naming the argument."""
    fn = _GEMM.torch_name
    _check_tensor(fn, "x", x, dtypes=(_bfloat16, _float8))
    _check_tensor(fn, "weight", weight, x.device, dtypes=(x.dtype,))
    fp8 = x.dtype is _float8
    for name, scale in (("scale_x", scale_x), ("scale_weight", scale_weight)):
        if not fp8:
            if scale is not None:
                raise LaunchError(f"{fn}: {name} scales an fp8 product; x is {x.dtype}, so give no scales")
            continue
        if scale is None:
            raise LaunchError(f"{fn}: an fp8 x and weight need scale_x and scale_weight (one float32 each, as "
                              f"torch._scaled_mm takes them); {name} is missing")
        _check_tensor(fn, name, scale, x.device)
        if scale.numel() != 1:
            raise LaunchError(f"{fn}: {name} is one float32 (a per-tensor scale), got shape {tuple(scale.shape)}")
    if x.dim() < 1 or weight.dim() != 2 or x.shape[-1] != weight.shape[1]:
        raise LaunchError(f"{fn}: x must be (..., K) and weight (N, K), got {tuple(x.shape)} and "
                          f"{tuple(weight.shape)}")
    n, k = weight.shape
    if bias is not None:
        _check_tensor(fn, "bias", bias, x.device, dtypes=(_bfloat16,))
        if tuple(bias.shape) != (n,):
            raise LaunchError(f"{fn}: bias must have shape ({n},), one per output feature, got {tuple(bias.shape)}")
    if n < 1 or k < 1:
        raise LaunchError(f"{fn}: weight {tuple(weight.shape)} is empty; N and K must be at least 1")
    if gate != "none":
        if gate not in _GATES:
            raise LaunchError(f"{fn}: gate is one of {_GATES}, got {gate!r}")
        if n % 2:
            raise LaunchError(f"{fn}: gate {gate} takes a weight of an even number of rows (the gate's, then the "
                              f"up's), got {n}")
    if residual is not None:
        _check_tensor(fn, "residual", residual, x.device, dtypes=(_bfloat16,))
        cols = n // 2 if gate != "none" else n
        if tuple(residual.shape) != (*x.shape[:-1], cols):
            raise LaunchError(f"{fn}: residual must have the result's shape {(*x.shape[:-1], cols)}, got "
                              f"{tuple(residual.shape)}")
    m = x.numel() // k
    if m:
        _check_gemm(fn, m, n, k, "nk", "e4m3" if fp8 else "bf16")
    return m, n, k


@torch.library.custom_op("mage_gen::linear", mutates_args=())
def _linear_op(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
               scale_x: Optional[torch.Tensor] = None, scale_weight: Optional[torch.Tensor] = None,
               cublas_where_faster: bool = False, gate: str = "none",
               residual: Optional[torch.Tensor] = None) -> torch.Tensor:
    return _linear_impl(x, weight, bias, scale_x, scale_weight, cublas_where_faster, gate, residual)


@_linear_op.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], scale_x: Optional[torch.Tensor] = None,
      scale_weight: Optional[torch.Tensor] = None, cublas_where_faster: bool = False, gate: str = "none",
      residual: Optional[torch.Tensor] = None) -> torch.Tensor:
    _, n, _ = _check_linear(x, weight, bias, scale_x, scale_weight, gate, residual)
    return x.new_empty((*x.shape[:-1], n // 2 if gate != "none" else n), dtype=_bfloat16)


def _linear_impl(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, scale_x: torch.Tensor | None = None,
                 scale_weight: torch.Tensor | None = None, cublas_where_faster: bool = False,
                 gate: str = "none", residual: torch.Tensor | None = None) -> torch.Tensor:
    m, n, k = _check_linear(x, weight, bias, scale_x, scale_weight, gate, residual)
    cols = n // 2 if gate != "none" else n
    if not m:
        return torch.empty((*x.shape[:-1], cols), dtype=_bfloat16, device=x.device)
    index, scales = x.get_device(), () if scale_x is None else (scale_x, scale_weight)
    prepared = _gemm_launch(index, m, n, k, "nk", "e4m3" if scales else "bf16", gate, bias is not None,
                            residual is not None)
    if cublas_where_faster and prepared.cublas_faster and not scales:  # dispatch.PEER_RULE
        y = _F.linear(x, weight, bias)
        y = y if gate == "none" else _F.silu(y[..., :cols]) * y[..., cols:]
        return y if residual is None else y + residual
    y = torch.empty((*x.shape[:-1], cols), dtype=_bfloat16, device=x.device)  # bf16 whatever x is, as _scaled_mm's
    addends = () if bias is None and residual is None else tuple(t for t in (bias, residual) if t is not None)
    _gemm(index, prepared, y, x, weight, "nk", scales, addends)
    return y


def _gemm_launch(index: int, m: int, n: int, k: int, b_layout: str, precision: str, gate: str = "none",
                 bias: bool = False, residual: bool = False) -> runtime.Prepared:
    key = (index, _GEMM.name, m, n, k, b_layout, precision, gate, bias, residual)
    prepared = launches.get(key)
    if prepared is None:
        prepared = launches[key] = _prepare(index, _GEMM.name, {"m": m, "n": n, "k": k, "b_layout": b_layout,
                                                                 "precision": precision, "gate": gate, "bias": bias,
                                                                 "residual": residual}, {}, tuned_only=True)
    return prepared


def serves_cublas(index: int, m: int, n: int, k: int, gate: str = "none", bias: bool = False,
                  residual: bool = False) -> bool:
    """Whether linear(..., cublas_where_faster=True) of this bf16 product on device `index` calls cuBLAS
    (dispatch.PEER_RULE), as its serving entry's tune timed, read without compiling the kernel."""
    return runtime.peer_serves(_GEMM.name, {"m": m, "n": n, "k": k, "b_layout": "nk", "precision": "bf16",
                                            "gate": gate, "bias": bias, "residual": residual}, index)


def _gemm(index: int, prepared: runtime.Prepared, c: torch.Tensor, a: torch.Tensor, b: torch.Tensor, b_layout: str,
          scales: tuple[torch.Tensor, ...] = (), addends: tuple[torch.Tensor, ...] = ()) -> None:
    fn = (_GEMM if b_layout == "nk" else _MATMUL).torch_name
    for name, t in ((("x", a), ("weight", b)) if b_layout == "nk" else (("a", a), ("b", b))):
        if t.data_ptr() % 16:  # named here as the caller knows it, before the runtime's check names the kernel's
            raise LaunchError(f"{fn}: {name} starts at {t.data_ptr():#x}, not on 16 bytes, where TMA reads rows "
                              f"from; pass {name}.clone() (a view into the middle of a tensor can start anywhere)")
    _launch(prepared, index, (c.data_ptr(), a.data_ptr(), b.data_ptr(), *(t.data_ptr() for t in (*scales, *addends))))


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
           scale_x: torch.Tensor | None = None, scale_weight: torch.Tensor | None = None,
           cublas_where_faster: bool = False, gate: str = "none", residual: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) on Hopper's tensor cores (fp32 accumulation, one rounding to bf16): x (..., K),
    weight (N, K) as nn.Linear keeps it, bias (N,) bf16 or None, all contiguous CUDA. x and weight bf16 (K a multiple
    of 8), or torch.float8_e4m3fn (K a multiple of 16) with scale_x and scale_weight, one float32 each: then
    y = scale_x·scale_weight·x·weightᵀ in bf16, as torch._scaled_mm. The kernel is this GPU's entry tuned for (N, K)
    at the M (rows of x) nearest this one's, compiled for this M on first use; an (N, K) tuned at no M is refused.
    bias is added to the sums in the kernel. cublas_where_faster: a bf16 product at an M whose serving entry's tune
    timed cuBLAS faster calls F.linear instead (dispatch.PEER_RULE), as a patched model does. gate="silu" (SwiGLU):
    weight's first N/2 rows are a gate projection's and the rest an up projection's (a fused gate_up
    weight), and the result (..., N/2) is silu(x·W_gateᵀ) ⊙ x·W_upᵀ from one kernel, the product never written (a
    bias is added before the gate). residual: a bf16 tensor of the result's shape added last, in the kernel (a
    layer's h + down(x)). An (N, K) with no entry of its own for the gate, bias or residual runs its plain entry's
    params."""
    if (is_eager(x, weight) and (bias is None or type(bias) is _Tensor) and (residual is None or type(residual) is _Tensor)
            and (scale_x is None or type(scale_x) is _Tensor) and (scale_weight is None or type(scale_weight) is _Tensor)):
        return _linear_impl(x, weight, bias, scale_x, scale_weight, cublas_where_faster, gate, residual)
    return _linear_op(x, weight, bias, scale_x, scale_weight, cublas_where_faster, gate, residual)


def patch(model: torch.nn.Module, gpu_name: str | None = None) -> Any:
    """Route `model`'s layers to mage-gen's kernels in place, where this GPU (gpu_name: another's tuned/ entries) has
    a tuned entry for them: bf16 nn.Linear to linear, RMSNorm and LayerNorm modules to rms_norm and layer_norm, each
    keeping its parameters and falling back to torch where the kernel cannot take an input; under torch.compile an add
    feeding such a norm becomes the fused residual form (an Inductor post-grad pass, installed here). Returns what was
    routed and what was left, with why (mage_gen.patch.Routes)."""
    from mage_gen.patch import patch_model

    return patch_model(model, gpu_name)
