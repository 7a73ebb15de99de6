"""Tuned kernels called from a program, on raw device pointers: no torch needed.

    from mage_gen import runtime
    runtime.layer_norm(y, x, w, b, m=4096, d=768, eps=1e-5, stream=0)   # y, x, w, b: device addresses
    runtime.rms_norm(y, x, w, m=4096, d=4096, eps=1e-6, stream=0)
    runtime.gemm(c, a, b, m=16, n=4096, k=4096, stream=0)   # bf16 C = A·Bᵀ on Hopper, a tuned shape only

The kernel for a launch is this GPU's tuned entry for the shape, of the size class dispatch.RULE picks for
the run size; a shape with no entry of its own, of an op with class dims (gemm: M), runs the params of the entry
dispatch.CLASS_RULE picks, compiled for its sizes; a shape with neither compiles a default config (NVRTC, cached
on disk) and warns once (matmul and gemm refuse it instead).
A kernel is loaded once per CUDA context (the calling thread's current one; the device's primary context
where it has none) and launched on the stream given. Uses store, variants (compile) and gpu only: importing it costs
what a launch needs, never Optuna, the measuring code or the peers.
"""

from __future__ import annotations

import threading
import warnings
from collections import OrderedDict
from collections.abc import Sequence
from functools import lru_cache
from types import MappingProxyType
from typing import Any

import numpy as np

from mage_gen import dispatch, gpu
from mage_gen.census import Census, aligned_contract
from mage_gen.errors import ConfigError, LaunchError, NoGpuError, StoreError
from mage_gen.ops import OPS, Op, get_op
from mage_gen.ops.base import WORKING_KINDS, TensorMapSpec, launch_args, shape_dict, tensor_maps
from mage_gen.store import load_entry, load_winners, pick_winner, store_file, tuned_dirs, tuned_shapes
from mage_gen.variants import build

# Each op's default_candidates, by name, read-only: the ops declare them
DEFAULT_CANDIDATES = MappingProxyType({name: op.default_candidates for name, op in OPS.items()})
MAP_CACHE = 64  # encoded tensor maps a Prepared keeps, the least recently used dropped first
TMA_ALIGNMENT = 16  # bytes: where TMA needs a tensor's global address to start


class UntunedKernelWarning(UserWarning):
    """A launch runs a default config: nothing is tuned for its shape on this GPU."""


