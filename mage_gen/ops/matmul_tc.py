"""Matrix product on the tensor cores, mma.sync from PTX: C = A·B, row-major, A M×K, B K×N, C fp32.

precision (a field of the shape: it decides what is computed):
  bf16  A and B are bf16 in memory; m16n8k16 mma, fp32 accumulation.
  tf32  A and B are fp32 in memory, rounded to tf32 (cvt.rn, ties to even) as they leave shared memory; m16n8k8 mma.
  fp32x3  A and B fp32, each split into a tf32 high part and the tf32 rounding of what is left; three
        m16n8k8 products (small·big, big·small, then big·big, the small terms first) summed in fp32: close
        to fp32 accuracy at tensor-core speed ("3xTF32"). The dropped small·small term is ~2⁻²² relative.
        The tensor cores' fp32 accumulation truncates: summed over all of K it shrank |C| by about
        K/8 · 2⁻²⁴ (25× SGEMM's error at K = 4096 on an H200, bench/results/h200/matmul_tc_first_look.json),
        so each K tile's products are summed apart and added to C by round-to-nearest fp32 adds.

One template, `mma`: a BM×BN block tile of warps_m × warps_n warps, walked along K in BK steps through
`stages` shared-memory buffers that cp.async copies of `copy` bytes (4, 8 or 16) fill, zero-filled past M,
N and K, so tails need no other care than guarded stores. A copy never straddles the end of a row: its width
must divide the bytes of a row of A (K elements) and of B (N elements). `sync` two: a barrier before and
after each tile's multiply; one: wait, one barrier, refill the stage the previous tile left, multiply. A warp
owns a (BM/warps_m) ×
(BN/warps_n) tile of m16n8 accumulators; bf16 fragments come from shared memory by ldmatrix (A: .x4, B:
.x2.trans), tf32 fragments of A by ldmatrix .x4 as well (4 fp32 to a 16-byte row) and of B by scalar loads.
`pad_a` and `pad_b` elements after each shared-memory row of A and of B move each row's start to other banks:
a warp's fragment loads read 8 rows at once, which a bank sees once each where
  ldmatrix (16-byte rows)   the row stride is an odd number of 16 bytes: bk + pad_a (and, bf16, bn + pad_b)
                            ≡ 8 (mod 16) for bf16, ≡ 4 (mod 8) for tf32 (e.g. pads 8, and pad_a 4);
  tf32 B (scalar loads)     lanes (g, t) read word t·(bn + pad_b) + g: distinct banks where bn + pad_b ≡ 8
                            (mod 16), e.g. pad_b 8.
  tf32 B (b_loads wide)     the mma column g of n-tile j is put at column (j // G)·8G + g·G + j % G of the
                            warp's tile, G = 2 or 4 n-tiles, so lane (g, t) finds its G values side by side and
                            reads them with one 8- or 16-byte load at word t·(bn + pad_b) + g·G. A 16-byte load is
                            served 8 lanes at a time (g 0-1, t 0-3), an 8-byte one 16 at a time (g 0-3): both are
                            conflict-free where bn + pad_b ≡ 8 (mod 32), e.g. pad_b 8 with bn 32, 64, 128, 256.
                            C follows the same mapping: a lane's accumulators of G n-tiles make 2G adjacent columns
                            of a row, stored 16 bytes at a time where N is a multiple of 4.

The gate's tolerance (tolerance_of), relative norm against float64 of the exact inputs:
  bf16  products of bf16 values are exact in fp32, so the error is fp32 accumulation over K: at most
        about K·2⁻²⁴ relative, and in norm far less; 2⁻²⁴·K + 1e-6 bounds it for any K here.
  tf32  each input keeps 11 significant bits (unit roundoff 2⁻¹¹), so each product is within 2·2⁻¹¹ of
        the exact one; 4·2⁻¹¹ bounds the norm, with the fp32 accumulation on top.
  fp32x3  the fp32 matmul's own tolerance (ops/matmul.py, 1e-4): what an FP32 result must meet.
  A peer that rounds C to bf16 (cuBLAS as torch.matmul returns it) is allowed one bf16 ulp (2u) more.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from mage_gen.dtypes import BFLOAT16, FLOAT32, DType
from mage_gen.errors import ConfigError
from mage_gen.ops.base import (Arg, LazyFunction, Rule, Stored, TiledProduct, params_dict, params_from, product64,
                               public_params_from, register_cap)
from mage_gen.render import Source, render

PRECISIONS = ("bf16", "tf32", "fp32x3")
MAX_DIM = 1 << 16
MAX_THREADS = 256
MAX_SHARED_BYTES = 227 * 1024  # the opt-in limit per block on sm_90
_K_STEP = {"bf16": 16, "tf32": 8, "fp32x3": 8}  # K of one mma
_ELEMENT = {"bf16": BFLOAT16, "tf32": FLOAT32, "fp32x3": FLOAT32}  # of A and B in memory
_MMA_TYPE = {"bf16": "bf16", "tf32": "tf32", "fp32x3": "tf32"}
_ACCUMULATORS_MAX = 128  # floats of C a thread holds: a 64×64 warp tile
# test-only pipeline bugs the gate must reject: the multiply reads the stage one ahead of the tile it waited
# for, or waits for one copy group fewer than that tile needs
PLANTED_BUGS = ("", "stage_off_by_one", "loose_wait")
_HIDDEN = frozenset({"plant"})
COPY_WIDTHS = (4, 8, 16)  # bytes per cp.async
SYNCS = ("two", "one")  # barriers per K tile
B_LOADS = ("word", "wide")  # how a tf32 B fragment leaves shared memory
PREFETCHES = ("none", "next")  # fragments loaded by the K step that uses them, or one step ahead


def _guard(*bounds: tuple[str, int, int]) -> str:
    """The C condition that keeps a copy inside its matrix: `index < extent` for each (index, extent, tile)
    whose tiles do not divide the extent; empty where all do."""
    return " && ".join(f"{index} < {extent}" for index, extent, tile in bounds if extent % tile)


def _b_group(nt: int) -> int:
    """n-tiles whose B columns one wide shared load brings: 4 (16 bytes) where there are 4 or more, else 2."""
    return min(nt, 4)


@dataclass(frozen=True)
class Shape:
    m: int
    n: int
    k: int
    precision: str = "bf16"


@dataclass(frozen=True)
class Params:
    bm: int = 64
    bn: int = 64
    bk: int = 32
    warps_m: int = 2
    warps_n: int = 2
    stages: int = 2
    pad_a: int = 8  # elements after each shared-memory row of A
    pad_b: int = 8  # and of B
    copy: int = 4  # bytes per cp.async of A and B: 4, 8 or 16 (where they divide the rows)
    # two: a barrier before and after each tile's multiply; one: wait, barrier, refill the stage the previous
    # tile left, multiply (stages ≥ 2)
    sync: str = "two"
    # word: each tf32 B fragment register by its own 4-byte shared load; wide: the columns a lane owns in up to 4
    # n-tiles made adjacent, so one 8- or 16-byte load fills them all (C is stored through the same mapping)
    b_loads: str = "word"
    # none: a K step loads its fragments, then multiplies; next: they are loaded while the step before multiplies
    # (two fragment buffers), the next tile's first ones across the tile's one barrier, STAGES tiles in flight
    prefetch: str = "none"
    plant: str = ""  # a deliberate pipeline bug, for the tests of the gate only

    @property
    def threads(self) -> int:
        return 32 * self.warps_m * self.warps_n

    def label(self) -> str:
        return (f"{self.bm}x{self.bn}x{self.bk} warps{self.warps_m}x{self.warps_n} s{self.stages} pad{self.pad_a}/{self.pad_b} "
                f"copy{self.copy}B" + (" one-barrier" if self.sync == "one" else "") + (" wide-B" if self.b_loads == "wide" else "")
                + (" prefetch" if self.prefetch == "next" else "") + (f" PLANTED {self.plant}" if self.plant else ""))


def _element_size(shape: Shape) -> int:
    return _ELEMENT[shape.precision].itemsize


def _warp_tile(p: Params) -> tuple[int, int]:
    return p.bm // p.warps_m, p.bn // p.warps_n


def _mma_tiles(p: Params) -> tuple[int, int]:
    """m16 and n8 tiles of a warp's tile."""
    wm, wn = _warp_tile(p)
    return wm // 16, wn // 8


