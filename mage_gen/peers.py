"""What a generated kernel must beat, measured the way the kernel is: torch (cuBLAS for matmul) and a
Triton kernel written here (the `peers` extra). Each op names the builder here that makes its peers
(Op.peer_builder); make_peers gates each peer against the same float64 reference before it is timed. Without
torch there are simply no peers."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np

from mage_gen.dtypes import BFLOAT16, E4M3, FLOAT32, DType
from mage_gen.dtypes import dtype as element_type
from mage_gen.measure import TimedAlone, flush_bytes, hold, interleave, own_lines_only
from mage_gen.verdict import compare_outputs
from mage_gen.ops import Op

try:
    import torch
except ImportError:  # the core and the CPU tests never need it
    torch = None
try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None

TRITON_WARPS = (2, 4, 8, 16)
# The most bytes of a row the one-program-per-row Triton peer holds (Triton's own layer-norm tutorial stops at
# 64 KB): past it the block spills and its compile alone takes minutes.
TRITON_ROW_BYTES = 65536
# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages). An ieee fp32 tl.dot is CUDA-core FMAs, not tensor
# cores: 64-128 tiles with 32-64 accumulators a thread (ptxas, sm_90: 96-254 registers, no spills), BLOCK_K
# 16-32 so the 2-4 cp.async stages take 16-72 KB of shared memory, and 128×64 and 64×64 tiles so that a
# 1024² C is still 128-256 programs for 132 SMs.
TRITON_MATMUL_CONFIGS = (
    (128, 128, 32, 8, 3), (128, 128, 16, 8, 4), (128, 128, 32, 8, 2),
    (128, 64, 32, 4, 3), (128, 64, 16, 4, 4), (128, 64, 32, 8, 4),
    (64, 128, 32, 4, 3), (64, 128, 32, 8, 4),
    (64, 64, 32, 4, 4), (64, 64, 16, 4, 3),
)
TRITON_GROUP_M = 8  # tile rows per group: programs that run together share A and B tiles in L2

if triton is not None:

    @triton.jit
    def _triton_row(X, R, R_OUT, row, N, BLOCK: tl.constexpr, RESIDUAL: tl.constexpr):
        # A program's row as fp32, whatever the element type: x, or x + residual rounded to the activation type
        # and written to R_OUT first, as torch computes `x + residual`.
        cols = tl.arange(0, BLOCK)
        mask = cols < N
        x = tl.load(X + row * N + cols, mask=mask, other=0.0)
        if RESIDUAL:
            h = (x.to(tl.float32) + tl.load(R + row * N + cols, mask=mask, other=0.0).to(tl.float32)).to(x.dtype)
            tl.store(R_OUT + row * N + cols, h, mask=mask)
            x = h
        return x.to(tl.float32), cols, mask

    @triton.jit
    def triton_layernorm(X, Y, W, B, N, eps, R, R_OUT, BLOCK: tl.constexpr, RESIDUAL: tl.constexpr):
        # One program per row, the whole row in one block: the usual Triton layer norm, fp32 statistics.
        row = tl.program_id(0)
        x, cols, mask = _triton_row(X, R, R_OUT, row, N, BLOCK, RESIDUAL)
        mean = tl.sum(x, axis=0) / N
        diff = tl.where(mask, x - mean, 0.0)
        rstd = 1.0 / tl.sqrt(tl.sum(diff * diff, axis=0) / N + eps)
        w = tl.load(W + cols, mask=mask).to(tl.float32)
        b = tl.load(B + cols, mask=mask).to(tl.float32)
        tl.store(Y + row * N + cols, (diff * rstd * w + b).to(Y.dtype.element_ty), mask=mask)

    @triton.jit
    def triton_rmsnorm(X, Y, W, N, eps, R, R_OUT, BLOCK: tl.constexpr, RESIDUAL: tl.constexpr):
        # One program per row, as the layer norm: the mean of squares, no mean subtracted, no bias.
        row = tl.program_id(0)
        x, cols, mask = _triton_row(X, R, R_OUT, row, N, BLOCK, RESIDUAL)
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / N + eps)
        w = tl.load(W + cols, mask=mask).to(tl.float32)
        tl.store(Y + row * N + cols, (x * rstd * w).to(Y.dtype.element_ty), mask=mask)

    @triton.jit
    def _triton_matmul(A, B, C, M, N, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       GROUP_M: tl.constexpr, PRECISION: tl.constexpr):
        # C = A·B, all row-major; one BLOCK_M×BLOCK_N tile of C per program, fp32 sums; PRECISION is tl.dot's
        # input_precision for fp32 tiles ("ieee": fp32 products, no TF32; "tf32"; "tf32x3"), None for bf16
        # tiles. Programs take tiles GROUP_M tile rows at a time, column by column.
        pid = tl.program_id(0)
        per_group = GROUP_M * tl.cdiv(N, BLOCK_N)
        first = (pid // per_group) * GROUP_M  # the group's first tile row
        group_rows = tl.minimum(tl.cdiv(M, BLOCK_M) - first, GROUP_M)  # the last group may have fewer
        within = pid % per_group
        rows = (first + within % group_rows) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = (within // group_rows) * BLOCK_N + tl.arange(0, BLOCK_N)
        ks = tl.arange(0, BLOCK_K)
        a = A + rows[:, None] * K + ks[None, :]
        b = B + ks[:, None] * N + cols[None, :]
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k_in = ks < K - k0  # the K tail reads zeros, which add nothing
            a_tile = tl.load(a, mask=(rows[:, None] < M) & k_in[None, :], other=0.0)
            b_tile = tl.load(b, mask=k_in[:, None] & (cols[None, :] < N), other=0.0)
            acc = tl.dot(a_tile, b_tile, acc, input_precision=PRECISION)
            a += BLOCK_K
            b += BLOCK_K * N
        tl.store(C + rows[:, None] * N + cols[None, :], acc, mask=(rows[:, None] < M) & (cols[None, :] < N))

    @triton.jit
    def _triton_matmul_strided(A, B, C, M, N, K, LD, SBK, SBN, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                               BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
        # C = A·B, A M×K with rows LD elements apart, B's element (k, n) at k·SBK + n·SBN (an N×K B: SBK 1), C M×N
        # contiguous (its element type C's); fp32 sums; tiles GROUP_M tile rows at a time, as _triton_matmul
        pid = tl.program_id(0)
        per_group = GROUP_M * tl.cdiv(N, BLOCK_N)
        first = (pid // per_group) * GROUP_M
        group_rows = tl.minimum(tl.cdiv(M, BLOCK_M) - first, GROUP_M)
        within = pid % per_group
        rows = (first + within % group_rows) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = (within // group_rows) * BLOCK_N + tl.arange(0, BLOCK_N)
        ks = tl.arange(0, BLOCK_K)
        a = A + rows[:, None] * LD + ks[None, :]
        b = B + cols[None, :] * SBN + ks[:, None] * SBK
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k_in = ks < K - k0
            a_tile = tl.load(a, mask=(rows[:, None] < M) & k_in[None, :], other=0.0)
            b_tile = tl.load(b, mask=k_in[:, None] & (cols[None, :] < N), other=0.0)
            acc = tl.dot(a_tile, b_tile, acc)
            a += BLOCK_K
            b += BLOCK_K * SBK
        tl.store(C + rows[:, None] * N + cols[None, :], acc.to(C.dtype.element_ty),
                 mask=(rows[:, None] < M) & (cols[None, :] < N))

    @triton.jit
    def _triton_gemm_epilogue(P, BIAS, R, C, COLS, P_STRIDE, UP_AT, BLOCK: tl.constexpr, HAS_BIAS: tl.constexpr,
                              GATE: tl.constexpr, RESIDUAL: tl.constexpr):
        # C = silu(P + bias) · (P_up + bias_up) + R over a product P (rows P_STRIDE apart, the up half UP_AT columns
        # on), each part where its flag says, in fp32, one pass: what Inductor makes of the pointwise work after a
        # cuBLAS product. One program per BLOCK columns of a row.
        row = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        inside = cols < COLS
        g = tl.load(P + row * P_STRIDE + cols, mask=inside).to(tl.float32)
        if HAS_BIAS:
            g += tl.load(BIAS + cols, mask=inside).to(tl.float32)
        if GATE:
            u = tl.load(P + row * P_STRIDE + UP_AT + cols, mask=inside).to(tl.float32)
            if HAS_BIAS:
                u += tl.load(BIAS + UP_AT + cols, mask=inside).to(tl.float32)
            g = g * tl.sigmoid(g) * u
        if RESIDUAL:
            g += tl.load(R + row * COLS + cols, mask=inside).to(tl.float32)
        tl.store(C + row * COLS + cols, g.to(C.dtype.element_ty), mask=inside)


class TorchSubject(TimedAlone):
    """A callable that enqueues work on torch's current stream, timed like a generated kernel."""

    def __init__(self, name: str, run: Callable[[], Any], config: dict[str, Any] | None = None):
        self.name, self.run, self.config = name, run, config or {}
        self._graph = None
        self._launches = 0  # in the graph captured
        self._begin = torch.cuda.Event(enable_timing=True)
        self._end = torch.cuda.Event(enable_timing=True)

    def _hot(self, replays: int, launches: int) -> list[float]:
        if self._graph is not None and self._launches != launches:
            self._graph = None  # its memory pool goes with it
        if self._graph is None:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # warm-up off the default stream, as graph capture requires
                for _ in range(3):
                    self.run()
            torch.cuda.current_stream().wait_stream(side)
            self._graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self._graph):
                for _ in range(launches):
                    self.run()
            self._launches = launches
        own_lines_only()
        self._graph.replay()  # warm-up, as a generated kernel's
        # as a generated kernel is timed (measure.KernelSubject): the replays back to back behind a hold
        events = [torch.cuda.Event(enable_timing=True) for _ in range(replays + 1)]
        hold(torch.cuda.current_stream().cuda_stream)
        for i in range(replays):
            events[i].record()
            self._graph.replay()
        events[replays].record()
        events[replays].synchronize()
        return [a.elapsed_time(b) * 1000.0 / launches for a, b in zip(events, events[1:])]

    def _cold(self, count: int) -> list[float]:
        flush = torch_flush_buffer()
        samples = []
        for _ in range(count):
            own_lines_only()
            hold(torch.cuda.current_stream().cuda_stream)
            flush.zero_()
            self._begin.record()
            self.run()
            self._end.record()
            self._end.synchronize()
            samples.append(self._begin.elapsed_time(self._end) * 1000.0)
        return samples

    def close(self) -> None:
        self._graph = None