class Prepared:
    """One kernel's launch for one shape and run size, in one context: computed once, then each launch only
    checks the addresses, writes the argument values in place and enqueues. A kernel that takes TMA tensor maps
    (after its other arguments, by value) gets each encoded from the address of the tensor it maps: the shape is
    fixed, so only the address changes, and the bytes are kept by (map, address) for the next launch."""

    def __init__(self, op: Op, shape: Any, params: Any, run: dict[str, int], kernel: gpu.Kernel, census: Census,
                 cublas_faster: bool = False):
        geometry = op.geometry(shape, params, run)
        self.op_name = op.name
        self.cublas_faster = cublas_faster  # cuBLAS serves this launch where asked to (dispatch.PEER_RULE)
        self.arg_names = tuple(a.name for a in op.args(shape))
        pointers = [a.name for a in op.args(shape) if a.kind in ("in", "out")]
        if list(self.arg_names[:len(pointers)]) != pointers:
            raise ValueError(f"{op.name}: its tensor arguments must come before its scalars, got {self.arg_names}")
        # as the emitted header checks them: the contract's, raised to the widest access the kernel makes
        contract = aligned_contract(op.contract(shape, params), census)
        self._alignments = {name: int(t["alignment_bytes"]) for name, t in contract["tensors"].items() if name in pointers}
        self._pointer_count = len(pointers)
        maps = tensor_maps(op, shape, params)
        for spec in maps.values():  # the contract's alignment already; checked again as TMA's own need
            self._alignments[spec.tensor] = max(self._alignments[spec.tensor], TMA_ALIGNMENT)
        self._maps = tuple((name, spec, self.arg_names.index(spec.tensor)) for name, spec in maps.items())
        self._encoded: OrderedDict[tuple[str, int], bytes] = OrderedDict()
        self._alignment_mask = max(self._alignments.values(), default=1) - 1  # alignments are powers of two
        # buffers the kernel needs beside the caller's tensors (a split-K workspace and counters), each stream its own
        working = [a for a in launch_args(op, shape, params) if a.kind in WORKING_KINDS]
        self._working = tuple((a.kind, max(a.elements, 1) * np.dtype(a.dtype).itemsize) for a in working)
        self._working_by_stream: dict[int, tuple[gpu.Buffer, ...]] = {}
        self._working_in_graphs: list[tuple[gpu.Buffer, ...]] = []
        kinds = (["ptr" if a.kind in ("in", "out") else a.kind for a in op.args(shape)] + ["ptr"] * len(working)
                 + ["tmap"] * len(maps))
        self._launch = gpu.FixedLaunch(kernel, geometry.grid, geometry.block, geometry.dynamic_shared_bytes, kinds,
                                       geometry.cluster)
        self._lock = threading.Lock()  # the argument values are shared by every thread launching this kernel

    def launch(self, values: Sequence[int | float], stream: int) -> None:
        """values: every kernel argument in launch order (addresses for the tensors, which come first)."""
        for address in values[:self._pointer_count]:
            if not address or address & self._alignment_mask:  # the strictest alignment first, then each its own
                check_alignment(self.op_name, self._alignments, dict(zip(self.arg_names, values)))
        with self._lock:
            if self._working:
                values = [*values, *self._working_buffers(stream)]
            if self._maps:
                values = [*values, *(self._tensor_map(name, spec, values[at]) for name, spec, at in self._maps)]
            self._launch.launch(values, stream)

    def _working_buffers(self, stream: int) -> list[int]:
        """The addresses of this stream's working buffers, made on its first launch: a zeroed one (split K's
        counters, which each launch leaves zero) is cleared on the stream before that launch. Launches on one stream
        run in order, so they may share them; two streams may not. A graph being captured gets buffers of its own,
        kept as long as this launch is, and cleared at once on a stream beside the capture: a memset recorded into
        the graph would run before every replay, though every launch leaves the counters zero."""
        buffers = self._working_by_stream.get(stream)
        if buffers is None:
            in_graph = gpu.capturing(stream)
            with gpu.relaxed_capture():
                buffers = tuple(gpu.Buffer(nbytes) for _, nbytes in self._working)
                beside = gpu.Stream() if in_graph else None
                for (kind, _), buffer in zip(self._working, buffers):
                    if kind == "zeroed":
                        buffer.fill32(0, beside.handle if beside else stream)
                if beside:
                    beside.synchronize()
                    beside.destroy()
            if in_graph:
                self._working_in_graphs.append(buffers)
            else:
                self._working_by_stream[stream] = buffers
        return [buffer.ptr for buffer in buffers]

    def _tensor_map(self, name: str, spec: TensorMapSpec, address: int) -> bytes:
        """The map `name` encoded over `address`: from the cache, else by the driver (microseconds)."""
        key = (name, address)
        encoded = self._encoded.get(key)
        if encoded is None:
            encoded = self._encoded[key] = gpu.tensor_map(address, spec)
            while len(self._encoded) > MAP_CACHE:
                self._encoded.popitem(last=False)
        else:
            self._encoded.move_to_end(key)
        return encoded


_prepared: dict[tuple, Prepared] = {}
_modules: dict[tuple[int, str], gpu.Kernel] = {}  # (context, compile cache key) -> its loaded kernel
_warned: set[tuple] = set()


def layer_norm(y: int, x: int, w: int, b: int, m: int, d: int, eps: float = 1e-5, stream: int = 0, *,
               device: int = 0, dtype: str = "float32", weight_dtype: str | None = None,
               residual: int | None = None, residual_out: int | None = None) -> None:
    """y = (x − mean)·rstd·w + b over each of m rows of d elements; pointers are device addresses. dtype: of x
    and y (float32, bfloat16, float16); weight_dtype: of w and b (default: dtype). residual, residual_out:
    normalize x + residual and write it to residual_out. device: the GPU whose primary context is made
    current where the calling thread has no context."""
    _norm("layernorm", {"y": y, "x": x, "w": w, "b": b}, m, d, eps, stream, device, dtype, weight_dtype, residual,
          residual_out)


