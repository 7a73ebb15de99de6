"""Matrix product, fp32 with fused multiply-adds (never TF32): C = A·B, row-major, A M×K, B K×N.

M, N and K are fixed when the kernel is generated; tails (sizes that are not multiples of the tile)
are handled by zero-filled copies and guarded stores. One template, `tiled`: a BM×BN block tile
walked along K in BK steps through `buffers` shared-memory stages filled by cp.async, each thread
accumulating a TM×TN tile of C in registers. A warp is lanes_m × 32/lanes_m threads over its warp tile;
with `split` each thread's tile is 4×4 fragments spread over the warp tile, so that neighbouring lanes
read neighbouring float4s of shared memory.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from mage_gen.dtypes import FLOAT32, DType
from mage_gen.errors import ConfigError
from mage_gen.ops.base import (Arg, LazyFunction, Rule, TiledProduct, params_dict, params_from, product64,
                               public_params_from, register_cap)
from mage_gen.render import Source, render

MAX_SHARED_BYTES = 227 * 1024  # the opt-in limit per block on sm_90; smaller GPUs refuse at launch
MAX_DIM = 1 << 16
MAX_THREADS = 256
A_LAYOUTS = ("transposed", "direct")
LANES_M = (1, 2, 4, 8)
COPY_WIDTHS = (4, 8, 16)
THREAD_TILE = (4, 8, 16)  # shared memory is read in float4s: whole fragments of 4
SYNCS = ("two", "one")
PLANTED_BUGS = ("", "offset_units", "last_tile_parity")  # test-only: the gate must reject both
_HIDDEN = frozenset({"plant"})  # in no search space and no stored winner
# Fitted to ptxas 13.0 over random configs at 1000³ and 1024³ (none admitted spilled). With tails, ptxas keeps
# each copy's address and bounds in registers across the K loop (6 per copy covered 360 configs); without, every
# copy is a constant offset from two pointers and the rest of the kernel took at most 88 beyond the tiles.
_REGISTERS_PER_COPY = 6
_REGISTERS_WITHOUT_TAILS = 90


@dataclass(frozen=True)
class Shape:
    m: int
    n: int
    k: int


@dataclass(frozen=True)
class Params:
    bm: int = 64
    bn: int = 64
    bk: int = 32
    tm: int = 4
    tn: int = 4
    buffers: int = 2
    a_layout: str = "transposed"  # transposed: As[k][m], 4-byte copies scatter it; direct: As[m][k]
    a_width: int = 4  # bytes per cp.async of A
    b_width: int = 16  # bytes per cp.async of B
    a_pad: int = 4  # floats added to each shared-memory row of A (bank conflicts)
    b_pad: int = 0
    lanes_m: int = 2  # lanes of a warp along m (the rest, 32/lanes_m, along n)
    split: bool = False  # the thread tile as 4×4 fragments spread over the warp tile (conflict-free reads)
    # Barriers per K tile: two (wait_group(buffers-1) after the refill is issued, a barrier before and after the
    # multiply-adds) or one (wait_group(buffers-2) and the barrier first, then the refill; needs 2+ buffers).
    sync: str = "two"
    plant: str = ""  # a deliberate pipeline bug, for the tests of the gate only

    @property
    def threads(self) -> int:
        return (self.bm // self.tm) * (self.bn // self.tn)

    def label(self) -> str:
        return (f"{self.bm}x{self.bn}x{self.bk} t{self.tm}x{self.tn} buf{self.buffers} A:{self.a_layout}/{self.a_width}B"
                f" B:{self.b_width}B pad{self.a_pad}/{self.b_pad} lanes{self.lanes_m}x{32 // self.lanes_m}"
                f"{' split' if self.split else ''}{' 1bar' if self.sync == 'one' else ''}" + (f" PLANTED {self.plant}" if self.plant else ""))


def _widest_copy(*extents: int) -> int:
    """The widest cp.async (16, 8 or 4 bytes) whose floats divide every extent."""
    return next(width for width in (16, 8, 4) if all(e % (width // 4) == 0 for e in extents))


def _copy_grid(p: Params) -> dict[str, tuple[int, int, int]]:
    """Per operand, its tile as cp.async sees it: (rows, copies per row, floats per copy)."""
    a_vec = p.a_width // 4 if p.a_layout == "direct" else 1
    b_vec = p.b_width // 4
    return {"A": (p.bm, p.bk // a_vec, a_vec), "B": (p.bk, p.bn // b_vec, b_vec)}


def _copies(p: Params) -> dict[str, int]:
    """cp.async instructions a block issues per K tile, per operand."""
    return {tensor: rows * chunks for tensor, (rows, chunks, _) in _copy_grid(p).items()}


def _tails(shape: Shape, p: Params) -> tuple[bool, bool, bool]:
    """Whether M, N and K leave a partial tile."""
    return shape.m % p.bm != 0, shape.n % p.bn != 0, shape.k % p.bk != 0


def _copies_per_thread(p: Params) -> int:
    return sum(_copies(p).values()) // p.threads


def _strides(p: Params) -> tuple[int, int, int]:
    """(A row stride, A stage floats, B stage floats) in shared memory."""
    a_stride = (p.bm if p.a_layout == "transposed" else p.bk) + p.a_pad
    a_rows = p.bk if p.a_layout == "transposed" else p.bm
    return a_stride, a_rows * a_stride, p.bk * (p.bn + p.b_pad)


def _shared_bytes(p: Params) -> int:
    _, a_stage, b_stage = _strides(p)
    return p.buffers * (a_stage + b_stage) * 4


def _registers_needed(shape: Shape, p: Params) -> int:
    tails = any(_tails(shape, p))
    extra = _REGISTERS_PER_COPY * _copies_per_thread(p) + 20 if tails else _REGISTERS_WITHOUT_TAILS
    return p.tm * p.tn + p.tm + p.tn + extra


def _warp_tile(p: Params) -> tuple[int, int]:
    return p.lanes_m * p.tm, (32 // p.lanes_m) * p.tn


def _positive(field: str) -> Rule:
    return Rule("tile", lambda s, p: isinstance(getattr(p, field), int) and getattr(p, field) >= 1,
                lambda s, p: f"{field} must be a positive whole number, got {getattr(p, field)!r}")


def _tile_copies_split(tensor: str) -> Rule:
    return Rule("tile-copy", lambda s, p: not _copies(p)[tensor] % p.threads,
                lambda s, p: f"the {tensor} tile is {_copies(p)[tensor]} copies, not a multiple of {p.threads} threads")


def _copy_offsets_fixed(tensor: str) -> Rule:
    # Each thread's copies sit at fixed (row, column) offsets from its first only when a tile row and the block
    # divide one another (powers of two always do).
    def chunks(p: Params) -> int:
        return _copy_grid(p)[tensor][1]

    return Rule("tile-copy", lambda s, p: not (chunks(p) % p.threads and p.threads % chunks(p)),
                lambda s, p: f"a row of the {tensor} tile is {chunks(p)} copies; it must divide {p.threads} threads "
                             "or be a multiple of them; use power-of-two tile sizes")


_RULES: tuple[Rule, ...] = (
    *(_positive(field) for field in ("bm", "bn", "bk", "tm", "tn")),
    Rule("thread-tile", lambda s, p: p.tm in THREAD_TILE and p.tn in THREAD_TILE,
         lambda s, p: f"tm and tn are one of {THREAD_TILE} (shared memory is read in float4s), got {p.tm}×{p.tn}"),
    Rule("tile-divides", lambda s, p: not (p.bm % p.tm or p.bn % p.tn),
         lambda s, p: f"the thread tile {p.tm}×{p.tn} must divide the block tile {p.bm}×{p.bn}"),
    # Past 256 threads a block leaves each under 128 registers: too few for a register tile and the copies'
    # addresses, which is where ptxas started to spill.
    Rule("threads", lambda s, p: not p.threads % 32 and 32 <= p.threads <= MAX_THREADS,
         lambda s, p: f"(bm/tm)·(bn/tn) = {p.threads} threads; it must be a multiple of 32 in 32..{MAX_THREADS}"),
    Rule("lanes", lambda s, p: p.lanes_m in LANES_M,
         lambda s, p: f"lanes_m (lanes of a warp along m) is one of {LANES_M}, got {p.lanes_m!r}"),
    Rule("split", lambda s, p: isinstance(p.split, bool), lambda s, p: f"split is true or false, got {p.split!r}"),
    Rule("warp-tile", lambda s, p: not (p.bm % _warp_tile(p)[0] or p.bn % _warp_tile(p)[1]),
         lambda s, p: f"a warp of {p.lanes_m}×{32 // p.lanes_m} lanes covers {_warp_tile(p)[0]}×{_warp_tile(p)[1]}, "
                      f"which must divide the block tile {p.bm}×{p.bn}; choose another lanes_m"),
    Rule("buffers", lambda s, p: p.buffers in (1, 2, 3, 4),
         lambda s, p: f"1 to 4 shared-memory stages, got {p.buffers}"),
    Rule("sync", lambda s, p: p.sync in SYNCS, lambda s, p: f"barriers per K tile is one of {SYNCS}, got {p.sync!r}"),
    Rule("sync", lambda s, p: p.sync != "one" or p.buffers >= 2,
         lambda s, p: "one barrier per K tile refills the stage read one step earlier, so it needs buffers of 2 or "
                      "more; use sync two with one buffer"),
    Rule("a-layout", lambda s, p: p.a_layout in A_LAYOUTS,
         lambda s, p: f"a_layout is one of {A_LAYOUTS}, got {p.a_layout!r}"),
    Rule("copy-width", lambda s, p: p.a_width in COPY_WIDTHS and p.b_width in COPY_WIDTHS,
         lambda s, p: f"cp.async copies 4, 8 or 16 bytes, got A {p.a_width}, B {p.b_width}"),
    Rule("copy-width", lambda s, p: p.a_layout != "transposed" or p.a_width == 4,
         lambda s, p: "a transposed A tile scatters every float: a_width must be 4"),
    Rule("padding", lambda s, p: not (p.a_pad % 4 or p.b_pad % 4) and 0 <= p.a_pad <= 32 and 0 <= p.b_pad <= 32,
         lambda s, p: f"a_pad and b_pad are multiples of 4 floats up to 32 (16-byte rows), got {p.a_pad}, {p.b_pad}"),
    Rule("divisibility", lambda s, p: p.a_layout != "direct" or not (s.k % (p.a_width // 4) or p.bk % (p.a_width // 4)),
         lambda s, p: f"{p.a_width}-byte copies of A rows need K ({s.k}) and bk ({p.bk}) to be multiples of "
                      f"{p.a_width // 4}; use a_width={_widest_copy(s.k, p.bk)}"),
    Rule("divisibility", lambda s, p: not (s.n % (p.b_width // 4) or p.bn % (p.b_width // 4)),
         lambda s, p: f"{p.b_width}-byte copies of B rows need N ({s.n}) and bn ({p.bn}) to be multiples of "
                      f"{p.b_width // 4}; use b_width={_widest_copy(s.n, p.bn)}"),
    _tile_copies_split("A"), _tile_copies_split("B"),
    _copy_offsets_fixed("A"), _copy_offsets_fixed("B"),
    Rule("shared-memory", lambda s, p: _shared_bytes(p) <= MAX_SHARED_BYTES,
         lambda s, p: f"{p.buffers} stages need {_shared_bytes(p)} bytes, over the {MAX_SHARED_BYTES} a block can "
                      "have; use fewer buffers or a smaller tile"),
    Rule("registers", lambda s, p: _registers_needed(s, p) <= register_cap(p.threads),
         lambda s, p: f"{p.tm}×{p.tn} accumulators and {_copies_per_thread(p)} copies per thread per tile need about "
                      f"{_registers_needed(s, p)} registers, over the {register_cap(p.threads)} a block of "
                      f"{p.threads} threads leaves each; use wider copies, more threads or a smaller thread tile"),
    Rule("plant", lambda s, p: p.plant in PLANTED_BUGS, lambda s, p: f"unknown planted bug {p.plant!r}"),
)


class Matmul(TiledProduct):
    name = "matmul"
    tolerance = 1e-4  # fp32 FMA lands near 1e-6 here; TF32 would land near 3e-4 and fail
    params_type = Params
    rules = _RULES
    shape_dims = ("m", "n", "k")
    run_dims: tuple[str, ...] = ()
    run_defaults: dict[str, int] = {}
    shape_options: tuple[str, ...] = ()
    _args = (Arg("C", "out"), Arg("A", "in"), Arg("B", "in"))
    peer_builder = LazyFunction("mage_gen.peers", "fp32_matmul_peers")
    torch_name = "mage_gen.torch.matmul"
    runtime_name = "mage_gen.runtime.matmul"
    field_help = {"m": "rows of A and C", "n": "columns of B and C", "k": "columns of A, rows of B"}
    min_arch = 80  # cp.async

    def shape(self, **dims: int) -> Shape:
        for name in self.shape_dims:
            value = dims.get(name)
            if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= MAX_DIM:
                raise ConfigError(f"{name}-range: {name} must be a whole number in 1..{MAX_DIM}, got {value!r}; "
                                  f"give it as --{name}")
        return Shape(dims["m"], dims["n"], dims["k"])

    def params_from_dict(self, values: dict[str, Any]) -> Params:
        return params_from(Params, self.name, values, hidden=_HIDDEN)

    def params_from_user(self, values: dict[str, Any]) -> Params:
        return public_params_from(Params, self.name, values, _HIDDEN)

    def defaults(self, shape: Shape) -> dict[str, Any]:
        """The default config's fields that depend on the shape: its copy widths, fitted as a preset's are."""
        fitted = self.fit_space(shape, {"a_width": (Params.a_width,), "b_width": (Params.b_width,)})
        return {axis: values[0] for axis, values in fitted.items()}

    def fit_space(self, shape: Shape, axes: dict[str, tuple]) -> dict[str, tuple]:
        """A preset's copy widths capped at what this shape's rows allow (16-byte copies of B need N % 4 == 0):
        a preset written for round sizes then still has configs for N = 255, and the same ones for N = 256."""
        caps = {"a_width": _widest_copy(shape.k), "b_width": _widest_copy(shape.n)}
        return {axis: tuple(dict.fromkeys(min(v, caps[axis]) for v in values)) if axis in caps else values
                for axis, values in axes.items()}

    def params_to_dict(self, params: Params) -> dict[str, Any]:
        return params_dict(params, hidden=_HIDDEN)

    def shared_bytes(self, shape: Shape, p: Params) -> int:
        return _shared_bytes(p)

    # ---- generation ----
    def kernel_name(self, shape: Shape, p: Params) -> str:
        layout = "at" if p.a_layout == "transposed" else "ad"
        return (f"matmul_m{shape.m}_n{shape.n}_k{shape.k}_b{p.bm}x{p.bn}x{p.bk}_t{p.tm}x{p.tn}_s{p.buffers}"
                f"_{layout}{p.a_width}_b{p.b_width}_p{p.a_pad}x{p.b_pad}_l{p.lanes_m}{'s' if p.split else ''}"
                f"{'_y1' if p.sync == 'one' else ''}"
                + (f"_bug_{p.plant}" if p.plant else ""))

    def _copy_plan(self, shape: Shape, p: Params, tensor: str) -> list[dict[str, int]]:
        """Each of a thread's copies of one operand's tile: the i-th copy of thread t moves element
        t + i·threads of the tile, counted in copies along rows. validate() makes a tile row and the block
        divide one another, so that element sits at a constant (row, column) from the thread's first one:
        every copy is the thread's base address plus an offset fixed here."""
        a_stride, _, _ = _strides(p)
        rows, chunks, vec = _copy_grid(p)[tensor]
        plan = []
        for i in range(rows * chunks // p.threads):
            first = i * p.threads
            row, col = first // chunks, first % chunks * vec
            if tensor == "A":
                smem = col * a_stride + row if p.a_layout == "transposed" else row * a_stride + col
                gmem = row * shape.k + col
            else:
                smem = row * (p.bn + p.b_pad) + col
                gmem = row * shape.n + col
            plan.append({"row": row, "col": col, "smem_bytes": 4 * smem, "gmem_bytes": 4 * gmem})
        return plan

    def context(self, shape: Shape, p: Params) -> dict[str, Any]:
        a_stride, a_stage, b_stage = _strides(p)
        lanes_n = 32 // p.lanes_m
        warp_m, warp_n = p.lanes_m * p.tm, lanes_n * p.tn
        tails = _tails(shape, p)
        grid = _copy_grid(p)
        # A thread's fragments: 4 rows (columns) each, contiguous or spread evenly over the warp tile.
        a_frags = [i * (warp_m // (p.tm // 4) if p.split else 4) for i in range(p.tm // 4)]
        b_frags = [j * (warp_n // (p.tn // 4) if p.split else 4) for j in range(p.tn // 4)]
        return dict(
            M=shape.m, N=shape.n, K=shape.k, BM=p.bm, BN=p.bn, BK=p.bk, TM=p.tm, TN=p.tn, STAGES=p.buffers,
            THREADS=p.threads, A_TRANSPOSED=p.a_layout == "transposed", A_VEC=grid["A"][2], B_VEC=grid["B"][2],
            A_STRIDE=a_stride, B_STRIDE=p.bn + p.b_pad, A_STAGE=a_stage, B_STAGE=b_stage,
            TILES=-(-shape.k // p.bk), M_TAIL=tails[0], N_TAIL=tails[1],
            FAST_COPY=not any(tails), A_TILE_STEP=p.bk, B_TILE_STEP=p.bk * shape.n,
            A_CHUNKS=grid["A"][1], B_CHUNKS=grid["B"][1],
            A_COPIES=self._copy_plan(shape, p, "A"), B_COPIES=self._copy_plan(shape, p, "B"),
            LANES_N=lanes_n, WARPS_N=p.bn // warp_n, WM=warp_m, WN=warp_n, SPLIT=p.split,
            A_FRAGS=a_frags, B_FRAGS=b_frags, PLANT=p.plant, ONE_BARRIER=p.sync == "one", C_VEC=4 if shape.n % 4 == 0 else 1,
        )

    def source(self, shape: Shape, p: Params) -> Source:
        self.validate(shape, p)
        return render("matmul/tiled.cu.j2", self.context(shape, p), self.kernel_name(shape, p), p)

    def slug(self, shape: Shape) -> str:
        return f"m{shape.m}_n{shape.n}_k{shape.k}"

    def shape_key(self, shape: Shape) -> str:
        return f"m={shape.m},n={shape.n},k={shape.k}/float32"

    def make_inputs(self, shape: Shape, run: dict[str, int], rng: np.random.Generator) -> dict[str, np.ndarray]:
        return {"A": rng.standard_normal((shape.m, shape.k), dtype=np.float32),
                "B": rng.standard_normal((shape.k, shape.n), dtype=np.float32)}

    def args(self, shape: Shape) -> tuple[Arg, ...]:
        return self._args

    def output_shapes(self, shape: Shape, run: dict[str, int]) -> dict[str, tuple[int, ...]]:
        return {"C": (shape.m, shape.n)}

    def output_dtypes(self, shape: Shape) -> dict[str, DType]:
        return {"C": FLOAT32}

    def tolerance_of(self, shape: Shape, output: str, dtype: DType) -> float:
        return self.tolerance

    def reference(self, shape: Shape, inputs: dict[str, np.ndarray], scalars: dict[str, int | float]) -> dict[str, np.ndarray]:
        return {"C": product64(inputs["A"].astype(np.float64), inputs["B"].astype(np.float64))}

    def gate_runs(self, shape: Shape, run: dict[str, int], params: Params) -> list[dict[str, int]]:
        return [{}]  # every size is fixed: one run, fresh inputs each check

    def bytes_moved(self, shape: Shape, run: dict[str, int]) -> int:
        return 4 * (shape.m * shape.k + shape.k * shape.n + shape.m * shape.n)

    def flops(self, shape: Shape) -> int:
        return 2 * shape.m * shape.n * shape.k

    def contract(self, shape: Shape, p: Params) -> dict[str, Any]:
        """What code launching the emitted kernel must guarantee; every size is fixed at generation."""
        ctx = self.context(shape, p)

        # Each cp.async moves A_VEC (B_VEC) floats and C is stored C_VEC floats at a time, each access a whole
        # number of its widths from the base pointer: the pointer must be aligned to that width.
        def matrix(rows: int, cols: int, floats_per_access: int) -> dict[str, Any]:
            return {"dtype": "float32", "shape": [rows, cols],
                    "layout": f"row-major, contiguous, row stride {cols} elements",
                    "alignment_bytes": 4 * floats_per_access}

        return {
            "tensors": {"C": matrix(shape.m, shape.n, ctx["C_VEC"]), "A": matrix(shape.m, shape.k, ctx["A_VEC"]),
                        "B": matrix(shape.k, shape.n, ctx["B_VEC"])},
            "aliasing": "C must not overlap A or B (no in-place use): every pointer is declared __restrict__",
            "scalars": {},
        }


OP = Matmul()