_FLUSH: list = []


def torch_flush_buffer():
    if not _FLUSH:
        _FLUSH.append(torch.empty(flush_bytes() // 4, dtype=torch.int32, device="cuda"))
    return _FLUSH[0]


def to_torch(array: np.ndarray, dtype: DType) -> Any:
    """A host array in its element type's storage (dtypes: bf16 as uint16 bits) as a CUDA tensor of that type."""
    if dtype.name == "bfloat16":
        return torch.from_numpy(np.ascontiguousarray(array).view(np.int16)).cuda().view(torch.bfloat16)
    return torch.from_numpy(np.ascontiguousarray(array)).cuda()


class _DeviceArray:
    """Device memory owned elsewhere, as torch.as_tensor reads it in place (the CUDA array interface)."""

    def __init__(self, pointer: int, shape: tuple[int, ...], typestr: str):
        self.__cuda_array_interface__ = {"shape": shape, "typestr": typestr, "data": (pointer, False),
                                         "version": 3, "strides": None}


def on_gpu(pointer: int, shape: tuple[int, ...], dtype: DType) -> Any:
    """A CUDA tensor of dtype over device memory that stays its owner's: no copy, freed by the owner."""
    if dtype.name == "bfloat16":  # the array interface has no bf16: its bits as int16, viewed
        return torch.as_tensor(_DeviceArray(pointer, shape, "<i2"), device="cuda").view(torch.bfloat16)
    typestr = np.dtype(dtype.storage).newbyteorder("<").str
    return torch.as_tensor(_DeviceArray(pointer, shape, typestr), device="cuda")


def eager_norm(torch_fn: str, d: int, eps: float) -> Callable[..., Any]:
    """torch's norm as a model calls it: (x, residual, *weights) -> y, or, with a residual, (y, x + residual)."""
    norm = getattr(torch.nn.functional, torch_fn.removeprefix("F."))

    def eager(x, residual, *weights):
        if residual is None:
            return norm(x, (d,), *weights, eps)
        h = x + residual
        return norm(h, (d,), *weights, eps), h
    return eager


def eager_norm_into(eager: Callable[..., Any]) -> Callable[..., Any]:
    """(x, residual, y_out, r_out, *weights): eager's results copied where the kernel writes its own, the form
    Inductor compiles: it stores them there from its one fused kernel. Left to allocate y, it wrote elsewhere, and
    where y lies moved its time by 0.3-1.8% against the same kernel writing the kernel's y (bench/NOTES.md,
    norms §19)."""
    def eager_into(x, residual, y_out, r_out, *weights):
        got = eager(x, residual, *weights)
        if residual is None:
            return y_out.copy_(got)
        return y_out.copy_(got[0]), r_out.copy_(got[1])
    return eager_into


def row_norm_peers(shape: Any, inputs: dict[str, np.ndarray], eps: float, inductor: bool,
                   tensor_of: Callable[[str, DType], Any], output_of: _Outputs, *, torch_fn: str,
                   triton_kernel: str) -> dict[str, list[TorchSubject] | str]:
    """torch's norm `torch_fn` as a model calls it (`x + residual` first, in the residual form), the same code
    compiled by Inductor, and the Triton kernel of this module named `triton_kernel` (one program per row) at each
    num_warps, writing where output_of says. Each returns y, or (y, residual_out). A family that cannot run this
    shape is the reason why, in place of its subjects."""
    tensors = {name: tensor_of(name, element_type(shape.weight_dtype if name in ("w", "b") else shape.dtype))
               for name in inputs}
    x, residual = tensors["x"], tensors.get("residual")
    m, d = x.shape
    weights = [tensors[k] for k in ("w", "b") if k in tensors]
    eager = eager_norm(torch_fn, d, eps)
    candidates = {"torch": [TorchSubject("torch", lambda: eager(x, residual, *weights),
                                         {"fn": torch_fn + (" of x + residual" if residual is not None else ""),
                                          "weights": str(weights[0].dtype)})]}
    if inductor:
        # Dynamo keys its cache on the code object, shared by every shape: without a reset, the ninth shape in a
        # process would hit its recompile limit
        torch._dynamo.reset()
        y_out = output_of("y", x.shape, x.dtype)
        r_out = output_of("residual_out", x.shape, x.dtype) if residual is not None else None
        compiled = torch.compile(eager_norm_into(eager), dynamic=False, fullgraph=True)
        candidates["inductor"] = [TorchSubject("inductor", lambda: compiled(x, residual, y_out, r_out, *weights),
                                               {"fn": f"torch.compile of the eager {torch_fn}",
                                                "outputs": output_of.where("y", x.shape, x.dtype)})]
    if triton is not None and triton.next_power_of_2(d) * x.element_size() > TRITON_ROW_BYTES:
        candidates["triton"] = (f"a row of {d} {x.dtype} is more than the {TRITON_ROW_BYTES} bytes one Triton "
                                "program holds")
    elif triton is not None:
        block = triton.next_power_of_2(d)
        kernel = globals()[triton_kernel]

        def triton_run(warps: int) -> Callable[[], Any]:
            y = output_of("y", x.shape, x.dtype)
            out = output_of("residual_out", x.shape, x.dtype) if residual is not None else None

            def go():
                kernel[(m,)](x, y, *weights, d, eps, residual if out is not None else x,
                             out if out is not None else y, BLOCK=block, RESIDUAL=out is not None, num_warps=warps)
                return y if out is None else (y, out)
            return go

        candidates["triton"] = [TorchSubject(f"triton/w{warps}", triton_run(warps),
                                             {"num_warps": warps, "BLOCK": block, "outputs": output_of.where("y", x.shape, x.dtype)})
                                for warps in TRITON_WARPS]
    return candidates


def fp32_matmul_peers(shape: Any, inputs: dict[str, np.ndarray], eps: float, inductor: bool,
                      tensor_of: Callable[[str, DType], Any], output_of: _Outputs) -> dict[str, list[TorchSubject]]:
    # mage-gen's matmul kernels do exact fp32 FMAs, so cuBLAS must too: TF32 (about 3e-4 relative error,
    # which the op's 1e-4 tolerance refuses) is off for every call made from here on.
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    a, b = (tensor_of(name, FLOAT32) for name in ("A", "B"))
    (m, k), n = a.shape, b.shape[1]

    def output():
        return output_of("C", (m, n), torch.float32)

    def cublas_run(c):  # into a preallocated c, so a CUDA graph can capture it
        def go():
            torch.matmul(a, b, out=c)
            return c
        return go

    candidates = {"cublas": [TorchSubject("cublas", cublas_run(output()),
                                          {"fn": "torch.matmul", "float32_matmul_precision": "highest"})]}
    if triton is not None:
        def triton_run(c, bm, bn, bk, warps, stages):
            grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn),)

            def go():
                _triton_matmul[grid](a, b, c, m, n, k, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=TRITON_GROUP_M,
                                     PRECISION="ieee", num_warps=warps, num_stages=stages)
                return c
            return go

        candidates["triton"] = [
            TorchSubject(f"triton/{bm}x{bn}x{bk}w{warps}s{stages}", triton_run(output(), bm, bn, bk, warps, stages),
                         {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": TRITON_GROUP_M,
                          "num_warps": warps, "num_stages": stages, "input_precision": "ieee"})
            for bm, bn, bk, warps, stages in TRITON_MATMUL_CONFIGS]
    return candidates