def rms_norm(y: int, x: int, w: int, m: int, d: int, eps: float = 1e-6, stream: int = 0, *, device: int = 0,
             dtype: str = "float32", weight_dtype: str | None = None, residual: int | None = None,
             residual_out: int | None = None) -> None:
    """y = x·rstd·w with rstd = 1/sqrt(mean(x²) + eps) over each of m rows of d elements; as layer_norm."""
    _norm("rmsnorm", {"y": y, "x": x, "w": w}, m, d, eps, stream, device, dtype, weight_dtype, residual,
          residual_out)


def _norm(op_name: str, pointers: dict[str, int], m: int, d: int, eps: float, stream: int, device: int, dtype: str,
          weight_dtype: str | None, residual: int | None, residual_out: int | None) -> None:
    if (residual is None) != (residual_out is None):
        raise LaunchError(f"{op_name}: give residual and residual_out together (x + residual is written to "
                          "residual_out), or neither")
    dims: dict[str, Any] = {"d": d}
    if dtype != "float32" or (weight_dtype or dtype) != "float32" or residual is not None:
        dims.update(dtype=dtype, weight_dtype=weight_dtype or dtype, residual=residual is not None)
    if residual is not None:
        pointers = {**pointers, "residual": residual, "residual_out": residual_out}
    launch(op_name, dims, {"m": m}, pointers, {"M": m, "eps": eps}, stream, device=device)


def matmul(c: int, a: int, b: int, m: int, n: int, k: int, stream: int = 0, *, device: int = 0) -> None:
    """C = A·B, float32 row-major, for an (m, n, k) tuned on this GPU; other shapes are refused."""
    launch("matmul", {"m": m, "n": n, "k": k}, {}, {"C": c, "A": a, "B": b}, {}, stream, device=device,
           tuned_only=True)


def gemm(c: int, a: int, b: int, m: int, n: int, k: int, stream: int = 0, *, device: int = 0,
         c_dtype: str = "bf16", b_layout: str = "nk", precision: str = "bf16", scale_a: int = 0,
         scale_b: int = 0, gate: str = "none", bias: int = 0, residual: int = 0) -> None:
    """C = A·Bᵀ (b_layout nk: B N×K, an nn.Linear weight) or C = A·B (kn: B K×N) on Hopper's tensor cores (op
    gemm_sm90): A (m×k) and B bfloat16, C (m×n) c_dtype (bf16 or fp32), all row-major, for an (n, k) tuned on this
    GPU at some M: the entry tuned at the nearest M (dispatch.CLASS_RULE) runs, compiled for this m (once; NVRTC
    caches it on disk); an (n, k) tuned at no M is refused. Rows of A and of B are K (a K×N B: N) elements rounded up
    to 16 bytes apart, C's n; A and B start on 16 bytes (TMA), C on its element pairs (16 bytes where the kernel
    stores C by TMA). precision e4m3: A and B fp8 (B N×K), C = scale_a·scale_b·A·Bᵀ with scale_a and scale_b the
    addresses of one fp32 each, as torch._scaled_mm; e4m3_block: of DeepGEMM's fp32 block scales, A's M × ⌈K/128⌉
    and B's ⌈N/128⌉ × ⌈K/128⌉, row-major. gate silu (B N×K): B's first n/2 rows are a gate's, the rest an up's,
    and C is m × n/2: silu(A·B_gateᵀ) ⊙ A·B_upᵀ (SwiGLU); with no entry of its own it runs the plain product's
    entry for (n, k). bias: the address of n elements of C's type added to the sums first (one per row of B);
    residual: of an m × (C's columns) tensor of C's type added last; 0: none. A split-K winner gets its workspace and counters from the
    runtime, one set per stream: launches on two streams at once never share them."""
    dims = {"m": m, "n": n, "k": k, "precision": precision, "c_dtype": c_dtype, "b_layout": b_layout, "gate": gate,
            "bias": bool(bias), "residual": bool(residual)}
    shape = _gemm_shape(m, n, k, precision, c_dtype, b_layout, gate, bool(bias), bool(residual))  # before the driver
    if not (a and b and c) or (a | b) % TMA_ALIGNMENT:
        check_alignment("gemm_sm90", {"C": 1, "A": TMA_ALIGNMENT, "B": TMA_ALIGNMENT}, {"C": c, "A": a, "B": b})
    pointers = {"C": c, "A": a, "B": b}
    if precision != "bf16":  # fp8 products are scaled, per tensor or per block
        check_alignment("gemm_sm90", {"scale_a": 4, "scale_b": 4}, {"scale_a": scale_a, "scale_b": scale_b})
        pointers.update(scale_a=scale_a, scale_b=scale_b)
    elif scale_a or scale_b:
        raise LaunchError(f"gemm_sm90: scale_a and scale_b multiply an e4m3 product; a {precision} one takes none")
    if bias:
        pointers["bias"] = bias
    if residual:
        pointers["residual"] = residual
    item, out = shape.element.itemsize, (4 if c_dtype == "fp32" else 2)
    c_bytes = m * shape.c_cols * out
    _check_disjoint(c, c_bytes, {"A": (a, _extent(m, k, shape.lda * item, item)),
                                 "B": (b, _extent(shape.b_rows, k if b_layout == "nk" else n, shape.ldb * item, item)),
                                 "bias": (bias, n * out), "residual": (residual, c_bytes)})
    launch("gemm_sm90", dims, {}, pointers, {}, stream, device=device, tuned_only=True)


