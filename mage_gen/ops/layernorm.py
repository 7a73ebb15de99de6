"""Layer norm, row-major M×d: y = (x − mean)·rstd·w + b with rstd = 1/sqrt(var + eps).

d, the element types and the residual form are fixed when the kernel is generated; M is given at launch.
x, y (and residual) are fp32, bf16 or fp16; w and b the same type or fp32; the statistics and every
operation on values are fp32. With residual, the row normalized is x + residual, computed in fp32 and
rounded once to the activation type, as torch computes `x + residual`; it is written to residual_out.

The gate's tolerance, per output type (tolerance_of):
  fp32 y       1e-5 relative norm: fp32 sums over d values, rsqrt.approx (2 ulp), against float64.
  bf16/fp16 y  2u + 1e-5, u the type's unit roundoff (bf16 2⁻⁸, fp16 2⁻¹¹): one ulp. The reference is the
               float64 result rounded once to the type; the kernel's fp32 result (within the fp32 tolerance of
               it) rounds to the same value, or, where the two straddle a rounding boundary, to its neighbour,
               one ulp (at most 2u relative) away. So ‖out − ref‖ ≤ (2u + 1e-5)‖ref‖ at any size, however
               few the elements; a wrong row, statistic or weight is off by far more than an ulp.
  residual_out 0: the same fp32 sum and one rounding as torch, bit for bit.
stats 'shifted' (16-bit rows) sums x − k and (x − k)² about k, the row's first element, and takes
var = Σ(x − k)²/d − (Σ(x − k)/d)². As k is one of the row's values, (k − mean)² ≤ d·var, so the cancellation
costs at most about 2⁻²⁴·(d + 1) of var, half that of rstd, on the worst row (one outlier); on rows of
comparable values it costs nothing measurable. The rule d ≤ 2²⁴·u keeps that within half the output's unit
roundoff u, inside its one-ulp tolerance: bf16 rows up to 65536, fp16 up to 8192; fp32's 1e-5 could not absorb
it, so fp32 rows keep two_pass or one_pass.
Templates:
  row       one block of T threads per row, the row held in registers and read once;
  multirow  R rows per block, T threads per row (a warp per row needs no barrier at all);
  wide      rows too wide for registers: loop over the row twice (Chan-merged statistics, then output).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from mage_gen.dtypes import FLOAT32, DType
from mage_gen.dtypes import dtype as element_type
from mage_gen.errors import ConfigError
from mage_gen.ops.base import (Arg, LazyFunction, Launch, OpFamily, Rule, params_dict, params_from,
                               public_params_from, register_cap)
from mage_gen.render import Source, render

TEMPLATES = ("row", "multirow", "wide")
VECTOR_WIDTHS = (4, 8, 16)  # bytes per global access of a row
RSQRT_MODES = ("approx", "exact")
STATS = ("two_pass", "one_pass", "shifted")
HINTS = ("none", "nc", "stream", "keep", "keep_unreleased")
# hints of template wide alone: its first pass reads the row under an L2 evict-last policy, its second at evict-first
KEEP_HINTS = ("keep", "keep_unreleased")
WEIGHTS = ("late", "early", "l2")
HOLDS = ("float", "packed")
AHEAD_PRIORITIES = ("normal", "last")
# L1 eviction priorities of a keep hint's loads: l1 -> (the load hint of the first pass and w, of the second pass,
# the kernel name's suffix)
L1_PRIORITIES = {"normal": ("nc", "nc", ""), "last": ("nc_l1_last", "nc", "_l1l"),
                 "first": ("nc", "nc_l1_first", "_l1f"), "last_first": ("nc_l1_last", "nc_l1_first", "_l1lf")}
MAX_D = 1 << 20
# The kernels count rows and row groups in int: (M + R - 1) / R and a group's last row must not overflow.
MAX_ROWS = 2**31 - 1024
# Elements of x the gate draws fresh for every check, at most (a persistent grid may need more rows)
GATE_ELEMENTS = 1 << 22
MAX_THREADS_PER_SM = 2048  # sm_70 to sm_90
MAX_VALUES_PER_THREAD = 64  # floats of one row a thread may hold; beyond it ptxas starts to spill
_REGISTERS_PER_VALUE = {1: 5.0, 2: 3.5, 4: 2.25}  # by 4-byte words per access
# Registers beyond the values held that a min_blocks > 1 variant is left at least: under that cap ptxas spills
# at most a few hundred bytes (fitted over 818 row variants of d 768-8192, fp32 and bf16, ptxas 13.0)
_SQUEEZE_OVERHEAD = 16
_TEMPLATE_FILES = {"row": "layernorm/resident.cu.j2", "multirow": "layernorm/resident.cu.j2",
                   "wide": "layernorm/wide.cu.j2"}
# (x loads, y stores, w/b loads) for each hint. w and b are read-only in every kernel and always take the
# read-only path: plain loads of them could alias the y stores before them, and ptxas would then keep each
# slot's w load behind the previous slot's store (one load latency per slot)
_HINT_SUFFIXES = {"none": ("", "", "nc"), "nc": ("nc", "", "nc"), "stream": ("nc_na", "cs", "nc"),
                  "keep": ("nc", "", "nc"), "keep_unreleased": ("nc", "", "nc")}


@dataclass(frozen=True)
class Shape:
    d: int
    dtype: str = "float32"  # of x, y and the residual (torch's name)
    weight_dtype: str = "float32"  # of w and b: the activations' or float32
    residual: bool = False  # y = norm(x + residual), and x + residual written to residual_out


@dataclass(frozen=True)
class Params:
    template: str = "row"
    threads: int = 128  # threads per row
    vector: int = 16  # bytes per global access of a row: 4, 8 or 16 (4 floats, or 8 bf16, at 16)
    rows_per_block: int = 1
    rsqrt: str = "approx"
    # none: x by plain loads; nc: x by the read-only path; stream: x not kept in L1, y evict-first; keep (template
    # wide): pass 1 reads x at L2 evict-last, pass 2 at evict-first, then the row's lines go back to normal priority;
    # keep_unreleased: left at evict-last, w and b read at evict-last too (Inductor's policies). Those lines outlive
    # the launch; every timing resets them first (measure.own_lines_only), so they flatter no subject's time. With
    # the residual, both keep hints read x and residual in each pass and write residual_out in the second
    hint: str = "nc"
    # two_pass: mean, then squared deviations; one_pass: one Chan-merged reduction; shifted: sums of x − k and
    # (x − k)², k the row's first element, in one reduction (16-bit rows)
    stats: str = "two_pass"
    grid_cap: int = 0  # 0: a block per row group; N: at most N blocks walk the rows, prefetching the next
    # late: w and b read after the statistics, where they are used; early: beside x, held until then (a
    # persistent block reads them once); l2: read late, and asked of L2 by the launch's first block as it starts
    # (one bulk prefetch each, sm_90), so that where L2 no longer holds them (a cold launch, or one after the
    # launch before streamed rows of many times L2's size through it) the first wave's rows do not each wait on
    # DRAM for them after their statistics
    # (bench/NOTES.md, norms §22; weights staged in shared memory by cp.async lost there, commit d33623b)
    weights: str = "late"
    # blocks each SM must hold at once (__launch_bounds__' second argument): ptxas fits the registers to it,
    # so that more rows are in flight where registers, not threads, limit the blocks per SM
    min_blocks: int = 1
    # float: the row held in registers as floats; packed: a 16-bit row held as loaded, two elements to a
    # register, widened again for each pass over it (half the registers, so more rows in flight per SM)
    hold: str = "float"
    # KB of rows ahead: each block of a one-group-per-block grid, as it starts, asks L2 (one bulk prefetch, sm_90)
    # for the rows of the block that many KB of x further on, so that DRAM has requests queued while the blocks
    # on the SMs reduce the rows they hold (bench/NOTES.md, norms §13); 0: none
    l2_ahead: int = 0
    # the L2 eviction priority of the lines asked ahead: normal, or last, so that the lines the blocks' own loads
    # and stores bring in go first and the rows asked ahead are still in L2 when their block reads them; that
    # block then gives them normal priority again, which a read does not (bench/NOTES.md, norms §14)
    ahead_priority: str = "normal"
    # the L1 eviction priority of a keep hint's loads (template wide): last, the first pass's and w's, so that the
    # second pass finds the row in L1 rather than L2 (how much L1 an SM has moves those kernels by percents); first,
    # the second pass's, the row's last read; last_first, both, as Inductor's two-pass norms load; normal: none
    # (bench/NOTES.md, norms §26)
    l1: str = "normal"

    def label(self) -> str:
        extra = ((f" {self.stats}" if self.stats != "two_pass" else "") + (f" grid≤{self.grid_cap}" if self.grid_cap else "")
                 + (f" w-{self.weights}" if self.weights != "late" else "") + (f" B≥{self.min_blocks}" if self.min_blocks > 1 else "")
                 + (" held-packed" if self.hold == "packed" else "")
                 + (f" L2+{self.l2_ahead}K" if self.l2_ahead else "")
                 + (f" evict-{self.ahead_priority}" if self.ahead_priority != "normal" else "")
                 + (f" L1-{self.l1}" if self.l1 != "normal" else ""))
        return (f"{self.template} T{self.threads} V{self.vector}B R{self.rows_per_block} "
                f"{self.rsqrt} {self.hint}{extra}")


# Where nothing is tuned for a shape (the runtime), the first of these the op accepts: a row held in registers at the
# widest access, by 128 threads where the row keeps them busy, more where its registers need them, fewer only for a
# short row; template wide for a row too long to hold
DEFAULT_CANDIDATES = (tuple({"template": "row", "threads": t, "vector": v}
                            for v in (16, 8, 4) for t in (128, 256, 512, 1024, 64, 32))
                      + tuple({"template": "wide", "threads": t, "vector": v}
                              for v in (16, 4) for t in (1024, 256, 32)))


def _registers_needed(values: int, words: int) -> int:
    """A conservative estimate, fitted to ptxas 13.0 over 1457 compiled row/multirow variants (none that
    it admits spilled): narrower vectors cost more registers per value in addresses and predicates."""
    return math.ceil(values * _REGISTERS_PER_VALUE[words]) + 16


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def _elements(shape: Shape, p: Params) -> int:
    """Elements per access of a row: `vector` bytes of the activation type."""
    return p.vector // element_type(shape.dtype).itemsize


def _slots(shape: Shape, p: Params) -> int:
    return math.ceil((shape.d // _elements(shape, p)) / p.threads)


def _weight_tensors(norm: str) -> tuple[str, ...]:
    return ("w", "b") if norm == "layer" else ("w",)


def _held_values(shape: Shape, p: Params, norm: str) -> int:
    """Floats a thread of template row or multirow holds: its slots of the row (and of the weights read early)."""
    d, v, act = shape.d, _elements(shape, p), element_type(shape.dtype)
    unit = 2 if act.half else 1
    # a persistent block holds its next rows too; a residual row is two tensors until they are added
    values = ((_slots(shape, p) * v + (2 * unit if d % v else 0)) * (2 if p.grid_cap else 1)
              * (2 if shape.residual else 1)) // (2 if p.hold == "packed" else 1)
    if p.weights == "early":  # held as loaded: a 16-bit pair per register
        weight = element_type(shape.weight_dtype)
        values += _slots(shape, p) * v * len(_weight_tensors(norm)) // (2 if weight.half else 1)
    return values


def _short(dtype: str) -> str:
    return element_type(dtype).short


def row_norm_rules(norm: str) -> tuple[Rule, ...]:
    """A row norm's rules, in the order they are checked (the first a config breaks is the one reported). norm:
    'layer', or 'rms', whose only weight is w."""
    def held(s: Shape, p: Params) -> int:
        return _held_values(s, p, norm)

    def need(s: Shape, p: Params) -> int:
        return _registers_needed(held(s, p), p.vector // 4)

    def squeezed(p: Params) -> int:
        return register_cap(p.threads * p.rows_per_block, p.min_blocks)

    def resident(p: Params) -> bool:  # templates row and multirow hold the row in registers
        return p.template != "wide"

    return (
        Rule("template", lambda s, p: p.template in TEMPLATES,
             lambda s, p: f"unknown layernorm template {p.template!r}; use one of {', '.join(TEMPLATES)}"),
        Rule("threads-multiple-of-32", lambda s, p: isinstance(p.threads, int) and not p.threads % 32,
             lambda s, p: f"threads per row must be a multiple of 32, got {p.threads}"),
        Rule("threads-range", lambda s, p: 32 <= p.threads <= 1024,
             lambda s, p: f"threads per row must be 32..1024, got {p.threads}"),
        Rule("vector-width", lambda s, p: p.vector in VECTOR_WIDTHS,
             lambda s, p: f"vector is the bytes of one access of a row, one of {VECTOR_WIDTHS}, got {p.vector}"),
        Rule("vector-width", lambda s, p: _elements(s, p) <= s.d,
             lambda s, p: f"vector={p.vector} bytes is {_elements(s, p)} {_short(s.dtype)} elements, more than the "
                          f"row (d={s.d}); use vector 4"),
        Rule("rsqrt", lambda s, p: p.rsqrt in RSQRT_MODES,
             lambda s, p: f"rsqrt must be one of {RSQRT_MODES}, got {p.rsqrt!r}"),
        Rule("hint", lambda s, p: p.hint in HINTS, lambda s, p: f"hint must be one of {HINTS}, got {p.hint!r}"),
        Rule("stats", lambda s, p: p.stats in STATS, lambda s, p: f"stats must be one of {STATS}, got {p.stats!r}"),
        Rule("grid-cap", lambda s, p: isinstance(p.grid_cap, int) and p.grid_cap >= 0,
             lambda s, p: f"grid_cap is 0 (a block per row group) or a block count, got {p.grid_cap!r}"),
        Rule("weights", lambda s, p: p.weights in WEIGHTS,
             lambda s, p: f"weights must be one of {WEIGHTS}, got {p.weights!r}"),
        Rule("hold", lambda s, p: p.hold in HOLDS, lambda s, p: f"hold must be one of {HOLDS}, got {p.hold!r}"),
        Rule("wide-options", lambda s, p: resident(p) or not (p.grid_cap or p.stats == "one_pass"
                                                              or p.weights == "early" or p.hold != "float"),
             lambda s, p: "template wide takes no grid_cap, stats two_pass (Chan's merge) or shifted, weights late "
                          "or l2 and hold float: one block per row, which holds no row"),
        Rule("wide-options", lambda s, p: resident(p) or p.stats != "shifted" or not s.d % _elements(s, p),
             lambda s, p: "template wide takes stats shifted over rows of whole vectors; use a vector that divides "
                          f"d = {s.d}, or stats two_pass"),
        Rule("hint", lambda s, p: p.hint not in KEEP_HINTS or not (resident(p) or s.d % _elements(s, p)),
             lambda s, p: f"hint {p.hint} keeps a row in L2 between the two passes of template wide, over rows of "
                          "whole vectors; use hint nc"),
        Rule("min-blocks", lambda s, p: isinstance(p.min_blocks, int) and 1 <= p.min_blocks <= 8,
             lambda s, p: f"min_blocks is the blocks per SM to fit, 1..8, got {p.min_blocks!r}"),
        Rule("min-blocks", lambda s, p: p.threads * p.rows_per_block * p.min_blocks <= MAX_THREADS_PER_SM,
             lambda s, p: f"{p.min_blocks} blocks of {p.threads * p.rows_per_block} threads exceed the "
                          f"{MAX_THREADS_PER_SM} threads an SM holds; use fewer blocks or threads"),
        # the shifted statistics' cancellation (the module's doc) within half the output's unit roundoff
        Rule("stats", lambda s, p: p.stats != "shifted" or (element_type(s.dtype).half
                                                             and s.d * 2.0**-24 <= element_type(s.dtype).unit_roundoff),
             lambda s, p: "shifted statistics lose up to 2⁻²⁴·(d + 1) of the variance on the worst row, which only a "
                          "16-bit output of d ≤ 2²⁴·u absorbs (bf16 d ≤ 65536, fp16 d ≤ 8192); this row is "
                          f"{_short(s.dtype)} of d={s.d}: use stats two_pass or one_pass"),
        Rule("hold", lambda s, p: p.hold != "packed" or element_type(s.dtype).half,
             lambda s, p: f"only a 16-bit row can be held packed, this one is {_short(s.dtype)}; leave hold at float"),
        Rule("hold", lambda s, p: p.hold != "packed" or not s.d % _elements(s, p),
             lambda s, p: f"a packed row is held in whole vectors, so vector ({_elements(s, p)} elements) must divide "
                          f"d={s.d}; use hold float or a narrower vector"),
        Rule("weights", lambda s, p: p.weights != "early" or not s.d % _elements(s, p),
             lambda s, p: f"early weights need every row's vectors at the same columns, so vector ({_elements(s, p)} "
                          f"elements) must divide d={s.d}; use weights late or a narrower vector"),
        Rule("weights", lambda s, p: p.weights != "l2" or not s.d * element_type(s.weight_dtype).itemsize % 16,
             lambda s, p: f"a bulk prefetch moves whole 16-byte units, and w of d={s.d} {_short(s.weight_dtype)} is "
                          f"{s.d * element_type(s.weight_dtype).itemsize} bytes; use weights late"),
        Rule("l2-ahead", lambda s, p: isinstance(p.l2_ahead, int) and p.l2_ahead >= 0,
             lambda s, p: f"l2_ahead is KB of rows ahead (0: none), got {p.l2_ahead!r}"),
        Rule("l2-ahead", lambda s, p: not (p.l2_ahead and p.grid_cap),
             lambda s, p: "only a grid of one row group per block (grid_cap 0) asks L2 for a later block's rows; "
                          "leave l2_ahead at 0"),
        Rule("ahead-priority", lambda s, p: resident(p) or p.ahead_priority == "normal",
             lambda s, p: "template wide never gives the rows asked ahead normal priority again once read; leave "
                          "ahead_priority at normal"),
        Rule("ahead-priority", lambda s, p: p.ahead_priority in AHEAD_PRIORITIES,
             lambda s, p: f"ahead_priority must be one of {AHEAD_PRIORITIES}, got {p.ahead_priority!r}"),
        Rule("ahead-priority", lambda s, p: p.ahead_priority == "normal" or p.l2_ahead > 0,
             lambda s, p: "the priority is of the rows asked ahead, and l2_ahead is 0; leave ahead_priority at "
                          "normal or set l2_ahead"),
        Rule("l1", lambda s, p: p.l1 in L1_PRIORITIES,
             lambda s, p: f"l1 must be one of {tuple(L1_PRIORITIES)}, got {p.l1!r}"),
        Rule("l1", lambda s, p: p.l1 == "normal" or p.hint in KEEP_HINTS,
             lambda s, p: "L1 priorities are given to the two passes of a keep hint (template wide), and hint is "
                          f"{p.hint}; leave l1 at normal"),
        Rule("l2-ahead", lambda s, p: not p.l2_ahead or not s.d * element_type(s.dtype).itemsize % 16,
             lambda s, p: "a bulk prefetch moves whole 16-byte units from 16-byte-aligned rows, and a row of "
                          f"d={s.d} {_short(s.dtype)} is {s.d * element_type(s.dtype).itemsize} bytes; leave "
                          "l2_ahead at 0"),
        Rule("rows-per-block", lambda s, p: p.template != "multirow" or (isinstance(p.rows_per_block, int)
                                                                          and p.rows_per_block >= 2),
             lambda s, p: f"template multirow needs 2 or more rows per block, got {p.rows_per_block}; use template "
                          "row for one"),
        Rule("block-size", lambda s, p: p.template != "multirow" or p.threads * p.rows_per_block <= 1024,
             lambda s, p: f"{p.threads} threads × {p.rows_per_block} rows = {p.threads * p.rows_per_block} threads "
                          "exceeds 1024 per block"),
        Rule("rows-per-block", lambda s, p: p.template == "multirow" or p.rows_per_block == 1,
             lambda s, p: f"template {p.template} handles one row per block, got {p.rows_per_block}; use template "
                          "multirow"),
        Rule("idle-threads", lambda s, p: p.threads <= _round_up(s.d // _elements(s, p), 32),
             lambda s, p: f"a row of {s.d // _elements(s, p)} vectors keeps at most "
                          f"{_round_up(s.d // _elements(s, p), 32)} threads busy, got {p.threads}"),
        Rule("registers", lambda s, p: not resident(p) or held(s, p) <= MAX_VALUES_PER_THREAD,
             lambda s, p: f"template {p.template} would hold {held(s, p)} floats per thread (limit "
                          f"{MAX_VALUES_PER_THREAD}); use more threads or template wide"),
        Rule("registers", lambda s, p: not resident(p) or need(s, p) <= register_cap(p.threads * p.rows_per_block),
             lambda s, p: f"{held(s, p)} floats per thread need about {need(s, p)} registers, over the "
                          f"{register_cap(p.threads * p.rows_per_block)} a block of {p.threads * p.rows_per_block} "
                          "threads leaves each; use fewer rows per block, a wider vector, more threads per row or "
                          "template wide"),
        # ptxas is asked to fit min_blocks only where it would not fit them unasked, and never so tightly that the
        # held floats spill
        Rule("min-blocks", lambda s, p: not resident(p) or p.min_blocks <= 1 or need(s, p) > squeezed(p),
             lambda s, p: f"about {need(s, p)} registers per thread fit {p.min_blocks} blocks per SM unasked; leave "
                          "min_blocks at 1"),
        Rule("registers", lambda s, p: not resident(p) or p.min_blocks <= 1
             or held(s, p) + _SQUEEZE_OVERHEAD <= squeezed(p),
             lambda s, p: f"{p.min_blocks} blocks of {p.threads * p.rows_per_block} threads leave {squeezed(p)} "
                          f"registers per thread, too few for the {held(s, p)} floats each holds; use fewer "
                          "min_blocks"),
    )


def _standardized(rows: np.ndarray) -> np.ndarray:
    """rows (float32), in place, each with mean 0 and standard deviation 1 where it has two or more values
    (to fp32's rounding of the sums: what matters is a spread far from 0)."""
    length = rows.shape[1]
    if length < 2:
        return rows
    rows -= rows.mean(axis=1, keepdims=True)
    rows /= np.sqrt(np.einsum("ij,ij->i", rows, rows) / np.float32(length))[:, None]
    return rows


class LayerNorm(OpFamily):
    name = "layernorm"
    tolerance = 1e-5
    params_type = Params
    shape_dims = ("d",)
    shape_options = ("dtype", "weight_dtype", "residual")  # the shape's other fields: --dtype, --config residual=true
    run_dims = ("m",)
    run_defaults = {"m": 4096}
    eps = 1e-5
    min_arch = 70  # ld.global.nc.L1::no_allocate
    norm = "layer"  # the templates' NORM: what the row is normalized by (RMSNorm: "rms")
    eps_meaning = "added to the variance before the square root"
    rules = row_norm_rules(norm)
    peer_builder = LazyFunction("mage_gen.peers", "row_norm_peers",
                                (("torch_fn", "F.layer_norm"), ("triton_kernel", "triton_layernorm")))
    default_candidates = DEFAULT_CANDIDATES
    torch_name = "mage_gen.torch.layer_norm"
    runtime_name = "mage_gen.runtime.layer_norm"
    field_help = {"d": "row length", "m": f"rows at launch (default {run_defaults['m']})",
                  "dtype": "element type of x, y and the residual: fp32 (default), bf16 or fp16; statistics are "
                           "always fp32",
                  "weight_dtype": "element type of w and b: the activations' (default) or fp32"}

    # ---- shapes and params ----
    def shape(self, d: Any = None, dtype: str | None = None, weight_dtype: str | None = None,
              residual: Any = False) -> Shape:
        """dtype: of the activations (default fp32); weight_dtype: of w and b (default: the activations')."""
        if not isinstance(d, int) or isinstance(d, bool):
            raise ConfigError(f"d-range: d must be a whole number, got {d!r}")
        if not 1 <= d <= MAX_D:
            raise ConfigError(f"d-range: d={d} is outside 1..{MAX_D}; give the row length as --d")
        act = element_type(dtype or "float32")
        weight = element_type(weight_dtype) if weight_dtype else act
        if weight not in (act, FLOAT32):
            raise ConfigError(f"weight-dtype: weights are {act.short} (as the activations) or fp32, got {weight.short}")
        if not isinstance(residual, bool):
            raise ConfigError(f"residual: residual is true or false, got {residual!r}")
        if act.half and d % 2:
            raise ConfigError(f"dtype: a {act.short} row is moved at least 4 bytes (2 elements) at a time, so d must be "
                              f"even, got {d}; pad the rows to {d + 1}")
        return Shape(d, act.name, weight.name, residual)

    def min_arch_of(self, shape: Shape, params: Params | None = None) -> int:
        """Packed 16-bit conversions (cvt.rn.bf16x2.f32, cvt.f32.bf16) and L2 cache policies (hint keep) need sm_80;
        the bulk L2 prefetch (l2_ahead, weights l2) sm_90."""
        act, weight = element_type(shape.dtype), element_type(shape.weight_dtype)
        if params is not None and (params.l2_ahead or params.weights == "l2"):
            return 90
        if params is not None and params.hint in KEEP_HINTS:  # createpolicy, loads under .L2::cache_hint
            return 80
        return 80 if act.half or weight.half else self.min_arch

    def args(self, shape: Shape) -> tuple[Arg, ...]:
        act, weight = shape.dtype, shape.weight_dtype
        outputs = [Arg("y", "out", act)] + ([Arg("residual_out", "out", act)] if shape.residual else [])
        inputs = [Arg("x", "in", act)] + ([Arg("residual", "in", act)] if shape.residual else [])
        weights = [Arg("w", "in", weight)] + ([Arg("b", "in", weight)] if self.norm == "layer" else [])
        return (*outputs, *inputs, *weights, Arg("M", "i32"), Arg("eps", "f32"))

    def output_dtypes(self, shape: Shape) -> dict[str, DType]:
        return {a.name: element_type(a.dtype) for a in self.args(shape) if a.kind == "out"}

    def tolerance_of(self, shape: Shape, output: str, dtype: DType) -> float:
        if output == "residual_out":
            return 0.0
        return self.tolerance if dtype == FLOAT32 else 2 * dtype.unit_roundoff + self.tolerance

    def params_from_dict(self, values: dict[str, Any]) -> Params:
        return params_from(Params, self.name, values)

    def params_from_user(self, values: dict[str, Any]) -> Params:
        return public_params_from(Params, self.name, values, frozenset())

    def defaults(self, shape: Shape) -> dict[str, Any]:
        return {}

    def fit_space(self, shape: Shape, axes: dict[str, tuple]) -> dict[str, tuple]:
        return axes

    def params_to_dict(self, params: Params) -> dict[str, Any]:
        return params_dict(params)

    def params_from_format_2(self, params: dict[str, Any], shape: dict[str, Any]) -> dict[str, Any]:
        """Format 2 counted `vector` in elements of the activations (fp32 where the shape does not say)."""
        if not isinstance(params.get("vector"), int):
            return params
        size = {"bfloat16": 2, "float16": 2}.get(shape.get("dtype", "float32"), 4)
        return {**params, "vector": params["vector"] * size}

    # ---- generation ----
    def kernel_name(self, shape: Shape, p: Params) -> str:
        # _v counts elements per access (v4: 16 bytes of fp32), as before `vector` was given in bytes, so
        # that every kernel keeps its name and its tuned entries stay current
        return (f"layernorm_{p.template}_d{shape.d}{self._type_tag(shape)}_t{p.threads}_v{_elements(shape, p)}_r{p.rows_per_block}"
                f"_{p.rsqrt}_{p.hint}" + {"two_pass": "", "one_pass": "_onepass", "shifted": "_shift"}[p.stats]
                + (f"_g{p.grid_cap}" if p.grid_cap else "") + ("" if p.weights == "late" else f"_w{p.weights}")
                + (f"_b{p.min_blocks}" if p.min_blocks > 1 else "") + ("_hpack" if p.hold == "packed" else "")
                + (f"_ahead{p.l2_ahead}k" if p.l2_ahead else "")
                + (f"_evict{p.ahead_priority}" if p.ahead_priority != "normal" else "")
                + L1_PRIORITIES[p.l1][2])

    def _type_tag(self, shape: Shape) -> str:
        """'' for fp32 without residual (the names of every kernel tuned before dtypes), else e.g. _bf16_wf32_res."""
        act, weight = element_type(shape.dtype), element_type(shape.weight_dtype)
        return ((f"_{act.short}" if act != FLOAT32 else "") + (f"_w{weight.short}" if weight != act else "")
                + ("_res" if shape.residual else ""))

    def context(self, shape: Shape, p: Params) -> dict[str, Any]:
        d, t, v, r = shape.d, p.threads, _elements(shape, p), p.rows_per_block
        nvec = d // v
        x_hint, y_hint, wb_hint = _HINT_SUFFIXES[p.hint]
        pass1_hint = "nc" if p.hint != "none" else ""
        if p.hint in KEEP_HINTS:  # both passes and w by the read-only path, at the L1 priorities asked
            pass1_hint, x_hint, _ = L1_PRIORITIES[p.l1]
            wb_hint = pass1_hint
        act, weight = element_type(shape.dtype), element_type(shape.weight_dtype)
        return dict(
            D=d, T=t, V=v, R=r, W=t // 32, BLOCK=t * r, NVEC=nvec, S=_slots(shape, p),
            FULL_SLOTS=nvec // t, PEEL=d % v != 0,
            GUARD_ROWS=r > 1 or p.grid_cap > 0, PERSISTENT=p.grid_cap > 0, STATS=p.stats,
            INV_D=f"{1.0 / d:.9e}f", RSQRT=p.rsqrt,
            X_HINT=x_hint, Y_HINT=y_hint, WB_HINT=wb_hint,
            X_HINT_PASS1=pass1_hint, X_HINT_PASS2=x_hint, UNROLL=4, NORM=self.norm,
            KEEP=p.hint in KEEP_HINTS, KEEP_RELEASE=p.hint == "keep",
            # wide, rows of whole vectors: the chunks of the second pass a thread loads before it stores any
            G=min(4, -(-nvec // t)), XW=v // 2 if act.half else v, WW=v // 2 if weight.half else v,
            ACT=act.c_type, XDT=act.ptx, WT=weight.c_type, WDT=weight.ptx, U=2 if act.half else 1,
            WU=2 if weight.half else 1, RESIDUAL=shape.residual,
            HOLD_PACKED=p.hold == "packed", HELD_TYPE="unsigned" if p.hold == "packed" else "float",
            HELD_WORDS=v // 2 if p.hold == "packed" else v, HELD_ZERO="0u" if p.hold == "packed" else "0.f",
            MIN_BLOCKS=p.min_blocks, WB_EARLY=p.weights == "early", WB_L2=p.weights == "l2", WSIZE=weight.itemsize, WB_TENSORS=_weight_tensors(self.norm), WB_RAW=v // (2 if weight.half else 1),
            L2_AHEAD=p.l2_ahead > 0, ROW_BYTES=d * act.itemsize,
            L2_AHEAD_PRIORITY="" if p.ahead_priority == "normal" else p.ahead_priority,
            # whole row groups, at least the next one
            L2_AHEAD_GROUPS=max(1, (p.l2_ahead << 10) // (r * d * act.itemsize)),
        )

    def source(self, shape: Shape, p: Params) -> Source:
        self.validate(shape, p)
        return render(_TEMPLATE_FILES[p.template], self.context(shape, p), self.kernel_name(shape, p), p)

    # ---- launch ----
    def geometry(self, shape: Shape, p: Params, run: dict[str, int]) -> Launch:
        m = run["m"]
        warps = p.threads // 32
        if warps == 1:
            shared = 0
        elif p.template == "wide":
            shared = 3 * warps * 4
        elif p.stats == "two_pass":
            shared = 2 * p.rows_per_block * warps * 4
        elif p.stats == "shifted":  # two sums per warp; a persistent block alternates two sets between iterations
            shared = (2 if p.grid_cap else 1) * 2 * p.rows_per_block * warps * 4
        else:  # (count, mean, M2) per warp; a persistent block alternates two sets between iterations
            shared = (2 if p.grid_cap else 1) * p.rows_per_block * warps * 3 * 4
        groups = -(-m // p.rows_per_block)
        return Launch(grid=(min(groups, p.grid_cap) if p.grid_cap else groups, 1, 1),
                      block=(p.threads * p.rows_per_block, 1, 1), dynamic_shared_bytes=0,
                      static_shared_bytes=shared)

    def launch_formula(self, shape: Shape, p: Params) -> dict[str, Any]:
        """The launch as a function of the run-time sizes, for code that calls an emitted kernel."""
        launch = self.geometry(shape, p, {"m": 1})
        grid_x = "M" if p.rows_per_block == 1 else f"(M + {p.rows_per_block - 1}) / {p.rows_per_block}"
        if p.grid_cap:
            grid_x = f"min({grid_x}, {p.grid_cap})"
        return {"grid": [grid_x, 1, 1], "block": list(launch.block), "cluster": list(launch.cluster),
                "dynamic_shared_bytes": launch.dynamic_shared_bytes}

    def slug(self, shape: Shape) -> str:
        return f"d{shape.d}" + self._type_tag(shape)

    def shape_key(self, shape: Shape) -> str:
        """The key of a tuned/ entry: one per (d, dtypes, residual), e.g. d=4096/bfloat16,w=float32,residual."""
        return (f"d={shape.d}/{shape.dtype}" + (f",w={shape.weight_dtype}" if shape.weight_dtype != shape.dtype else "")
                + (",residual" if shape.residual else ""))

    def check_run(self, run: dict[str, int]) -> None:
        m = run.get("m")
        if not isinstance(m, int) or isinstance(m, bool) or not 1 <= m <= MAX_ROWS:
            raise ConfigError(f"m-range: rows at launch must be 1..{MAX_ROWS}, got {m!r}")

    def scalars(self, shape: Shape, run: dict[str, int]) -> dict[str, int | float]:
        return {"M": run["m"], "eps": self.eps}

    def make_inputs(self, shape: Shape, run: dict[str, int], rng: np.random.Generator) -> dict[str, np.ndarray]:
        """Each tensor in its element type's storage (dtypes: bf16 as uint16 bits). The rows normalized (x, or
        x + residual) are an offset mean, which makes a one-pass sum-of-squares formula visibly wrong, plus
        deviations standardized to a spread of 0.5-3 in every row: a row whose few values happened to lie close
        together would be ill-conditioned for any fp32 norm (the mean's rounding, an ulp of the offset, against a
        tiny deviation), and no tolerance of the op could tell that from a wrong kernel."""
        m, d = run["m"], shape.d
        act, weight = element_type(shape.dtype), element_type(shape.weight_dtype)
        offset = rng.uniform(-4, 4)
        row = _standardized(rng.standard_normal((m, d), dtype=np.float32))
        row *= np.float32(rng.uniform(0.5, 3))  # in place: at M = 65536 the gate's inputs are 200 MB per check
        row += np.float32(offset)
        if shape.residual:
            residual = act.round(rng.standard_normal((m, d), dtype=np.float32))
            row -= act.widen(residual)  # x + residual is then the row drawn, up to x's rounding
        inputs = {"x": act.round(row)}
        if shape.residual:
            inputs["residual"] = residual
        inputs["w"] = weight.round(rng.standard_normal(d, dtype=np.float32))
        if self.norm == "layer":
            inputs["b"] = weight.round(rng.standard_normal(d, dtype=np.float32))
        return inputs

    def output_shapes(self, shape: Shape, run: dict[str, int]) -> dict[str, tuple[int, ...]]:
        return {name: (run["m"], shape.d) for name in self.output_dtypes(shape)}

    def reference(self, shape: Shape, inputs: dict[str, np.ndarray], scalars: dict[str, int | float]) -> dict[str, np.ndarray]:
        """float64 from the exact inputs, each output rounded to its element type (and held as float64)."""
        act, weight = element_type(shape.dtype), element_type(shape.weight_dtype)
        extra: dict[str, np.ndarray] = {}
        if shape.residual:  # as torch adds two tensors of the activation type: in fp32, rounded once
            row = act.round(act.widen(inputs["x"]) + act.widen(inputs["residual"]))
            extra["residual_out"] = act.widen(row).astype(np.float64)
            y = extra["residual_out"].copy()
        else:
            y = act.widen(inputs["x"]).astype(np.float64)
        self._normalize(shape, y, {k: weight.widen(inputs[k]).astype(np.float64) for k in ("w", "b") if k in inputs},
                        float(scalars["eps"]))
        return {"y": y if act == FLOAT32 else act.widen(act.round(y)).astype(np.float64), **extra}

    def _normalize(self, shape: Shape, y: np.ndarray, weights: dict[str, np.ndarray], eps: float) -> None:
        # Two passes over the centred rows, in place on one float64 copy: the gate computes this for every
        # check, and at M = 65536 the temporaries of the plain formula cost seconds per trial.
        y -= y.mean(axis=1, keepdims=True)
        var = np.einsum("ij,ij->i", y, y)[:, None] / shape.d
        y *= 1.0 / np.sqrt(var + eps)
        y *= weights["w"]
        y += weights["b"]

    def gate_runs(self, shape: Shape, run: dict[str, int], params: Params) -> list[dict[str, int]]:
        """One row; an odd count that leaves a multirow block part-filled; and the size being tuned, capped
        where fresh inputs and a float64 reference of it would cost the CPU seconds per check. The cap still
        has every block of a persistent grid walk its rows twice and leaves its last row group part-filled;
        the tuned size itself is checked on the timing inputs (measure.Bench.checked_subject)."""
        sweep = params.grid_cap * params.rows_per_block
        covering = max(GATE_ELEMENTS // shape.d, 2 * sweep + 37)
        return [{"m": m} for m in dict.fromkeys((1, 37, min(run["m"], covering)))]

    def bytes_moved(self, shape: Shape, run: dict[str, int]) -> int:
        """The fewest bytes a layer norm must move: x (and residual) read once, y (and residual_out) written
        once, w and b read once."""
        act, weight = element_type(shape.dtype), element_type(shape.weight_dtype)
        rows = (4 if shape.residual else 2) * run["m"] * shape.d * act.itemsize
        return rows + (2 if self.norm == "layer" else 1) * shape.d * weight.itemsize

    def contract(self, shape: Shape, p: Params) -> dict[str, Any]:
        """What code launching the emitted kernel must guarantee; M is the one size given at launch."""
        ctx = self.context(shape, p)
        act, weight = element_type(shape.dtype), element_type(shape.weight_dtype)
        # The rows move V elements per access, and where V does not divide d each row's head is worked out from
        # the row index alone: every row tensor's base pointer is assumed V-element aligned.
        rows = act.itemsize * ctx["V"]
        if p.l2_ahead:  # the bulk prefetch of a later block's rows starts at a row, in 16-byte units
            rows = max(rows, 16)
        # w and b are read V elements at a time only where every row's vector body starts at column 0; else a
        # unit (one fp32, or two 16-bit elements) at a time.
        # (at most 16: fp32 weights beside 8 bf16 elements are two 16-byte loads)
        columns = min(16, weight.itemsize * (ctx["WU"] if ctx["PEEL"] else ctx["V"]))
        if p.weights == "l2":  # the bulk prefetch of w and b starts at their first element, in 16-byte units
            columns = 16
        tensors = {}
        for arg in self.args(shape):
            if arg.kind in ("in", "out") and arg.name in ("w", "b"):
                tensors[arg.name] = {"dtype": arg.dtype, "shape": [shape.d], "layout": "contiguous",
                                     "alignment_bytes": columns}
            elif arg.kind in ("in", "out"):
                tensors[arg.name] = {"dtype": arg.dtype, "shape": ["M", shape.d],
                                     "layout": f"row-major, contiguous, row stride {shape.d} elements",
                                     "alignment_bytes": rows}
        outputs = [a.name for a in self.args(shape) if a.kind == "out"]
        others = [name for name in tensors if name not in outputs]
        written = " and ".join(outputs) + (" must not overlap each other or " if len(outputs) > 1 else " must not overlap ")
        return {
            "tensors": tensors,
            "aliasing": written + ", ".join(others[:-1]) + f" or {others[-1]}"
                        + " (no in-place use): every pointer is declared __restrict__",
            "scalars": {"M": {"meaning": "rows of x and y", "range": [1, MAX_ROWS]},
                        "eps": {"meaning": self.eps_meaning, "default": self.eps}},
        }


OP = LayerNorm()