# Triton tile configs for the tensor-core peers: (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages)
TRITON_TC_CONFIGS = ((128, 128, 32, 4, 4), (128, 256, 64, 8, 3), (128, 128, 64, 8, 4), (64, 128, 32, 4, 4),
                     (128, 64, 32, 4, 4), (64, 64, 32, 4, 4))
# What cuBLAS and Triton are asked for at each precision of a tensor-core matmul: (allow TF32 in cuBLAS, tl.dot's
# input_precision)
_TC_PEER_MODES = {"bf16": (False, None), "tf32": (True, "tf32"), "fp32x3": (False, "tf32x3")}


def tensor_core_matmul_peers(shape: Any, inputs: dict[str, np.ndarray], eps: float, inductor: bool,
                             tensor_of: Callable[[str, DType], Any],
                             output_of: _Outputs) -> dict[str, list[TorchSubject]]:
    """cuBLAS through torch at the same precision (bf16 inputs with an fp32 C, and as torch.matmul gives it, a
    bf16 C; tf32 with allow_tf32; for fp32x3, SGEMM with TF32 off: the FP32 result it must match) and Triton's
    tl.dot at the same precision (fp32 accumulation and C)."""
    allow_tf32, precision = _TC_PEER_MODES[shape.precision]
    element = BFLOAT16 if shape.precision == "bf16" else FLOAT32
    a, b = (tensor_of(name, element) for name in ("A", "B"))
    (m, k), n = a.shape, b.shape[1]

    def output(dtype=torch.float32):
        return output_of("C", (m, n), dtype)

    def cublas_run(c, out_dtype=None):
        def go():
            # the flag is read when the call picks its kernel (at capture, in a CUDA graph): set for this call only
            before = torch.backends.cuda.matmul.allow_tf32
            torch.backends.cuda.matmul.allow_tf32 = allow_tf32
            try:
                if out_dtype is None:
                    torch.matmul(a, b, out=c)
                else:
                    torch.mm(a, b, out_dtype, out=c)
            finally:
                torch.backends.cuda.matmul.allow_tf32 = before
            return c
        return go

    cublas = [TorchSubject("cublas/" + shape.precision, cublas_run(output()),
                           {"fn": "torch.matmul", "allow_tf32": allow_tf32})]
    if shape.precision == "bf16":
        cublas = [TorchSubject("cublas/bf16-fp32-out", cublas_run(output(), torch.float32),
                               {"fn": "torch.mm(a, b, torch.float32)", "C": "float32"}),
                  TorchSubject("cublas/bf16-bf16-out", cublas_run(output(torch.bfloat16)),
                               {"fn": "torch.matmul", "C": "bfloat16 (rounded once, as torch returns it)"})]
    candidates = {"cublas": cublas}
    if triton is not None:
        def triton_run(c, bm, bn, bk, warps, stages):
            grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn),)

            def go():
                _triton_matmul[grid](a, b, c, m, n, k, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=TRITON_GROUP_M,
                                     PRECISION=precision, num_warps=warps, num_stages=stages)
                return c
            return go

        candidates["triton"] = [
            TorchSubject(f"triton/{bm}x{bn}x{bk}w{warps}s{stages}", triton_run(output(), bm, bn, bk, warps, stages),
                         {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": TRITON_GROUP_M,
                          "num_warps": warps, "num_stages": stages, "input_precision": precision or "bf16"})
            for bm, bn, bk, warps, stages in TRITON_TC_CONFIGS]
    return candidates