def _extent(rows: int, cols: int, row_bytes: int, item: int) -> int:
    """Bytes a matrix of `item`-byte elements spans from its first element to past its last, rows `row_bytes` apart."""
    return (rows - 1) * row_bytes + cols * item


def _check_disjoint(c: int, c_bytes: int, inputs: dict[str, tuple[int, int]]) -> None:
    """C may not overlap an input ({name: (address, bytes)}; address 0: none): the kernel reads them while it writes
    C, and a tile would read what another wrote."""
    for name, (start, size) in inputs.items():
        if start and c < start + size and start < c + c_bytes:
            raise LaunchError(f"gemm_sm90: C [{c:#x}, {c + c_bytes:#x}) overlaps {name} [{start:#x}, "
                              f"{start + size:#x}); give C memory of its own")


@lru_cache(maxsize=256)
def _gemm_shape(m: int, n: int, k: int, precision: str, c_dtype: str, b_layout: str, gate: str, bias: bool,
                residual: bool) -> Any:
    """The op's shape, or a refusal of sizes, a precision, a C type or a B layout the kernel cannot take (checked
    once per shape: a refusal is not kept)."""
    try:
        return get_op("gemm_sm90").shape(m=m, n=n, k=k, precision=precision, c_dtype=c_dtype, b_layout=b_layout,
                                         gate=gate, bias=bias, residual=residual)
    except ConfigError as exc:
        raise LaunchError(f"gemm_sm90: {exc}") from None


def launch(op_name: str, dims: dict[str, Any], run: dict[str, int], pointers: dict[str, int],
           scalars: dict[str, int | float], stream: int = 0, *, device: int = 0, tuned_only: bool = False) -> None:
    """Launch op's kernel for this shape and run size on `stream` of the current context."""
    prepared = prepare(op_name, dims, run, device=device, tuned_only=tuned_only)
    prepared.launch([pointers[name] if name in pointers else scalars[name] for name in prepared.arg_names], stream)


def prepare(op_name: str, dims: dict[str, Any], run: dict[str, int], *, device: int = 0,
            tuned_only: bool = False) -> Prepared:
    """The launch for this shape and run size in the calling thread's current context (device `device`'s
    primary context where the thread has none): chosen, compiled and loaded on first use, then cached."""
    context = gpu.current_context()
    if not context:  # a thread with no context: the device's primary one, as torch and the runtime API use
        gpu.device_info(device)
        gpu.make_primary_current(device)
        context = gpu.current_context()
    key = (context, op_name, tuple(dims.items()), tuple(run.items()))
    prepared = _prepared.get(key)
    if prepared is None:
        prepared = _prepared[key] = _prepare(get_op(op_name), dims, run, context, tuned_only)
    return prepared


def check_alignment(op_name: str, alignments: dict[str, int], pointers: dict[str, int]) -> None:
    """Refuse a null or misaligned address before the launch: the kernel would fault or read the wrong words."""
    for name, align in alignments.items():
        address = pointers[name]
        if not address or address % align:
            raise LaunchError(f"{op_name}: {name} at {address:#x} is not a device address aligned to {align} bytes, "
                              "which this kernel's vector accesses need; pass a tensor that starts its storage, "
                              "or copy it (.clone())")