def _accumulators(p: Params) -> int:
    mt, nt = _mma_tiles(p)
    return mt * nt * 4


def _tile_copies(shape: Shape, p: Params) -> dict[str, int]:
    per_copy = p.copy // _element_size(shape)
    return {"A": p.bm * p.bk // per_copy, "B": p.bk * p.bn // per_copy}


def _shared_bytes(shape: Shape, p: Params) -> int:
    return p.stages * (p.bm * (p.bk + p.pad_a) + p.bk * (p.bn + p.pad_b)) * _element_size(shape)


def _copies_per_thread(shape: Shape, p: Params) -> int:
    return sum(_tile_copies(shape, p).values()) // p.threads


def _split(shape: Shape) -> int:
    """Parts of every fragment, and of C: fp32x3 holds a high and a low one."""
    return 2 if shape.precision == "fp32x3" else 1


def _registers_needed(shape: Shape, p: Params) -> int:
    # Beyond the accumulators: the unrolled K steps' fragments, and about 4 registers for each copy a thread
    # issues per tile (its global and shared addresses and guard). Fitted to ptxas 13.0 over 180 variants of
    # the full preset drawn at random at 1000³, 80 of which it spilled: every one this admits compiled without
    # spills (tests/test_matmul_tc.py holds the 64×64 warp tiles at the edge).
    mt, nt = _mma_tiles(p)
    split = _split(shape)
    return (split * _accumulators(p) + split * (4 * mt + 2 * nt) * (p.bk // _K_STEP[shape.precision])
            + 4 * _copies_per_thread(shape, p) + 24)


def _b_row_align(shape: Shape) -> int:
    """ldmatrix wants rows that start on 16-byte boundaries (A always, B where bf16); scalar loads 4."""
    return 16 if shape.precision == "bf16" else 4


def _positive(field: str) -> Rule:
    return Rule("tile", lambda s, p: (isinstance(getattr(p, field), int) and not isinstance(getattr(p, field), bool)
                                      and getattr(p, field) >= 1),
                lambda s, p: f"{field} must be a positive whole number, got {getattr(p, field)!r}")


def _pad(field: str) -> Rule:
    return Rule("pad", lambda s, p: isinstance(getattr(p, field), int) and getattr(p, field) >= 0,
                lambda s, p: f"{field} is a whole number of elements, got {getattr(p, field)!r}")


def _tile_copies_split(tensor: str) -> Rule:
    return Rule("tile-copy", lambda s, p: not _tile_copies(s, p)[tensor] % p.threads,
                lambda s, p: f"the {tensor} tile is {_tile_copies(s, p)[tensor]} copies of {p.copy} bytes, not a "
                             f"multiple of {p.threads} threads")


def _wide_b(p: Params) -> bool:
    return p.b_loads == "wide"


_RULES: tuple[Rule, ...] = (
    *(_positive(field) for field in ("bm", "bn", "bk", "warps_m", "warps_n", "stages")),
    _pad("pad_a"), _pad("pad_b"),
    Rule("k-step", lambda s, p: not p.bk % _K_STEP[s.precision],
         lambda s, p: f"a {s.precision} mma takes K in steps of {_K_STEP[s.precision]}; bk={p.bk} must be a multiple"),
    Rule("warp-tile", lambda s, p: not (p.bm % p.warps_m or p.bn % p.warps_n or _warp_tile(p)[0] % 16
                                        or _warp_tile(p)[1] % 8),
         lambda s, p: f"{p.warps_m}×{p.warps_n} warps over a {p.bm}×{p.bn} tile give each {p.bm / p.warps_m:g}×"
                      f"{p.bn / p.warps_n:g}; it must be whole multiples of 16×8 (the m16n8 accumulator)"),
    Rule("threads", lambda s, p: p.threads <= MAX_THREADS,
         lambda s, p: f"{p.warps_m}×{p.warps_n} warps are {p.threads} threads, over {MAX_THREADS}"),
    Rule("stages", lambda s, p: 1 <= p.stages <= 4, lambda s, p: f"1 to 4 shared-memory stages, got {p.stages}"),
    Rule("sync", lambda s, p: p.sync in SYNCS, lambda s, p: f"sync is one of {SYNCS}, got {p.sync!r}"),
    Rule("sync", lambda s, p: p.sync != "one" or p.stages >= 2,
         lambda s, p: "one barrier per tile refills a stage while another is read, so it needs 2 or more stages"),
    Rule("pad", lambda s, p: not (((p.bk + p.pad_a) * _element_size(s)) % 16
                                  or ((p.bn + p.pad_b) * _element_size(s)) % _b_row_align(s)),
         lambda s, p: f"shared-memory rows of {p.bk}+{p.pad_a} and {p.bn}+{p.pad_b} {s.precision} elements must be "
                      f"whole multiples of 16 and {_b_row_align(s)} bytes; use a pad of 0 or 8"),
    Rule("copy-width", lambda s, p: p.copy in COPY_WIDTHS,
         lambda s, p: f"copy is the bytes of one cp.async, one of {COPY_WIDTHS}, got {p.copy!r}"),
    Rule("copy-width", lambda s, p: not ((s.k * _element_size(s)) % p.copy or (s.n * _element_size(s)) % p.copy),
         lambda s, p: f"{p.copy}-byte copies must divide the rows of A ({s.k} elements) and of B ({s.n}), "
                      f"{s.k * _element_size(s)} and {s.n * _element_size(s)} bytes; use copy 4"),
    Rule("copy-width", lambda s, p: not any((elements * _element_size(s)) % p.copy for elements in
                                            (p.bk + p.pad_a, p.bn + p.pad_b, p.bk, p.bn)),
         lambda s, p: f"{p.copy}-byte copies must divide the tile rows ({p.bk} and {p.bn} elements) and the "
                      f"shared-memory rows (+{p.pad_a}, +{p.pad_b}); use a narrower copy"),
    _tile_copies_split("A"), _tile_copies_split("B"),
    Rule("registers", lambda s, p: _accumulators(p) <= _ACCUMULATORS_MAX,
         lambda s, p: f"a {_warp_tile(p)[0]}×{_warp_tile(p)[1]} warp tile is {_accumulators(p)} accumulators a thread "
                      f"(at most {_ACCUMULATORS_MAX}); use more warps or a smaller tile"),
    Rule("registers", lambda s, p: _registers_needed(s, p) <= register_cap(p.threads),
         lambda s, p: f"{_split(s) * _accumulators(p)} accumulators, {p.bk // _K_STEP[s.precision]} unrolled K steps "
                      f"of fragments and {_copies_per_thread(s, p)} copies a thread need about "
                      f"{_registers_needed(s, p)} registers, over the {register_cap(p.threads)} a block of "
                      f"{p.threads} threads leaves each; use a smaller bk, more warps or a smaller tile"),
    Rule("b-loads", lambda s, p: p.b_loads in B_LOADS, lambda s, p: f"b_loads is one of {B_LOADS}, got {p.b_loads!r}"),
    Rule("b-loads", lambda s, p: not (_wide_b(p) and s.precision == "bf16"),
         lambda s, p: "bf16 B fragments come by ldmatrix; wide B loads are for tf32 and fp32x3"),
    Rule("b-loads", lambda s, p: not _wide_b(p) or (_mma_tiles(p)[1] >= 2
                                                    and not _mma_tiles(p)[1] % _b_group(_mma_tiles(p)[1])),
         lambda s, p: f"a {_warp_tile(p)[1]}-wide warp tile is {_mma_tiles(p)[1]} n-tiles; wide loads take them 2 or 4 "
                      "at a time; use word"),
    Rule("b-loads", lambda s, p: not _wide_b(p) or not ((p.bn + p.pad_b) * _element_size(s))
         % (4 * _b_group(_mma_tiles(p)[1])),
         lambda s, p: f"{_b_group(_mma_tiles(p)[1])} columns at once need shared rows of B ({p.bn}+{p.pad_b}) in "
                      f"whole {4 * _b_group(_mma_tiles(p)[1])} bytes; use pad_b 0, 4 or 8"),
    Rule("prefetch", lambda s, p: p.prefetch in PREFETCHES,
         lambda s, p: f"prefetch is one of {PREFETCHES}, got {p.prefetch!r}"),
    Rule("prefetch", lambda s, p: p.prefetch != "next" or (p.sync == "one" and p.stages >= 2),
         lambda s, p: "fragments loaded ahead go with one barrier per tile (sync one) and 2 or more stages: the "
                      "barrier frees the stage whose fragments every warp holds"),
    Rule("prefetch", lambda s, p: p.prefetch != "next" or not (p.bk // _K_STEP[s.precision]) % 2,
         lambda s, p: f"a tile of bk={p.bk} is {p.bk // _K_STEP[s.precision]} K steps; fragments loaded ahead "
                      "alternate between two buffers, so each tile must end on the second: use an even number of "
                      "steps"),
    Rule("plant", lambda s, p: p.plant in PLANTED_BUGS, lambda s, p: f"unknown planted bug {p.plant!r}"),
    Rule("shared-memory", lambda s, p: _shared_bytes(s, p) <= MAX_SHARED_BYTES,
         lambda s, p: f"{p.stages} stages need {_shared_bytes(s, p)} bytes, over the {MAX_SHARED_BYTES} a block can "
                      "have; use fewer stages or a smaller tile"),
)


class MatmulTC(TiledProduct):
    name = "matmul_tc"
    tolerance = 1e-4  # an fp32 result's, as the fp32 matmul's: fp32x3 is held to it (the rest: tolerance_of)
    params_type = Params
    rules = _RULES
    shape_dims = ("m", "n", "k")
    shape_options = ("precision",)  # --config precision=tf32
    run_dims: tuple[str, ...] = ()
    run_defaults: dict[str, int] = {}
    min_arch = 80  # cp.async, mma.sync with bf16 and tf32
    peer_builder = LazyFunction("mage_gen.peers", "tensor_core_matmul_peers")
    field_help = {"m": "rows of A and C", "n": "columns of B and C", "k": "columns of A, rows of B",
                  "precision": "bf16, tf32 or fp32x3 (what A and B are and how the tensor cores take them)"}

    # ---- shapes and params ----
    def shape(self, m: Any = None, n: Any = None, k: Any = None, precision: str = "bf16") -> Shape:
        for name, value in (("m", m), ("n", n), ("k", k)):
            if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= MAX_DIM:
                raise ConfigError(f"{name}-range: {name} must be a whole number in 1..{MAX_DIM}, got {value!r}; "
                                  f"give it as --{name}")
        if precision not in PRECISIONS:
            raise ConfigError(f"precision: one of {', '.join(PRECISIONS)}, got {precision!r}")
        if precision == "bf16" and (k % 2 or n % 2):
            raise ConfigError(f"divisibility: bf16 rows are copied two elements (4 bytes) at a time, so K and N must "
                              f"be even, got K={k}, N={n}; pad the matrices")
        return Shape(m, n, k, precision)

    def params_from_dict(self, values: dict[str, Any]) -> Params:
        return params_from(Params, self.name, values, hidden=_HIDDEN)

    def params_from_user(self, values: dict[str, Any]) -> Params:
        return public_params_from(Params, self.name, values, _HIDDEN)

    def defaults(self, shape: Shape) -> dict[str, Any]:
        # a tf32 K step is 8 deep, half a bf16 one: bk 16 keeps the unrolled fragments within the registers;
        # the widest copy the rows of A and B allow
        copy = max(self._copy_widths(shape))
        return {"copy": copy} if shape.precision == "bf16" else {"bk": 16, "copy": copy}

    def fit_space(self, shape: Shape, axes: dict[str, tuple]) -> dict[str, tuple]:
        """The copy widths the rows of A and B allow; where a preset names none of them, the widest they allow."""
        if "copy" not in axes:
            return axes
        allowed = self._copy_widths(shape)
        return {**axes, "copy": tuple(w for w in axes["copy"] if w in allowed) or (max(allowed),)}

    def _copy_widths(self, shape: Shape) -> tuple[int, ...]:
        size = _ELEMENT[shape.precision].itemsize
        return tuple(w for w in COPY_WIDTHS if (shape.k * size) % w == 0 and (shape.n * size) % w == 0)

    def params_to_dict(self, params: Params) -> dict[str, Any]:
        return params_dict(params, hidden=_HIDDEN)

    @staticmethod
    def wide_row(mt_index: int, group: int, half: int, b_group: int) -> list[str]:
        """Under wide B loads, the accumulators of one C row a thread stores, in column order: n-tile
        group·b_group + e holds mma column c' at column (c'·b_group + e) of the group's 8·b_group, so a lane's
        mma columns 2t and 2t + 1 are 2·b_group adjacent columns, e fastest."""
        tiles = range(group * b_group, (group + 1) * b_group)
        return [f"acc[{mt_index}][{j}][{2 * half + c}]" for c in range(2) for j in tiles]

    def shared_bytes(self, shape: Shape, p: Params) -> int:
        return _shared_bytes(shape, p)

    # ---- generation ----
    def kernel_name(self, shape: Shape, p: Params) -> str:
        return (f"matmul_tc_{shape.precision}_m{shape.m}_n{shape.n}_k{shape.k}_b{p.bm}x{p.bn}x{p.bk}"
                f"_w{p.warps_m}x{p.warps_n}_s{p.stages}_p{p.pad_a}x{p.pad_b}_c{p.copy}" + ("_y1" if p.sync == "one" else "")
                + ("_bw" if p.b_loads == "wide" else "") + ("_pf" if p.prefetch == "next" else "") + (f"_bug_{p.plant}" if p.plant else ""))

    def context(self, shape: Shape, p: Params) -> dict[str, Any]:
        element = _ELEMENT[shape.precision]
        b_group = _b_group(p.bn // p.warps_n // 8) if p.b_loads == "wide" else 0
        return dict(
            M=shape.m, N=shape.n, K=shape.k, PRECISION=shape.precision, MMA_TYPE=_MMA_TYPE[shape.precision],
            SPLIT=shape.precision == "fp32x3", ELEMENT=element.c_type,
            ESIZE=element.itemsize, BM=p.bm, BN=p.bn, BK=p.bk, STAGES=p.stages, THREADS=p.threads,
            WARPS_N=p.warps_n, WM=p.bm // p.warps_m, WN=p.bn // p.warps_n, MT=p.bm // p.warps_m // 16,
            NT=p.bn // p.warps_n // 8, KSTEP=_K_STEP[shape.precision], SA=p.bk + p.pad_a, SB=p.bn + p.pad_b,
            A_STAGE=p.bm * (p.bk + p.pad_a), B_STAGE=p.bk * (p.bn + p.pad_b), TILES=-(-shape.k // p.bk),
            COPY=p.copy, PER_COPY=p.copy // element.itemsize,
            A_COPIES=_tile_copies(shape, p)["A"] // p.threads, B_COPIES=_tile_copies(shape, p)["B"] // p.threads,
            PLANT=p.plant, SYNC=p.sync, B_GROUP=b_group, PREFETCH=p.prefetch == "next",
            # a copy's bounds checks where a tile can reach past M, N or K: a full tile's copies go unguarded, with
            # no select of address and size (which cost more instructions than the copy)
            A_IN=_guard(("m0 + mm", shape.m, p.bm), ("k0 + kk", shape.k, p.bk)),
            B_IN=_guard(("k0 + kk", shape.k, p.bk), ("n0 + nn", shape.n, p.bn)),
            wide_row=lambda i, q, half: self.wide_row(i, q, half, b_group),
        )

    def source(self, shape: Shape, p: Params) -> Source:
        self.validate(shape, p)
        return render("matmul_tc/mma.cu.j2", self.context(shape, p), self.kernel_name(shape, p), p)

    def slug(self, shape: Shape) -> str:
        return f"{shape.precision}_m{shape.m}_n{shape.n}_k{shape.k}"

    def shape_key(self, shape: Shape) -> str:
        return f"m={shape.m},n={shape.n},k={shape.k}/{shape.precision}"

    def args(self, shape: Shape) -> tuple[Arg, ...]:
        element = _ELEMENT[shape.precision].name
        return (Arg("C", "out"), Arg("A", "in", element), Arg("B", "in", element))

    def make_inputs(self, shape: Shape, run: dict[str, int], rng: np.random.Generator) -> dict[str, np.ndarray]:
        element = _ELEMENT[shape.precision]
        return {"A": element.round(rng.standard_normal((shape.m, shape.k), dtype=np.float32)),
                "B": element.round(rng.standard_normal((shape.k, shape.n), dtype=np.float32))}

    def output_shapes(self, shape: Shape, run: dict[str, int]) -> dict[str, tuple[int, ...]]:
        return {"C": (shape.m, shape.n)}

    def output_dtypes(self, shape: Shape) -> dict[str, DType]:
        return {"C": FLOAT32}

    def tolerance_of(self, shape: Shape, output: str, dtype: DType) -> float:
        if dtype != FLOAT32:  # a peer's C rounded to a 16-bit type: one rounding more, within one of its ulps
            return 2 * dtype.unit_roundoff + self.tolerance_of(shape, output, FLOAT32)
        if shape.precision == "tf32":
            return 4 * 2.0**-11
        if shape.precision == "fp32x3":
            return self.tolerance
        return 2.0**-24 * shape.k + 1e-6

    def reference(self, shape: Shape, inputs: dict[str, np.ndarray], scalars: dict[str, int | float]) -> dict[str, np.ndarray]:
        element = _ELEMENT[shape.precision]
        return {"C": product64(Stored(inputs["A"], element), Stored(inputs["B"], element))}

    def gate_runs(self, shape: Shape, run: dict[str, int], params: Params) -> list[dict[str, int]]:
        return [{}]

    def bytes_moved(self, shape: Shape, run: dict[str, int]) -> int:
        size = _ELEMENT[shape.precision].itemsize
        return size * (shape.m * shape.k + shape.k * shape.n) + 4 * shape.m * shape.n

    def flops(self, shape: Shape) -> int:
        return 2 * shape.m * shape.n * shape.k

    def contract(self, shape: Shape, p: Params) -> dict[str, Any]:
        element = _ELEMENT[shape.precision].name

        def matrix(rows: int, cols: int, dtype: str) -> dict[str, Any]:
            return {"dtype": dtype, "shape": [rows, cols], "layout": f"row-major, contiguous, row stride {cols} elements",
                    "alignment_bytes": p.copy}

        return {
            "tensors": {"C": matrix(shape.m, shape.n, "float32"), "A": matrix(shape.m, shape.k, element),
                        "B": matrix(shape.k, shape.n, element)},
            "aliasing": "C must not overlap A or B (no in-place use): every pointer is declared __restrict__",
            "scalars": {},
        }


OP = MatmulTC()