# Triton's Hopper tiles for bf16 (wgmma): (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages), after Triton's own
# matmul tutorial's sm_90 configs
TRITON_SM90_CONFIGS = ((128, 256, 64, 8, 3), (128, 128, 64, 4, 4), (128, 128, 64, 8, 4), (256, 128, 64, 8, 3),
                       (128, 256, 64, 8, 4), (64, 256, 64, 4, 4), (128, 64, 64, 4, 4), (64, 128, 64, 4, 4))


def strided_bf16_gemm_peers(shape: Any, inputs: dict[str, np.ndarray], eps: float, inductor: bool,
                            tensor_of: Callable[[str, DType], Any],
                            output_of: _Outputs) -> dict[str, list[TorchSubject]]:
    """cuBLAS through torch (C = A·Bᵀ as F.linear computes it, or A·B for a K×N B: bf16 A and B, fp32 sums, C in C's
    type) and Triton's tl.dot over its Hopper tiles, each reading the same A and B (their padded rows) and writing
    C's type. e4m3: torch._scaled_mm (cuBLASLt) with the per-tensor scales, with and without fast accumulation. With
    an epilogue (a bias, the gate, a residual): cuBLAS's product into a tensor of its own, then the rest in one
    pass (_epilogue_peers)."""
    if shape.gate != "none" or shape.bias or shape.residual:
        return _epilogue_peers(shape, tensor_of, output_of)
    return _product_peers(shape, tensor_of, output_of, triton_too=True)