def _prepare(op: Op, dims: dict[str, Any], run: dict[str, int], context: int, tuned_only: bool) -> Prepared:
    try:
        shape = op.shape(**dims)
        if op.run_dims:
            op.check_run(run)
    except ConfigError as exc:
        raise LaunchError(f"{op.name}: {exc}") from None
    device = gpu.device_info(gpu.current_device())
    params, entry = choose(op, shape, run, device, tuned_only)
    try:  # for the target the op's instructions need (gemm_sm90: sm_90a), or refused where the GPU lacks them
        variant = build(op, shape, params, device.arch)
    except ConfigError as exc:
        raise LaunchError(f"{op.name}: {exc}") from None
    compiled = variant.compiled
    kernel = _modules.get((context, compiled.key))
    if kernel is None:
        kernel = _modules[(context, compiled.key)] = gpu.Kernel(
            compiled.cubin, compiled.kernel_name, op.geometry(shape, params, run).dynamic_shared_bytes)
    return Prepared(op, shape, params, run, kernel, variant.census,
                    cublas_faster=dispatch.cublas_serves(op, shape, entry))


def peer_serves(op_name: str, dims: dict[str, Any], device: int) -> bool:
    """Whether the tuned/ entry that serves this shape on `device` timed its peer faster (dispatch.PEER_RULE), read
    without compiling a kernel; False where no entry serves it (a launch would raise) or no GPU answers."""
    op = get_op(op_name)
    try:
        shape = op.shape(**dims)
        _, entry = choose(op, shape, {}, gpu.device_info(device), tuned_only=True)
    except (ConfigError, LaunchError, NoGpuError):
        return False
    return dispatch.cublas_serves(op, shape, entry)


def choose(op: Op, shape: Any, run: dict[str, int], device: gpu.DeviceInfo,
           tuned_only: bool) -> tuple[Any, dict[str, Any] | None]:
    """(params, the tuned/ entry they come from) of the tuned class dispatch.RULE picks; for a shape with no entry of
    its own, of the entry dispatch.CLASS_RULE picks where the op has class dims; else a default config's, with no
    entry (warned about once)."""
    why = ""
    for folder in tuned_dirs():
        if not store_file(op.name, device.name, folder).exists():
            continue
        try:
            winners = load_winners(op, shape, device.name, folder)
        except StoreError as exc:
            why = str(exc)
            served = dispatch.choose_class(op, shape, tuned_shapes(op, device.name, folder))
            if served is not None:
                return served[1], load_entry(op.name, device.name, op.shape_key(served[0]), directory=folder)
            continue
        winner = pick_winner(op, shape, winners, run, device.l2_bytes)
        return winner.params, winner.entry
    if tuned_only and op.class_dims:
        from mage_gen.emit import shape_arguments  # only on this error: the runtime imports what a launch needs

        fixed = ", ".join(f"{k}={v}" for k, v in shape_dict(shape).items() if k not in op.class_dims)
        classes = "/".join(op.class_dims).upper()
        raise LaunchError(f"{op.name}: nothing is tuned for {fixed} at any {classes} on {device.name}; tune it, e.g. "
                          f"`mage-gen tune {op.name} {shape_arguments(shape, every_field=False)}` (each {classes} "
                          f"tuned also serves the {classes}s nearest it)")
    if tuned_only:
        raise LaunchError(f"{op.name}: no tuned kernel for {shape_dict(shape)} on {device.name} "
                          f"({why or 'none in ' + ', '.join(map(str, tuned_dirs()))}); tune it with mage-gen tune")
    params = _default_params(op, shape)
    if (op.name, shape) not in _warned:
        _warned.add((op.name, shape))
        warnings.warn(f"mage-gen: no tuned {op.name} kernel for {shape_dict(shape)} on {device.name} "
                      f"({why or 'none stored'}); running the default config {op.params_to_dict(params)}, "
                      "compiled once and cached: tune it for a measured winner", UntunedKernelWarning, stacklevel=5)
    return params, None


def _default_params(op: Op, shape: Any) -> Any:
    for values in op.default_candidates:
        params = op.params_from_dict({**op.defaults(shape), **values})
        try:
            op.validate(shape, params)
        except ConfigError:
            continue
        return params
    raise LaunchError(f"{op.name}: no default config is valid for {shape_dict(shape)}; tune it with mage-gen tune")