def _product_peers(shape: Any, tensor_of: Callable[[str, DType], Any], output_of: _Outputs,
                   triton_too: bool) -> dict[str, Any]:
    """The plain product's peers: cuBLAS (torch._scaled_mm for e4m3) and, where triton_too, Triton's tiles."""
    if shape.precision != "bf16":
        return _scaled_mm_peers(shape, tensor_of, output_of)
    a_rows, b_rows = (tensor_of(name, BFLOAT16) for name in ("A", "B"))
    a = a_rows[:, :shape.k]
    nk = shape.b_layout == "nk"
    b = b_rows[:, :shape.k].t() if nk else b_rows[:, :shape.n]  # K×N either way, as a view
    b_strides = (1, b_rows.stride(0)) if nk else (b_rows.stride(0), 1)  # of (k, n)
    out_type = torch.bfloat16 if shape.c_dtype == "bf16" else torch.float32

    def cublas_run(c):
        def go():
            if out_type == torch.bfloat16:
                torch.matmul(a, b, out=c)
            else:
                torch.mm(a, b, torch.float32, out=c)
            return c
        return go

    product = "torch.matmul(A, B.t())" if nk else "torch.matmul(A, B)"
    candidates = {"cublas": [TorchSubject("cublas", cublas_run(output_of("C", (shape.m, shape.n), out_type)),
                                          {"fn": product if out_type == torch.bfloat16
                                                 else product.replace("matmul", "mm").replace(")", ", torch.float32)")})]}
    if triton is not None and triton_too:
        def triton_run(c, bm, bn, bk, warps, stages):
            grid = (triton.cdiv(shape.m, bm) * triton.cdiv(shape.n, bn),)

            def go():
                _triton_matmul_strided[grid](a_rows, b_rows, c, shape.m, shape.n, shape.k, a_rows.stride(0), *b_strides,
                                             BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=TRITON_GROUP_M,
                                             num_warps=warps, num_stages=stages)
                return c
            return go

        candidates["triton"] = [
            TorchSubject(f"triton/{bm}x{bn}x{bk}w{warps}s{stages}",
                         triton_run(output_of("C", (shape.m, shape.n), out_type), bm, bn, bk, warps, stages),
                         {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": TRITON_GROUP_M,
                          "num_warps": warps, "num_stages": stages})
            for bm, bn, bk, warps, stages in TRITON_SM90_CONFIGS]
    return candidates


def _epilogue_peers(shape: Any, tensor_of: Callable[[str, DType], Any], output_of: _Outputs) -> dict[str, Any]:
    """cuBLAS's plain product (each candidate writing a product of its own, rounded to C's type as torch's is), then
    the rest into C: + bias, C = silu(P[:, :N/2]) · P[:, N/2:], + residual, in one Triton pass (as Inductor fuses
    that pointwise work), or where Triton is missing by torch's ops in turn."""
    plain = dataclasses.replace(shape, gate="none", bias=False, residual=False)
    own = _Outputs({})  # the product is not C: never the kernel's output memory
    families = _product_peers(plain, tensor_of, own, triton_too=False)
    out_type, out = (torch.bfloat16, BFLOAT16) if shape.c_dtype == "bf16" else (torch.float32, FLOAT32)
    c = output_of("C", (shape.m, shape.c_cols), out_type)
    half = shape.c_cols
    bias = tensor_of("bias", out) if shape.bias else None
    residual = tensor_of("residual", out) if shape.residual else None
    gated = shape.gate == "silu"
    if triton is not None:
        block = 1024
        grid = (shape.m, triton.cdiv(half, block))

        def rest(p: Any) -> Any:
            _triton_gemm_epilogue[grid](p, bias if bias is not None else p, residual if residual is not None else p, c,
                                        half, p.stride(0), half, BLOCK=block, HAS_BIAS=bias is not None, GATE=gated,
                                        RESIDUAL=residual is not None)
            return c
        then = "one Triton pass: + bias, silu(gate) · up, + residual"
    else:
        def rest(p: Any) -> Any:
            p = p + bias if bias is not None else p
            p = torch.nn.functional.silu(p[:, :half]) * p[:, half:] if gated else p
            return c.copy_(p + residual if residual is not None else p)
        then = "torch: + bias, F.silu(P[:, :N/2]) * P[:, N/2:], + residual"

    def finished(subject: TorchSubject) -> TorchSubject:
        return TorchSubject(subject.name, lambda: rest(subject.run()), {**subject.config, "then": then})

    return {"cublas": [finished(s) for s in families["cublas"]],
            "triton": "no Triton product with this epilogue among the peers (cuBLAS's product is followed by Triton's "
                      "pass)"}


def _scaled_mm_peers(shape: Any, tensor_of: Callable[[str, DType], Any], output_of: _Outputs) -> dict[str, Any]:
    """C = scale_a·scale_b·A·Bᵀ by torch._scaled_mm (cuBLASLt: the family cublas, as for bf16) over the same e4m3 A
    and B (their padded rows: A row-major, B read as a column-major K×N), fast accumulation on (the tensor cores' own
    sums, as ours) and off, the faster one kept."""
    a = tensor_of("A", E4M3).view(torch.float8_e4m3fn)[:, :shape.k]
    b = tensor_of("B", E4M3).view(torch.float8_e4m3fn)[:, :shape.k].t()
    scale_a, scale_b = (tensor_of(name, FLOAT32) for name in ("scale_a", "scale_b"))
    if shape.precision == "e4m3":
        scale_a, scale_b = scale_a.reshape(()), scale_b.reshape(())
    else:  # block scales as _scaled_mm takes them for a K×N B: (M, K/128) and (K/128, N/128); a torch without them
        scale_b = scale_b.t()  # fails the run, and the peer is reported missing
    out_type = torch.bfloat16 if shape.c_dtype == "bf16" else torch.float32

    def run(c, fast: bool):
        def go():
            return torch.ops.aten._scaled_mm.out(a, b, scale_a, scale_b, out_dtype=out_type, use_fast_accum=fast,
                                                 out=c)
        return go

    return {"cublas": [TorchSubject(f"scaled_mm/{'fast' if fast else 'exact'}",
                                       run(output_of("C", (shape.m, shape.n), out_type), fast),
                                       {"fn": "torch._scaled_mm(A, B.t(), scale_a, scale_b)", "use_fast_accum": fast})
                          for fast in (True, False)],
            "triton": "no e4m3 kernel among the peers"}


class _Outputs:
    """Where a peer handed its output writes it: the caller's memory (make_peers' device_outputs, the very
    output a kernel in the same bench writes, so that both are timed writing the same memory) where the name,
    shape and dtype match, or else a tensor of its own, one per candidate. Either is NaN until written, so a
    row or tile a peer skips fails the gate."""

    def __init__(self, shared: dict[str, Any]):
        self.shared = shared

    def __call__(self, name: str, shape: tuple[int, ...], dtype: Any) -> Any:
        held = self._held(name, shape, dtype)
        return held if held is not None else torch.full(shape, float("nan"), dtype=dtype, device="cuda")

    def where(self, name: str, shape: tuple[int, ...], dtype: Any) -> str:
        return "a tensor of its own" if self._held(name, shape, dtype) is None else "the kernel's own, shared"

    def _held(self, name: str, shape: tuple[int, ...], dtype: Any) -> Any:
        held = self.shared.get(name)
        return held if held is not None and tuple(held.shape) == tuple(shape) and held.dtype == dtype else None

    def poison(self) -> None:
        for held in self.shared.values():
            held.fill_(float("nan"))


def make_peers(op: Op, shape: Any, run: dict[str, int], inputs: dict[str, np.ndarray],
               reference: dict[str, np.ndarray] | None, pick_replays: int = 10,
               check: Callable[[str, Any], tuple[float, str]] | None = None,
               inductor: bool = False, device_inputs: dict[str, int] | None = None,
               device_outputs: dict[str, int] | None = None) -> tuple[list[TorchSubject], dict[str, str]]:
    """The op's peers, each gated on `inputs` (every output: a peer returns them in the op's order); of a
    family with configs (Triton's num_warps) the fastest hot. check(output name, tensor) -> (error, reason)
    judges on the GPU where the reference is held there (measure.DeviceReference); otherwise `reference` is
    compared on the CPU. inductor: also torch.compile of the eager code (norms; compiling takes seconds per
    shape). device_inputs: where `inputs` already are on the GPU (a pointer each, kept alive by the caller),
    read there rather than copied, so that the peers read the very memory a kernel sharing them reads.
    device_outputs: where a kernel writes its outputs (a pointer each, to the output's elements), written by
    every peer that is handed its output (Triton's, Inductor's, cuBLAS): where an output lies moves a DRAM-bound
    kernel's time by percents (bench/NOTES.md, norms §15, §19), so those peers are timed writing the same memory
    as the kernel; torch's eager norms allocate their own. Each is poisoned with NaN before every peer's gate.
    Returns (peers, {name: why it is missing})."""
    if torch is None or not torch.cuda.is_available():
        return [], {"torch": "torch with CUDA is not installed here (pip install 'mage-gen[peers]')"}
    if op.peer_builder is None:
        return [], {"peers": f"no peers are written for {op.name}"}
    missing: dict[str, str] = {} if triton is not None else {"triton": "triton is not installed"}
    scalars = op.scalars(shape, run)
    chosen = []
    names = list(op.output_shapes(shape, run))

    def tensor_of(name: str, dtype: DType) -> Any:
        if device_inputs is not None and name in device_inputs:
            return on_gpu(device_inputs[name], inputs[name].shape, dtype)
        return to_torch(inputs[name], dtype)

    output_types = op.output_dtypes(shape)
    outputs = _Outputs({name: on_gpu(pointer, op.output_shapes(shape, run)[name], output_types[name])
                        for name, pointer in (device_outputs or {}).items()})
    candidates = op.peers(shape, inputs, float(scalars.get("eps", 0.0)), inductor, tensor_of, outputs)
    for family, subjects in candidates.items():
        if isinstance(subjects, str):
            missing[family] = subjects
            continue
        passing = []
        for subject in subjects:
            outputs.poison()
            try:
                out = subject.run()
                torch.cuda.synchronize()
            except Exception as exc:  # noqa: BLE001  (Inductor failing to compile is a missing peer, not a crash)
                missing[subject.name] = f"failed to run: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
                continue
            outs = dict(zip(names, out if isinstance(out, tuple) else (out,)))
            err, reason = 0.0, ""
            for name, tensor in outs.items():
                if check is not None:
                    e, why = check(name, tensor)
                else:
                    host = tensor.detach().cpu()
                    host = host.view(torch.int16).numpy().view(np.uint16) if host.dtype == torch.bfloat16 else host.numpy()
                    e, why = compare_outputs(op, shape, {name: host}, {name: reference[name]})
                err, reason = max(err, e), reason or why
            if not reason:
                subject.config["gate_error"] = err
                passing.append(subject)
            else:
                missing[subject.name] = f"failed the gate: {reason}"
        if not passing:
            continue
        if len(passing) > 1:
            timings = interleave(passing, "hot", rounds=2, per_round=pick_replays // 2 or 1)
            best = min(passing, key=lambda s: timings[s.name].median_us)
            best.config["picked_from"] = {s.name: round(timings[s.name].median_us, 3) for s in passing}
        else:
            best = passing[0]
        best.name = family
        chosen.append(best)
    return chosen, missing
