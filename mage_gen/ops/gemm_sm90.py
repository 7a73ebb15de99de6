"""Matrix product on Hopper's tensor cores: wgmma fed by TMA under mbarriers, warp-specialized and persistent.

C = A·Bᵀ with A M×K and B N×K (`b_layout` nk, an nn.Linear weight: both operands K-major), or C = A·B with B
K×N (kn: B N-major, which wgmma reads through its transpose bit), bf16 in, fp32 accumulation, C bf16 or fp32,
row-major. `precision` e4m3: A and B fp8 (K-major both, nk only), C = scale_a·scale_b·A·Bᵀ with two fp32 scales
taken by pointer after B, as torch._scaled_mm takes them; a stage is still 128 bytes of K (128 elements), a wgmma
k32. e4m3_block: scale_a holds a scale per row of A and 128 of K, scale_b one per 128×128 block of B (DeepGEMM's
layout); each stage's sums are kept apart and added to C's times their row's and column block's scales (the
promotion to fp32), which also keeps the tensor cores' narrower fp8 sums to 128 products. M, N and K are fixed when the kernel is generated. Rows of A and B are read by TMA, which
needs each row to start on 16 bytes: a K that is not a multiple of 8 is taken with rows padded to the next
multiple (the tensors' row stride, `lda`, says so), and past K, M and N a copy brings zeros, so tails cost
nothing but the guards of C's stores.

One template, `ws` (templates/gemm_sm90/ws.cu.j2): a persistent grid of at most `grid` CTAs (the search space
gives one per SM), each of 1 + `consumers` warpgroups. The producer's one thread copies BK = 64-element (128-byte)
slices of K of a BM×BN tile into `stages` shared-memory stages; the consumers multiply them with wgmma (each
BM/consumers rows, as m64 slabs, N = BN) and store C from registers (`epilogue` direct) or through shared memory
and a TMA store (tma), which needs rows of C on 16 bytes: where N does not allow it (N·size not a multiple of 16),
`tma` stores from registers too, and the kernel's name says so. `producer_regs` moves registers from the producer warpgroup to the consumers
(setmaxnreg); `inflight` 1 keeps one stage's wgmma group running while the next is issued.

`split_k` > 1 splits K: a unit of work is a tile's slice of K (its BK steps shared out as evenly as whole steps
allow), so that few tiles (small M) still fill the GPU. Each unit stores its fp32 partial tile to a workspace and
counts itself in on the tile's counter (a release); the last to arrive sums the split_k partials in slice order,
0 first, whichever unit it is (the result does not depend on the order the units finish in), stores C and sets
the counter back to zero. The workspace (`workspace_floats`) and the counters (`counters`, zero on entry and left
zero) are kernel arguments after B (launch_args); with split_k 1 the kernel is the one it was before.
`split_sum` cluster sums the slices in distributed shared memory instead: a tile's split_k units are one cluster's
CTAs (rank = slice, a CTA per unit); each stores its partial into its own stages (all consumed by then), the cluster
meets at a barrier, and CTA 0 reads the others' partials (ld.shared::cluster) and sums them in slice order, the same
sums in the same order as through the workspace, with no workspace, counters, gpu-scope fence or atomic; a second
cluster barrier at the end keeps every CTA's shared memory until CTA 0 has read it.
`split_sum` ticket takes the last unit's own partial off its path: each unit takes a ticket on the tile's counter as its last K step
begins (the atomic's round trip under that step); the units before the last store their partials and count them on
a second counter (a release), and the one with the last ticket stores nothing: it waits until the second counter
says the others' partials are stored (an acquire; they took their tickets first and wait for nothing but their own
copies, so the wait ends), sums in slice order (its own from its registers), stores C and sets both counters back
to zero.

`stream_k` deals the last tiles' BK steps evenly over the persistent grid's G CTAs (CTA c takes steps c·I/G to
(c+1)·I/G − 1 of their I, tile after tile), so that no CTA idles through a last, partial wave; a CTA's share may begin
or end inside a tile. Before those, each CTA takes whole tiles in the data-parallel order (c, c + G, ...): all but
the last, partial wave, or all but the last one and a half waves where that one is under half the grid
(`stream_waves`). Streamed tiles in flight at once sit at unrelated depths of K and share no operand slice, so that
where their operands outgrow L2 each CTA would read its own from DRAM. A tile taken whole is stored at once; the
pieces of one taken by several CTAs are summed as split K's slices are, in CTA order whichever arrives last (each
CTA keeps two partial tiles in the workspace: its first piece and its last).

`swap` has the kernel compute Cᵀ = B·Aᵀ (`computed`): its tiles, units and guards are of that product, its first
operand's map is B's and its second A's, and it stores Cᵀ's (row, col) at C's (col, row), so that a few tokens take
wgmma's narrow N rather than a mostly empty 64-row slab.

`gate` silu (SwiGLU, an MLP's gate and up projections in one weight): B holds the gate's N/2 rows and then the up's
N/2, and C (M × N/2) = silu(A·B_gateᵀ) ⊙ A·B_upᵀ. A tile's BN columns of B are BN/2 rows of each half (two TMA
copies a stage, into one BN-row tile), so the thread that holds a gate sum holds its up sum, BN/2 columns on, and
the epilogue multiplies them in registers: the M × N product never reaches memory, and nothing runs after the
kernel. The main loop is the plain product's, so a gated shape with no entry of its own runs its plain weight's
(dispatch.CLASS_RULE).

`bias` adds a vector of N (one per row of B, C's type) to the sums before anything else is done with them (a
gated product's gate and up columns each their own); `residual` adds a tensor of C's shape and type (`residual`)
last, after the gate: C = gate(A·Bᵀ + bias) + R, rounded once, as a layer's `h + down(x)` or a biased nn.Linear
wants without a kernel after the product.

The gate's tolerance: products of bf16 are exact in fp32, so the error is the fp32 accumulation over K (at most
about K·2⁻²⁴ relative, far less in norm) and, for a bf16 C, one rounding to bf16 (its unit roundoff 2⁻⁸ bounds
the relative norm): 2⁻²⁴·K + 1e-6, plus 2⁻⁸ where C is bf16.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np

from mage_gen.dtypes import BFLOAT16, E4M3, FLOAT32, DType
from mage_gen.errors import ConfigError
from mage_gen.ops.base import (WAVES, Arg, LazyFunction, Launch, OpFamily, Rule, Stored, TensorMapSpec, check_rules,
                               fill_rows, params_dict, params_from, product64, public_params_from)
from mage_gen.render import Source, render

PRECISIONS = ("bf16", "e4m3", "e4m3_block")
ELEMENTS = {"bf16": BFLOAT16, "e4m3": E4M3, "e4m3_block": E4M3}  # what A and B hold, by precision
SCALE_RANGE = (0.5, 2.0)  # what the gate's scales are drawn from
SCALE_BLOCK = 128  # e4m3_block: a scale per row and 128 of K for A, per 128×128 block for B (DeepGEMM's layout)
OUTPUTS = {"bf16": BFLOAT16, "fp32": FLOAT32}
GATES = ("none", "silu")  # silu: C = silu(A·B_gateᵀ) ⊙ A·B_upᵀ, B the two halves' rows stacked
B_LAYOUTS = ("nk", "kn")  # B as N×K row-major (C = A·Bᵀ), or K×N (C = A·B)
MAX_DIM = 1 << 20
ROW_BYTES = 128  # of K per stage in each row of an operand's tile: the 128-byte swizzle's span
KSTEP_BYTES = 32  # of K one wgmma takes: k16 of bf16, k32 of e4m3
SWIZZLE = 128
SBO = 8 * 128  # bytes between 8-row groups of a 128-byte-swizzled tile
MAX_SHARED_BYTES = 227 * 1024  # the opt-in limit per block on sm_90
REGISTER_FILE = 65536  # 32-bit registers of an SM (sm_90)
ORDERS = ("row", "grouped", "hilbert")
CLUSTERS = (1, 2)
MULTICASTS = ("b", "a")  # which operand a cluster's CTAs share: B (tiles of one column) or A (of one row)
SCHEDULES = ("cooperative", "pingpong")
# A Hilbert order's table of tiles, 4 bytes each: in constant memory up to its 64 KB, else in global memory (read
# once a tile, through the read-only path), up to a size whose initializer still compiles in seconds
CONSTANT_ORDER_TABLE, MAX_ORDER_TABLE = 16384, 1 << 18
EPILOGUES = ("direct", "tma")
CHAINS = (1, 2, 4)
# test-only bugs the gate must catch: the descriptors' swizzle differs from the tensor maps', the stride byte
# offset is half what it is, the producer waits for a phase a fresh barrier has not completed (a hang), the TMA
# store reads the staging tile without the proxy fence after the threads wrote it; under split K, the counter is
# left at split_k (not reset), the last unit sums its own partial first, the partials are published with no
# release fence
PLANTED_BUGS = ("", "swizzle", "sbo", "phase", "proxy_fence", "split_reset", "split_order", "split_fence")
SPLIT_PLANTS = ("split_reset", "split_order", "split_fence")
# where split K's partials meet: a workspace (the last unit to arrive sums), the same workspace with the summing unit
# chosen by ticket, or a cluster's shared memory
SPLIT_SUMS = ("global", "ticket", "cluster")
MAX_SPLIT_K = 16
_HIDDEN = frozenset({"plant", "watchdog_ms", "stamps", "early_copies"})
# stamps (a probe's, bench/probes/gemm_sm90_timeline.py): the first STAMP_CTAS CTAs each record STAMP_SLOTS words in
# the module's global mg_stamps: when it entered, first copied, first found a stage full, ended its main loops, ended,
# and (the last slot) when its threads had met after the barriers' setup
STAMP_CTAS, STAMP_SLOTS = 4096, 9
# A wait on an mbarrier that outlasts this traps: a launch that would hang fails instead
WATCHDOG_MS = 4000


def padded(elements: int, dtype: DType) -> int:
    """A row of `elements` rounded up to a whole 16 bytes, as TMA needs each row to start."""
    per = 16 // dtype.itemsize
    return -(-elements // per) * per


@dataclass(frozen=True)
class Shape:
    m: int
    n: int
    k: int
    precision: str = "bf16"
    c_dtype: str = "bf16"  # C's element type
    b_layout: str = "nk"
    gate: str = "none"
    bias: bool = False  # C += a vector of N (C's type), before the gate
    residual: bool = False  # C += a tensor like C, last

    @property
    def c_cols(self) -> int:
        """Columns of C: N, or gated the N/2 that each pair a gate row of B with an up row."""
        return self.n // 2 if self.gate != "none" else self.n

    @property
    def lda(self) -> int:
        """Elements from one row of A (and of an N×K B) to the next."""
        return padded(self.k, self.element)

    @property
    def ldb(self) -> int:
        """Elements from one row of B to the next."""
        return self.lda if self.b_layout == "nk" else padded(self.n, self.element)

    @property
    def element(self) -> DType:
        """What A and B hold."""
        return ELEMENTS.get(self.precision, BFLOAT16)

    @property
    def bk(self) -> int:
        """Elements of K per stage: 64 of bf16, 128 of e4m3 (128 bytes either way)."""
        return ROW_BYTES // self.element.itemsize

    @property
    def b_rows(self) -> int:
        return self.n if self.b_layout == "nk" else self.k


@dataclass(frozen=True)
class Params:
    bm: int = 128
    bn: int = 128
    stages: int = 4
    consumers: int = 2
    # cooperative: the consumers split each tile's rows; pingpong: they take the tiles in turn, a whole one each
    schedule: str = "cooperative"
    cluster: int = 1  # CTAs of a cluster: 2 take two tiles that share an operand, each copying half of it into both
    multicast: str = "b"  # the operand they share: B (tiles of one column) or A (of one row)
    order: str = "grouped"  # how a CTA's (cluster's) turns walk the tiles: by rows, by super-rows, on a Hilbert curve
    group: int = 8  # tile rows of a super-row (order grouped)
    producer_regs: int = 40  # registers per thread the producer keeps (setmaxnreg); 0: no redistribution
    inflight: int = 1  # wgmma groups left running while the next stage's are issued: 0 or 1
    # accumulator sets a stage's k16 steps are dealt over in turn, added at the tile's end: a small tile's wgmmas
    # then need not each wait for the one before
    chains: int = 1
    epilogue: str = "direct"
    grid: int = 0  # CTAs of the persistent grid, at most one per tile; 0: one per tile
    split_k: int = 1  # slices of K a tile is split into, each a unit of work; their partials summed in order
    split_sum: str = "global"  # where the slices' partials meet: a workspace in global memory, or a cluster's shared
    # the K steps of the last, partial wave of tiles dealt evenly over the grid's CTAs, pieces summed in CTA order
    stream_k: bool = False
    # the kernel computes Cᵀ = B·Aᵀ: its m64 slabs run over N and wgmma's N over M (a few tokens), C stored transposed
    swap: bool = False
    plant: str = ""  # a deliberate bug, for the tests of the gate only
    watchdog_ms: int = WATCHDOG_MS
    stamps: bool = False  # clocks of the CTAs' phases into mg_stamps, for a probe only
    # a probe's too: the producer's warpgroup arrives at the setup barrier (bar.arrive) and goes on to its first
    # copies, the consumers alone waiting there for it (thread 0 made every barrier the producer uses)
    early_copies: bool = False

    @property
    def threads(self) -> int:
        return 128 * (1 + self.consumers)

    def label(self) -> str:
        return (f"{self.bm}x{self.bn} s{self.stages} c{self.consumers}" + (" pingpong" if self.schedule == "pingpong" else "")
                + (f" x{self.cluster}{self.multicast}" if self.cluster > 1 else "")
                + f" {self.order}"
                + (f"{self.group}" if self.order == "grouped" else "") + f" r{self.producer_regs} f{self.inflight}"
                + (f" chains{self.chains}" if self.chains > 1 else "")
                + f" {self.epilogue}" + (f" grid≤{self.grid}" if self.grid else "")
                + (f" split{self.split_k}" if self.split_k > 1 else "")
                + (" in a cluster" if cluster_sum(self) else "") + (" by ticket" if ticket_sum(self) else "")
                + (" stream-k" if self.stream_k else "")
                + (" swap" if self.swap else "")
                + (" early copies" if self.early_copies else "") + (" stamps" if self.stamps else "")
                + (f" PLANTED {self.plant}" if self.plant else ""))


def computed(shape: Shape, p: Params) -> Shape:
    """The product the kernel computes: the shape, or with swap Cᵀ = B·Aᵀ (M and N exchanged), which its tiles,
    units and guards are of."""
    return dataclasses.replace(shape, m=shape.n, n=shape.m) if p.swap else shape


def _tiles(shape: Shape, p: Params) -> tuple[int, int]:
    product = computed(shape, p)
    return -(-product.m // p.bm), -(-product.n // p.bn)


def _shares(p: Params) -> tuple[int, int]:
    """CTAs that copy a part of the A tile, and of the B tile, each into all of them (multicast)."""
    return (p.cluster, 1) if p.multicast == "a" else (1, p.cluster)


def _units(shape: Shape, p: Params) -> tuple[int, int]:
    """What a CTA (a cluster) takes in turn: a tile, or a cluster's column (row, sharing A) of `cluster` tiles."""
    tiles_m, tiles_n = _tiles(shape, p)
    share_a, share_b = _shares(p)
    return -(-tiles_m // share_b), -(-tiles_n // share_a)


def wave_tile(shape: Shape, bm: int, sms: int) -> int:
    """The N tile (a multiple of 16, of 64 for a K×N B, up to 256) whose tiles fill `sms` SMs best in no more waves
    than the widest tile's take: the most tiles per CTA slot over the waves they take, ceil(tiles / sms) (the larger
    tile on a tie: fewer, longer tiles). At M = 16, N = 4096 on 132 SMs: 32 (128 tiles in one wave of 132, against
    64 tiles with 64). Where 256-wide tiles take several waves, a narrower tile that fills its more waves better
    would read every row of A more times for a smaller share of idle SMs (at 512×57344, 16 against 256)."""
    step = 16 if shape.b_layout == "nk" else 64
    tiles_m = -(-shape.m // bm)

    def waves(bn: int) -> int:
        return -(-tiles_m * -(-shape.n // bn) // sms)

    def filled(bn: int) -> float:
        return tiles_m * -(-shape.n // bn) / (waves(bn) * sms)

    widest = 256 // step * step
    fewest = [bn for bn in range(step, widest + 1, step) if waves(bn) <= waves(widest)]
    return max(fewest, key=lambda bn: (round(filled(bn), 9), bn))


def _kblocks(shape: Shape) -> int:
    return -(-shape.k // shape.bk)


def _workspace_tiles(shape: Shape, p: Params) -> tuple[int, int]:
    """Tile rows and columns the workspace and counters hold: every tile a unit may name (a cluster's last tiles may
    lie past M or N)."""
    units_m, units_n = _units(shape, p)
    share_a, share_b = _shares(p)
    return units_m * share_b, units_n * share_a


def reduces(p: Params) -> bool:
    """Whether a tile may be computed in pieces summed through the workspace (split K or stream K)."""
    return (p.split_k > 1 and not cluster_sum(p)) or p.stream_k


def ticket_sum(p: Params) -> bool:
    """Whether the unit that sums a tile's split-K partials is the one with its last ticket, which stores none."""
    return p.split_k > 1 and p.split_sum == "ticket"


def cluster_sum(p: Params) -> bool:
    """Whether a tile's split-K slices are a cluster's CTAs, summed in distributed shared memory."""
    return p.split_k > 1 and p.split_sum == "cluster"


def launch_cluster(p: Params) -> int:
    """CTAs in a cluster: the tiles that share a copy (cluster), or a tile's slices summed together."""
    return p.split_k if cluster_sum(p) else p.cluster


def stream_ctas(shape: Shape, p: Params) -> int:
    """stream_k: the CTAs the tiles' BK steps are dealt over, the grid, at most one per step."""
    return min(p.grid, int(np.prod(_units(shape, p))) * _kblocks(shape))


def stream_waves(shape: Shape, p: Params) -> int:
    """stream_k: the waves of tiles each CTA takes whole before its share of the rest. The rest is the last, partial
    wave, and a whole wave more where that one is under half the grid, so that a CTA's share is half a tile to one
    and a half and a tile's pieces few. Streamed, the tiles in flight at once sit at unrelated depths of K and share
    no operand slice: the fewer of them, the less is read twice."""
    units, ctas = int(np.prod(_units(shape, p))), stream_ctas(shape, p)
    return units // ctas if 2 * (units % ctas) >= ctas else max(0, units // ctas - 1)


def workspace_floats(shape: Shape, p: Params) -> int:
    """fp32 words of the workspace: split K, a partial tile for every slice of every tile; stream K, two partial
    tiles per CTA (its first piece and its last); 0 otherwise."""
    if p.stream_k:
        return 2 * stream_ctas(shape, p) * p.bm * p.bn
    if not reduces(p):
        return 0
    rows, cols = _workspace_tiles(shape, p)
    return p.split_k * rows * cols * p.bm * p.bn


def counters(shape: Shape, p: Params) -> int:
    """32-bit counters of the reduction, one per tile, and under split_sum ticket a second per tile (the partials
    stored); 0 where nothing reduces."""
    return int(np.prod(_workspace_tiles(shape, p))) * (2 if ticket_sum(p) else 1) if reduces(p) else 0


def consumer_rows(p: Params) -> int:
    """Rows of a tile one consumer computes and stores."""
    return p.bm if p.schedule == "pingpong" else p.bm // p.consumers


def hilbert_order(rows: int, cols: int) -> list[tuple[int, int]]:
    """Every (row, col) of a rows×cols grid, in the order a Hilbert curve over the smallest power-of-two square
    that covers the grid visits them: consecutive cells are neighbours wherever the curve stays inside the grid."""
    side = 1
    while side < max(rows, cols):
        side *= 2
    cells = []
    for d in range(side * side):
        x = y = 0
        t, s = d, 1
        while s < side:  # the curve's index d to its cell, one quadrant level at a time
            rx = 1 & (t // 2)
            ry = 1 & (t ^ rx)
            if ry == 0:
                if rx == 1:
                    x, y = s - 1 - x, s - 1 - y
                x, y = y, x
            x += s * rx
            y += s * ry
            t //= 4
            s *= 2
        if y < rows and x < cols:
            cells.append((y, x))
    return cells


def out_bn(shape: Shape, p: Params) -> int:
    """Columns of C a tile stores: BN, or gated BN/2 (a gate and an up sum make one)."""
    return p.bn // 2 if shape.gate != "none" else p.bn


def _accumulators(p: Params) -> int:
    """Floats of C a consumer thread holds: BN/2 for each 64-row slab of its rows."""
    return consumer_rows(p) // 64 * p.bn // 2


def consumer_regs(p: Params) -> int:
    """What setmaxnreg gives each consumer thread: the register file less the producer's, in steps of 8."""
    return min(256, (REGISTER_FILE // 128 - p.producer_regs) // p.consumers // 8 * 8)


def epilogue(shape: Shape, p: Params) -> str:
    """How the kernel stores C: as asked, except that a TMA store needs rows of C on 16 bytes and, gated, a tile of C
    (BN/2 columns) of whole 128-byte boxes, so that a plain product's params serve its gated form."""
    item = OUTPUTS[shape.c_dtype].itemsize
    if (shape.c_cols * item) % 16 or (out_bn(shape, p) * item) % 128:
        return "direct"
    return p.epilogue


def c_pairs(shape: Shape, p: Params) -> bool:
    """Whether registers store C two elements at a time: rows of an even length, not transposed (swap)."""
    return shape.c_cols % 2 == 0 and not p.swap


def _scale_shapes(shape: Shape) -> dict[str, tuple[int, ...]]:
    """The scales' shapes: one each (e4m3), or per block (e4m3_block): A's (M, K/128), B's (N/128, K/128)."""
    if shape.precision == "bf16":
        return {}
    if shape.precision == "e4m3":
        return {"scale_a": (1,), "scale_b": (1,)}
    blocks = -(-shape.k // SCALE_BLOCK)
    return {"scale_a": (shape.m, blocks), "scale_b": (-(-shape.n // SCALE_BLOCK), blocks)}


def _epilogue_slug(shape: Shape, sep: str) -> str:
    """What the epilogue adds to the product, for names and keys: '' for a plain product."""
    parts = ([f"gate={shape.gate}"] if shape.gate != "none" else []) + [name for name in ("bias", "residual")
                                                                        if getattr(shape, name)]
    if sep == "_":
        parts = [part.replace("gate=", "g") for part in parts]
    return "".join(sep + part for part in parts)


def input_sizes(shape: Shape) -> tuple[float, float]:
    """(the spread of A's and B's values, that of a bias's and a residual's): e4m3 normal values times 8, most codes'
    exponents in use; a bias and a residual as large as the product's elements (spread² · √K)."""
    spread = 8.0 if shape.precision == "e4m3" else 1.0
    return spread, spread ** 2 * shape.k ** 0.5


def _epilogue64(shape: Shape, c: np.ndarray, inputs: dict[str, np.ndarray]) -> np.ndarray:
    """The product as the epilogue finishes it, in float64: + bias, the gate, + residual."""
    out = OUTPUTS[shape.c_dtype]
    if shape.bias:
        c = c + out.widen(inputs["bias"]).astype(np.float64)
    if shape.gate == "silu":
        gate, up = c[:, :shape.c_cols], c[:, shape.c_cols:]
        with np.errstate(over="ignore"):  # exp(-gate) is inf far below zero, where silu is -0
            c = gate / (1 + np.exp(-gate)) * up
    if shape.residual:
        c = c + out.widen(inputs["residual"]).astype(np.float64)
    return c


def _block_scaled(shape: Shape, a: np.ndarray, b: np.ndarray, scale_a: np.ndarray, scale_b: np.ndarray) -> np.ndarray:
    """Σ over 128-deep blocks of K of A_blk·B_blkᵀ times A's row scale and B's block scale, as one product: each
    element of A times its row's scale for its block of K, each of B times its block's. An e4m3 value (4 significant
    bits) times a float32 scale (24) is exact in float64, so each term is A·B·scale_a·scale_b exactly; the kernel
    rounds each scale_a·scale_b to fp32 first, 2⁻²⁴ relative, far inside the gate's tolerance."""
    blocks = np.arange(shape.k) // SCALE_BLOCK
    a_scaled = a * scale_a.astype(np.float64)[:, blocks]
    b_scaled = b * scale_b.astype(np.float64)[np.arange(shape.n) // SCALE_BLOCK][:, blocks]
    return product64(a_scaled, b_scaled.T)


def _shared_bytes(shape: Shape, p: Params) -> int:
    out = OUTPUTS[shape.c_dtype]
    staging = p.consumers * consumer_rows(p) * out_bn(shape, p) * out.itemsize if epilogue(shape, p) == "tma" else 0
    order = 16 if p.schedule == "pingpong" else 0  # the consumers' two turn barriers
    flags = 8 if reduces(p) else 0  # each tile's consumers agree there on which unit arrived last
    return 1024 + p.stages * (p.bm + p.bn) * ROW_BYTES + staging + 2 * 8 * p.stages + order + flags  # 1024: to align


_SHAPE_RULES = (
    Rule("precision", lambda s: s.precision in PRECISIONS, lambda s: f"precision is one of {PRECISIONS}, got {s.precision!r}"),
    Rule("precision", lambda s: s.precision == "bf16" or s.b_layout == "nk",
         lambda s: f"an {s.precision} wgmma reads both operands K-major: B must be N×K (b_layout nk), got {s.b_layout}"),
    Rule("c-dtype", lambda s: s.c_dtype in OUTPUTS, lambda s: f"c_dtype (C's element type) is one of {tuple(OUTPUTS)}, got {s.c_dtype!r}"),
    Rule("b-layout", lambda s: s.b_layout in B_LAYOUTS,
         lambda s: f"b_layout is one of {B_LAYOUTS} (nk: B as N×K, an nn.Linear weight; kn: K×N), got {s.b_layout!r}"),
    Rule("gate", lambda s: s.gate in GATES, lambda s: f"gate is one of {GATES}, got {s.gate!r}"),
    Rule("addends", lambda s: isinstance(s.bias, bool) and isinstance(s.residual, bool),
         lambda s: f"bias and residual are true or false, got {s.bias!r} and {s.residual!r}"),
    Rule("gate", lambda s: s.gate == "none" or (s.n % 2 == 0 and s.b_layout == "nk" and s.precision != "e4m3_block"),
         lambda s: f"gate {s.gate} pairs the gate's rows of an N×K B (b_layout nk) with the up's, N/2 apart: N must be "
                   f"even, and per-block scales are not taken; got N={s.n}, b_layout {s.b_layout}, precision "
                   f"{s.precision}"),
)


def _register_room(s: Shape, p: Params) -> bool:
    budget = consumer_regs(p) if p.producer_regs else REGISTER_FILE // p.threads // 8 * 8
    return _held(s, p) + 40 <= min(budget, 255)


def _held(s: Shape, p: Params) -> int:
    """Floats a consumer thread holds: its accumulators, once per chain, and twice over with block scales (a
    stage's sums apart)."""
    return _accumulators(p) * p.chains * (2 if s.precision == "e4m3_block" else 1)


_RULES: tuple[Rule, ...] = (
    Rule("tile", lambda s, p: p.bm in (64, 128, 256), lambda s, p: f"bm is 64, 128 or 256 rows, got {p.bm}"),
    Rule("tile", lambda s, p: p.bn % 16 == 0 and 16 <= p.bn <= 256,
         lambda s, p: f"bn is a multiple of 16 in 16..256 (a wgmma's N), got {p.bn}"),
    Rule("consumers", lambda s, p: p.consumers in (1, 2), lambda s, p: f"consumers is 1 or 2 warpgroups, got {p.consumers}"),
    Rule("consumers", lambda s, p: p.schedule in SCHEDULES,
         lambda s, p: f"schedule is one of {SCHEDULES}, got {p.schedule!r}"),
    Rule("consumers", lambda s, p: p.schedule == "pingpong" or p.bm % (64 * p.consumers) == 0,
         lambda s, p: f"{p.consumers} consumers split bm={p.bm} rows into m64 slabs: bm must be a multiple of "
                      f"{64 * p.consumers}"),
    Rule("consumers", lambda s, p: p.schedule == "cooperative" or p.consumers == 2,
         lambda s, p: f"pingpong takes tiles by turns of two consumers, got {p.consumers}"),
    Rule("stages", lambda s, p: 2 <= p.stages <= 16, lambda s, p: f"stages is 2..16, got {p.stages}"),
    Rule("order", lambda s, p: p.order in ORDERS, lambda s, p: f"order is one of {ORDERS}, got {p.order!r}"),
    Rule("order", lambda s, p: p.group >= 1, lambda s, p: f"group is a positive number of tile rows, got {p.group}"),
    # a group other than the default changes nothing but the grouped order: two names for one kernel otherwise
    Rule("order", lambda s, p: p.order == "grouped" or p.group == Params.group,
         lambda s, p: f"group is the super-row of order grouped; with order {p.order} leave it at {Params.group}"),
    Rule("order", lambda s, p: p.order != "hilbert" or (np.prod(_units(s, p)) <= MAX_ORDER_TABLE
                                                         and max(_units(s, p)) < 1 << 16),
         lambda s, p: f"a Hilbert order lists its {' × '.join(map(str, _units(s, p)))} tiles in a table, at most "
                      f"{MAX_ORDER_TABLE} and fewer than 65536 a side; use order grouped"),
    Rule("cluster", lambda s, p: p.cluster in CLUSTERS, lambda s, p: f"cluster is one of {CLUSTERS} CTAs, got {p.cluster}"),
    Rule("cluster", lambda s, p: p.multicast in MULTICASTS,
         lambda s, p: f"multicast is one of {MULTICASTS} (the operand a cluster shares), got {p.multicast!r}"),
    # the other value changes nothing without a cluster: two names for one kernel otherwise
    Rule("cluster", lambda s, p: p.cluster > 1 or p.multicast == Params.multicast,
         lambda s, p: f"multicast is what a cluster shares; with cluster 1 leave it at {Params.multicast!r}"),
    Rule("cluster", lambda s, p: p.multicast == "b" or (p.bm // p.cluster) % 8 == 0,
         lambda s, p: f"each CTA of the cluster copies bm/{p.cluster} rows of A: {p.bm} must split into 8-row groups"),
    # an N-major B tile arrives as boxes of 64 columns (128 bytes, the swizzle's span), each CTA of a cluster
    # copying whole boxes
    Rule("b-layout", lambda s, p: s.b_layout == "nk" or p.bn % (64 * _shares(p)[1]) == 0,
         lambda s, p: f"with B K×N (kn) the B tile comes in boxes of 64 columns: bn={p.bn} must be a multiple of "
                      f"{64 * _shares(p)[1]}" + (" where a cluster shares B" if _shares(p)[1] > 1 else "")),
    Rule("chains", lambda s, p: p.chains in CHAINS,
         lambda s, p: f"chains is one of {CHAINS} accumulator sets (a stage's {ROW_BYTES // KSTEP_BYTES} wgmma steps "
                      f"dealt over them), got {p.chains}"),
    Rule("chains", lambda s, p: p.chains == 1 or s.precision != "e4m3_block",
         lambda s, p: "e4m3_block sums each stage apart for its scales: it takes chains 1"),
    Rule("registers", lambda s, p: p.producer_regs == 0 or (p.producer_regs % 8 == 0 and 24 <= p.producer_regs <= 256),
         lambda s, p: f"producer_regs is 0 (no setmaxnreg) or a multiple of 8 in 24..256, got {p.producer_regs}"),
    Rule("registers", _register_room,
         lambda s, p: f"{_held(s, p)} accumulators a consumer thread, and about 40 registers more, exceed the "
                      f"{consumer_regs(p) if p.producer_regs else REGISTER_FILE // p.threads // 8 * 8} it gets; use a "
                      "smaller tile or more consumers"),
    Rule("inflight", lambda s, p: p.inflight in (0, 1), lambda s, p: f"inflight is 0 or 1 wgmma groups, got {p.inflight}"),
    Rule("epilogue", lambda s, p: p.epilogue in EPILOGUES, lambda s, p: f"epilogue is one of {EPILOGUES}, got {p.epilogue!r}"),
    # (gated, a tile of C that is not whole boxes is stored from registers instead: epilogue())
    Rule("epilogue", lambda s, p: p.epilogue != "tma" or s.gate != "none" or (p.bn * OUTPUTS[s.c_dtype].itemsize) % 128 == 0,
         lambda s, p: f"the TMA store writes C in boxes of 128 bytes of a row: bn={p.bn} {s.c_dtype} elements must be "
                      f"a multiple of {128 // OUTPUTS[s.c_dtype].itemsize}; use epilogue direct"),
    Rule("grid", lambda s, p: p.grid >= 0, lambda s, p: f"grid is a number of CTAs (0: one per tile), got {p.grid}"),
    # block scales promote each stage's sums into C's as soon as its group is done, per row and column of a tile
    Rule("block-scales", lambda s, p: s.precision != "e4m3_block" or (not p.swap and p.inflight == 0),
         lambda s, p: f"e4m3_block promotes each stage's sums when they are done: it takes inflight 0 and no swap, got "
                      f"inflight {p.inflight}" + (" and swap" if p.swap else "")),
    # swapped, C is stored transposed from registers, an element at a time (no TMA store), and no cluster shares a tile
    Rule("swap", lambda s, p: not p.swap or (s.b_layout == "nk" and p.epilogue == "direct" and p.cluster == 1),
         lambda s, p: "swap (Cᵀ = B·Aᵀ) takes B N×K (nk), epilogue direct and cluster 1, got "
                      f"b_layout {s.b_layout}, epilogue {p.epilogue}, cluster {p.cluster}"),
    # gated, a stage's B tile is two copies of BN/2 rows, one of each half, and a thread pairs its own sums
    Rule("gate", lambda s, p: s.gate == "none" or not p.swap,
         lambda s, p: f"gate {s.gate} pairs sums a thread holds: it takes no swap"),
    # gated in a cluster sharing B, each CTA copies bn/2/cluster rows of each half, whole 8-row groups of the swizzle
    Rule("gate", lambda s, p: s.gate == "none" or (p.bn // 2 // _shares(p)[1]) % 8 == 0,
         lambda s, p: f"gate {s.gate} in a cluster of {p.cluster} sharing B: each CTA copies bn/{2 * p.cluster} rows of "
                      f"each half of B, so bn={p.bn} must be a multiple of {16 * p.cluster}"),
    Rule("shared-memory", lambda s, p: _shared_bytes(s, p) <= MAX_SHARED_BYTES,
         lambda s, p: f"{p.stages} stages of {p.bm}×{s.bk} and {p.bn}×{s.bk}"
                      + (" and the C staging tile" if epilogue(s, p) == "tma" else "")
                      + f" need {_shared_bytes(s, p)} bytes, over the {MAX_SHARED_BYTES} a block can have; use fewer "
                        "stages or a smaller tile"),
    Rule("split-k", lambda s, p: 1 <= p.split_k <= MAX_SPLIT_K,
         lambda s, p: f"split_k is 1 (no split) to {MAX_SPLIT_K} slices of K, got {p.split_k}"),
    Rule("split-k", lambda s, p: p.split_k <= _kblocks(s),
         lambda s, p: f"split_k={p.split_k} slices need a {s.bk}-deep step of K each, and K={s.k} has {_kblocks(s)}; "
                      f"use split_k ≤ {_kblocks(s)}"),
    Rule("stream-k", lambda s, p: not p.stream_k or (p.split_k == 1 and p.cluster == 1 and p.grid > 0),
         lambda s, p: f"stream_k deals K steps over a persistent grid of single CTAs: it takes split_k 1, cluster 1 and "
                      f"a grid, got split_k {p.split_k}, cluster {p.cluster}, grid {p.grid}"),
    Rule("split-sum", lambda s, p: p.split_sum in SPLIT_SUMS,
         lambda s, p: f"split_sum is one of {SPLIT_SUMS}, got {p.split_sum!r}"),
    # a cluster holds at most 8 CTAs (portably); each CTA takes one unit, its stages free for its partial by then
    Rule("split-sum", lambda s, p: not cluster_sum(p) or (p.split_k in (2, 4, 8) and p.cluster == 1 and p.grid == 0
                                                          and p.schedule == "cooperative"),
         lambda s, p: "split_sum cluster makes a tile's slices one cluster's CTAs, a CTA each: it takes split_k 2, 4 "
                      f"or 8, cluster 1, grid 0 and cooperative consumers, got split_k {p.split_k}, cluster "
                      f"{p.cluster}, grid {p.grid}, {p.schedule}"),
    # the last unit waits for the others' partials: in a cluster, or beside the other consumer of its CTA, the
    # interpreter (which runs a CTA's warps, and a cluster's CTAs, in turn at barriers) would wait for ever
    Rule("split-sum", lambda s, p: not ticket_sum(p) or (p.cluster == 1 and p.schedule == "cooperative"),
         lambda s, p: f"split_sum ticket takes cluster 1 and cooperative consumers, got cluster {p.cluster}, "
                      f"{p.schedule}"),
    Rule("split-sum", lambda s, p: not cluster_sum(p) or p.bm * p.bn * 4 <= p.stages * (p.bm + p.bn) * ROW_BYTES,
         lambda s, p: f"split_sum cluster keeps a {p.bm}×{p.bn} fp32 partial in the stages' "
                      f"{p.stages * (p.bm + p.bn) * ROW_BYTES} bytes: use more stages"),
    Rule("plant", lambda s, p: p.plant in PLANTED_BUGS, lambda s, p: f"unknown planted bug {p.plant!r}"),
    Rule("plant", lambda s, p: p.plant not in SPLIT_PLANTS or reduces(p) and not p.stream_k,
         lambda s, p: f"{p.plant} is a bug of the split-K reduction through the workspace: plant it with split_k > 1 "
                      "and split_sum global or ticket"),
    Rule("plant", lambda s, p: p.plant != "proxy_fence" or epilogue(s, p) == "tma",
         lambda s, p: "the proxy fence belongs to the TMA store: plant proxy_fence with epilogue tma (and N·size a "
                      "multiple of 16 bytes)"),
    Rule("watchdog", lambda s, p: p.watchdog_ms >= 1, lambda s, p: f"watchdog_ms is positive, got {p.watchdog_ms}"),
    # a cluster's CTAs meet before any copy, so that none is multicast into a peer whose barriers are not made
    Rule("early-copies", lambda s, p: not p.early_copies or p.cluster == 1,
         lambda s, p: f"early_copies passes the CTA's setup barrier; a cluster of {p.cluster} meets at its own: use "
                      "cluster 1"),
)


class GemmSm90(OpFamily):
    name = "gemm_sm90"
    tolerance = 1e-6
    params_type = Params
    rules = _RULES
    shape_dims = ("m", "n", "k")
    run_dims: tuple[str, ...] = ()
    run_defaults: dict[str, int] = {}
    shape_options = ("precision", "c_dtype", "b_layout", "gate", "bias", "residual")
    min_arch = 90
    peer_builder = LazyFunction("mage_gen.peers", "strided_bf16_gemm_peers")
    device_case = LazyFunction("mage_gen.device_cases", "gemm_sm90_case")
    runtime_name = "mage_gen.runtime.gemm"
    torch_name = "mage_gen.torch.linear"
    class_dims = ("m",)  # a model calls a layer's (N, K) at every token count: its entries are classes over M
    epilogue_fields = ("gate", "bias", "residual")
    field_help = {"m": "rows of A and C", "n": "columns of C (gated: rows of B, twice C's columns)", "k": "columns of A",
                  "precision": "bf16, e4m3 (fp8; C = scale_a·scale_b·A·Bᵀ, B N×K) or e4m3_block (fp8 with scales per "
                               "1×128 of A and 128×128 of B) (what A and B are; c_dtype is C's)",
                  "c_dtype": "C's element type: bf16 or fp32",
                  "b_layout": "nk (B N×K, C = A·Bᵀ) or kn (B K×N, C = A·B)",
                  "gate": "none, or silu: B is a gate's N/2 rows over an up's, C (M × N/2) = silu(A·B_gateᵀ) ⊙ "
                          "A·B_upᵀ (SwiGLU)",
                  "bias": "true: a vector of N (C's type) added to the sums, before the gate",
                  "residual": "true: a tensor of C's shape and type added last"}

    def shape(self, m: int, n: int, k: int, precision: str = "bf16", c_dtype: str = "bf16", b_layout: str = "nk",
              gate: str = "none", bias: bool = False, residual: bool = False) -> Shape:
        for name, value in (("m", m), ("n", n), ("k", k)):
            if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= MAX_DIM:
                raise ConfigError(f"{name}-range: {name} must be a whole number in 1..{MAX_DIM}, got {value!r}; "
                                  f"give it as --{name}")
        shape = Shape(m, n, k, precision, c_dtype, b_layout, gate, bias, residual)
        check_rules(_SHAPE_RULES, shape)
        return shape

    def min_arch_of(self, shape: Shape, params: Params | None = None) -> int:
        return self.min_arch

    def target_arch(self, arch: str) -> str:
        """wgmma and setmaxnreg exist on sm_90a alone: the code is built for it, and runs on sm_90 GPUs only."""
        if arch.rstrip("a") != "sm_90":
            raise ConfigError(f"arch: {self.name} is built of wgmma, which only sm_90a (Hopper) has; got {arch}; use "
                              "--arch sm_90")
        return "sm_90a"

    def params_from_dict(self, values: dict[str, Any]) -> Params:
        return params_from(Params, self.name, values, hidden=_HIDDEN)

    def params_from_user(self, values: dict[str, Any]) -> Params:
        return public_params_from(Params, self.name, values, _HIDDEN)

    def params_to_dict(self, params: Params) -> dict[str, Any]:
        return params_dict(params, hidden=_HIDDEN)

    def defaults(self, shape: Shape) -> dict[str, Any]:
        return {}

    def fit_space(self, shape: Shape, axes: dict[str, tuple]) -> dict[str, tuple]:
        return axes

    def fit_device(self, shape: Shape, axes: dict[str, tuple], sms: int) -> dict[str, tuple]:
        """bn "waves": for each bm of the space, the N tile that fills the SMs best (wave_tile)."""
        if WAVES not in axes.get("bn", ()):
            return axes
        filled = [wave_tile(shape, bm, sms) for bm in axes.get("bm", (Params.bm,))]
        return {**axes, "bn": tuple(dict.fromkeys([*(v for v in axes["bn"] if v != WAVES), *filled]))}

    def watchdog_s(self, p: Params) -> float:
        """Seconds a wait on an mbarrier may last before the kernel traps (measure reports such a failure as a hang)."""
        return p.watchdog_ms / 1000

    def check_run(self, run: dict[str, int]) -> None:
        if run:
            raise ConfigError(f"run: {self.name} takes every size at generation (--m --n --k), not {sorted(run)}")

    def scalars(self, shape: Shape, run: dict[str, int]) -> dict[str, int | float]:
        return {}

    # ---- launch ----
    def geometry(self, shape: Shape, p: Params, run: dict[str, int]) -> Launch:
        units = int(np.prod(_units(shape, p))) * p.split_k  # a cluster's CTAs take a unit together
        ctas = stream_ctas(shape, p) if p.stream_k else min(p.grid // p.cluster or units, units) * p.cluster
        return Launch(grid=(ctas, 1, 1), block=(p.threads, 1, 1),
                      dynamic_shared_bytes=_shared_bytes(shape, p), static_shared_bytes=0,
                      cluster=(launch_cluster(p), 1, 1))

    def launch_formula(self, shape: Shape, p: Params) -> dict[str, Any]:
        launch = self.geometry(shape, p, {})
        return {"grid": list(launch.grid), "block": list(launch.block), "cluster": list(launch.cluster),
                "dynamic_shared_bytes": launch.dynamic_shared_bytes}

    def tensor_maps(self, shape: Shape, p: Params) -> dict[str, TensorMapSpec]:
        """The TMA tensor maps the kernel takes after its pointers, in order: which tensor each maps and how."""
        out = OUTPUTS[shape.c_dtype]
        element = "bfloat16" if shape.precision == "bf16" else "uint8"  # TMA moves e4m3 codes as bytes
        bk, item = shape.bk, shape.element.itemsize
        row = shape.lda * item
        # each CTA of a cluster copies its share of the B tile's rows (nk), or of its 64-column boxes (kn); gated, a
        # copy is the BN/2 rows of one half
        b_box_rows = p.bn // self.b_sharers(p) // (2 if shape.gate != "none" else 1)
        b = (TensorMapSpec("B", element, (shape.k, shape.n), (row,), (bk, b_box_rows), SWIZZLE, 256)
             if shape.b_layout == "nk" else
             TensorMapSpec("B", element, (shape.n, shape.k), (shape.ldb * item,), (64, bk), SWIZZLE, 256))
        maps = {"tma_a": TensorMapSpec("A", element, (shape.k, shape.m), (row,), (bk, p.bm // _shares(p)[0]),
                                       SWIZZLE, 256),
                "tma_b": b}
        if p.swap:  # the kernel's first operand (bm rows a tile) is B, its second (bn rows) A
            maps = {"tma_a": TensorMapSpec("B", element, (shape.k, shape.n), (row,), (bk, p.bm), SWIZZLE, 256),
                    "tma_b": TensorMapSpec("A", element, (shape.k, shape.m), (row,), (bk, p.bn), SWIZZLE, 256)}
        if epilogue(shape, p) == "tma":
            maps["tma_c"] = TensorMapSpec("C", out.name, (shape.c_cols, shape.m), (shape.c_cols * out.itemsize,),
                                          (128 // out.itemsize, consumer_rows(p)), SWIZZLE, 0)
        return maps

    def b_sharers(self, p: Params) -> int:
        """CTAs that copy a part of the B tile each into all of them (multicast)."""
        return _shares(p)[1]

    # ---- generation ----
    def kernel_name(self, shape: Shape, p: Params) -> str:
        order = {"row": "row", "grouped": f"g{p.group}", "hilbert": "h"}[p.order]
        return (f"gemm_sm90_{self.slug(shape)}_b{p.bm}x{p.bn}_s{p.stages}_c{p.consumers}"
                + ("_pp" if p.schedule == "pingpong" else "")
                + (f"_x{p.cluster}" + ("a" if p.multicast == "a" else "") if p.cluster > 1 else "")
                + f"_{order}_r{p.producer_regs}"
                f"_f{p.inflight}" + (f"_a{p.chains}" if p.chains > 1 else "")
                + f"_{epilogue(shape, p)}" + (f"_k{p.split_k}" if p.split_k > 1 else "") + ("c" if cluster_sum(p) else "")
                + ("t" if ticket_sum(p) else "")
                + ("_sk" if p.stream_k else "")
                + ("_sw" if p.swap else "")
                + (f"_bug_{p.plant}" if p.plant else "") + ("_early" if p.early_copies else "")
                + ("_stamps" if p.stamps else ""))

    def context(self, shape: Shape, p: Params) -> dict[str, Any]:
        out = OUTPUTS[shape.c_dtype]
        tiles_m, tiles_n = _tiles(shape, p)
        product = computed(shape, p)
        units_m, units_n = _units(shape, p)
        stage_bytes = (p.bm + p.bn) * ROW_BYTES
        c_stage = p.consumers * consumer_rows(p) * out_bn(shape, p) * out.itemsize if epilogue(shape, p) == "tma" else 0
        share_a = _shares(p)[0]
        sk_ctas, sk_waves = (stream_ctas(shape, p), stream_waves(shape, p)) if p.stream_k else (0, 0)
        acc = p.bn // 2  # a thread's accumulator floats of a 64-row slab
        return dict(
            M=product.m, N=product.n, K=shape.k, BM=p.bm, BN=p.bn, BK=shape.bk, STAGES=p.stages, CONSUMERS=p.consumers,
            THREADS=p.threads, TILES_M=tiles_m, TILES_N=tiles_n, CLUSTER=p.cluster, SHARE=self.b_sharers(p),
            SHARE_A=share_a, PINGPONG=p.schedule == "pingpong", CONSUMER_ROWS=consumer_rows(p),
            # each stage is freed by every consumer that reads it, in every CTA that copies into it
            EMPTY_ARRIVALS=(1 if p.schedule == "pingpong" else p.consumers) * self.b_sharers(p) * share_a, UNITS_M=units_m, UNITS_N=units_n,
            UNITS=units_m * units_n, KBLOCKS=_kblocks(shape),
            HILBERT=[r << 16 | c for r, c in hilbert_order(units_m, units_n)] if p.order == "hilbert" else [],
            ORDER_TABLE_IN_CONSTANT=units_m * units_n <= CONSTANT_ORDER_TABLE,
            KSTEPS=ROW_BYTES // KSTEP_BYTES, KSTEP_BYTES=KSTEP_BYTES, MI=consumer_rows(p) // 64, ACC=acc,
            A_BYTES=p.bm * ROW_BYTES, B_BYTES=p.bn * ROW_BYTES, STAGE_BYTES=stage_bytes,
            CONSUMER_A_BYTES=consumer_rows(p) * ROW_BYTES, B_KN=shape.b_layout == "kn", B_BOXES=p.bn // 64,
            B_LBO=shape.bk * 128,  # a K×N B tile: from one box of 64 columns to the next
            # what A and B hold (wgmma's input type, the pointers' C type); e4m3 C is scaled by scale_a · scale_b
            AB_PTX=shape.element.ptx, AB_TYPE=shape.element.c_type, SCALED=shape.precision != "bf16",
            BLOCK=shape.precision == "e4m3_block", N_BLOCKS=-(-shape.n // SCALE_BLOCK),
            C_STAGE_AT=p.stages * stage_bytes, C_STAGE_BYTES=c_stage, BARRIERS_AT=p.stages * stage_bytes + c_stage,
            C_BOX_COLS=128 // out.itemsize, C_BOX_BYTES=consumer_rows(p) * 128, C_BOXES=out_bn(shape, p) * out.itemsize // 128,
            # C's row length and a tile's columns of it, and gated the row of B where the up half starts
            C_COLS=shape.c_cols if not p.swap else product.n, OUT_BN=out_bn(shape, p), GATE=shape.gate != "none",
            UP_ROWS_AT=shape.n // 2, BIAS=shape.bias, RESIDUAL=shape.residual, B_ROWS=shape.n,
            C_TYPE=out.c_type, C_PTX=out.ptx, C_PAIRS=c_pairs(shape, p), SWAP=p.swap,
            ORDER=p.order, GROUP=p.group, PRODUCER_REGS=p.producer_regs, CONSUMER_REGS=consumer_regs(p),
            INFLIGHT=p.inflight, CHAINS=p.chains, EPILOGUE=epilogue(shape, p), WATCHDOG_NS=p.watchdog_ms * 1_000_000, PLANT=p.plant,
            SWIZZLE=64 if p.plant == "swizzle" else SWIZZLE, SBO=SBO // 2 if p.plant == "sbo" else SBO,
            # split K: the workspace holds SLICE_FLOATS a slice (every tile's partial); PART_THREADS threads hold a
            # tile's accumulators (one consumer's under pingpong) and meet at SPLIT_BARRIER (named barriers 1 and 2
            # are the TMA store's); the flag that says which unit arrived last lies past the mbarriers
            SPLIT=p.split_k, WS_TILES_N=_workspace_tiles(shape, p)[1], WS_TILES=int(np.prod(_workspace_tiles(shape, p))),
            SLICE_FLOATS=workspace_floats(shape, p) // p.split_k, REDUCES=reduces(p),
            # stream K: SK_WAVES waves of SK_CTAS whole tiles, then the ITERS BK steps of the other tiles dealt over
            # the SK_CTAS CTAs
            STREAM_K=p.stream_k, SK_CTAS=sk_ctas, SK_WAVES=sk_waves, SK_WHOLE=sk_waves * sk_ctas,
            # the float4 chunks of a thread's partial read back from each piece at once: at most 4 (16 registers
            # beside the accumulators), a divisor of the thread's ACC / 4
            SK_RUN=max(d for d in range(1, 5) if acc // 4 % d == 0),
            ITERS=(units_m * units_n - sk_waves * sk_ctas) * _kblocks(shape),
            PART_THREADS=128 if p.schedule == "pingpong" else 128 * p.consumers,
            SPLIT_BARRIER="3 + consumer" if p.schedule == "pingpong" else "3",
            SPLIT_FLAG_AT=p.stages * stage_bytes + c_stage + 16 * p.stages + (16 if p.schedule == "pingpong" else 0),
            STAMPS=p.stamps, STAMP_CTAS=STAMP_CTAS, STAMP_SLOTS=STAMP_SLOTS, EARLY_COPIES=p.early_copies,
            CLUSTER_SUM=cluster_sum(p), TICKET=ticket_sum(p),
        )

    def source(self, shape: Shape, p: Params) -> Source:
        self.validate(shape, p)
        return render("gemm_sm90/ws.cu.j2", self.context(shape, p), self.kernel_name(shape, p), p)

    def slug(self, shape: Shape) -> str:
        return (f"{shape.precision}_{shape.b_layout}_{shape.c_dtype}{_epilogue_slug(shape, '_')}"
                f"_m{shape.m}_n{shape.n}_k{shape.k}")

    def shape_key(self, shape: Shape) -> str:
        # never the plain key and a "/": tuned/ takes key + "/..." for a size class of the shape
        return (f"m={shape.m},n={shape.n},k={shape.k}{_epilogue_slug(shape, ',')}/{shape.precision}/{shape.b_layout}/"
                f"{shape.c_dtype}")

    # ---- data ----
    def args(self, shape: Shape) -> tuple[Arg, ...]:
        """C, A, B; e4m3 also scale_a and scale_b, one fp32 each (C = scale_a·scale_b·A·Bᵀ, as torch._scaled_mm); then
        the bias and the residual where the shape adds them, of C's type."""
        element, out = shape.element.name, OUTPUTS[shape.c_dtype].name
        scales = (Arg("scale_a", "in", "float32"), Arg("scale_b", "in", "float32")) if shape.precision != "bf16" else ()
        addends = tuple(Arg(name, "in", out) for name in ("bias", "residual") if getattr(shape, name))
        return (Arg("C", "out", out), Arg("A", "in", element), Arg("B", "in", element), *scales, *addends)

    def launch_args(self, shape: Shape, p: Params) -> tuple[Arg, ...]:
        """args, and under split K or stream K the workspace (scratch) and the tiles' counters (zero on entry, left
        zero)."""
        if not reduces(p):
            return self.args(shape)
        return self.args(shape) + (Arg("workspace", "scratch", "float32", workspace_floats(shape, p)),
                                   Arg("counters", "zeroed", "uint32", counters(shape, p)))

    def make_inputs(self, shape: Shape, run: dict[str, int], rng: np.random.Generator) -> dict[str, np.ndarray]:
        """A and B with rows of lda elements; the padding past K is NaN, so a kernel that read it would fail. e4m3:
        normal values times 8 (most codes' exponents in use) and scales drawn from 0.5-2. A bias and a residual as
        large as the product's elements (spread² · √K), so that one left out fails the gate."""
        element = shape.element
        spread, size = input_sizes(shape)

        def rows(count: int, length: int, stride: int, element: DType, size: float) -> np.ndarray:
            held = np.empty((count, stride), dtype=element.storage)

            def fill(child: np.random.Generator, at: slice) -> None:
                held[at, :length] = element.round(np.float32(size) * child.standard_normal(
                    (at.stop - at.start, length), dtype=np.float32))
                held[at, length:] = element.nan_bits & (1 << 8 * element.itemsize) - 1

            fill_rows(rng, count, length, fill)
            return held

        b = (shape.n, shape.k) if shape.b_layout == "nk" else (shape.k, shape.n)
        inputs = {"A": rows(shape.m, shape.k, shape.lda, element, spread),
                  "B": rows(*b, shape.ldb, element, spread)}
        if shape.precision != "bf16":
            inputs.update({name: rng.uniform(*SCALE_RANGE, dims).astype(np.float32)
                           for name, dims in _scale_shapes(shape).items()})
        out = OUTPUTS[shape.c_dtype]
        if shape.bias:
            inputs["bias"] = out.round(np.float32(size) * rng.standard_normal(shape.n, dtype=np.float32))
        if shape.residual:
            inputs["residual"] = rows(shape.m, shape.c_cols, shape.c_cols, out, size)
        return inputs

    def output_shapes(self, shape: Shape, run: dict[str, int]) -> dict[str, tuple[int, ...]]:
        return {"C": (shape.m, shape.c_cols)}

    def output_dtypes(self, shape: Shape) -> dict[str, DType]:
        return {"C": OUTPUTS[shape.c_dtype]}

    def tolerance_of(self, shape: Shape, output: str, dtype: DType) -> float:
        """bf16: products exact in fp32, the sum's error at most about K·2⁻²⁴. e4m3: products exact too, but the
        tensor cores sum fp8 products in fewer bits than fp32 (about 14 kept, DeepGEMM's finding), a random walk of K
        such roundings: 2⁻¹³·√K. Then one rounding of C to bf16 (2⁻⁸ relative, twice for margin). Gated, C is a product
        of two sums, each with that error (silu's slope is at most 1.1): twice the sums' share."""
        accumulation = (2.0**-13 * shape.k ** 0.5 if shape.precision != "bf16" else 2.0**-24 * shape.k) + self.tolerance
        accumulation *= 2 if shape.gate != "none" else 1
        return accumulation + (2 * dtype.unit_roundoff if dtype.itemsize == 2 else 0.0)

    def reference(self, shape: Shape, inputs: dict[str, np.ndarray], scalars: dict[str, int | float]) -> dict[str, np.ndarray]:
        element = shape.element
        a = Stored(inputs["A"][:, :shape.k], element)
        if shape.precision == "e4m3_block":
            return {"C": _epilogue64(shape, _block_scaled(shape, a.float64(), Stored(inputs["B"][:, :shape.k], element)
                                                          .float64(), inputs["scale_a"], inputs["scale_b"]),
                                     inputs)}
        b = Stored(inputs["B"][:, :shape.n], element) if shape.b_layout == "kn" else \
            Stored(inputs["B"][:, :shape.k], element).T
        c = product64(a, b)
        if shape.precision == "e4m3":  # the scales as the kernel applies them: their fp32 product
            c = c * float(np.float32(inputs["scale_a"][0]) * np.float32(inputs["scale_b"][0]))
        return {"C": _epilogue64(shape, c, inputs)}

    def gate_runs(self, shape: Shape, run: dict[str, int], params: Params) -> list[dict[str, int]]:
        return [{}]

    def bytes_moved(self, shape: Shape, run: dict[str, int]) -> int:
        return (shape.element.itemsize * (shape.m + shape.n) * shape.k  # either layout
                + OUTPUTS[shape.c_dtype].itemsize * (shape.m * shape.c_cols * (2 if shape.residual else 1)
                                                     + (shape.n if shape.bias else 0)))

    def flops(self, shape: Shape) -> int:
        return 2 * shape.m * shape.n * shape.k

    def contract(self, shape: Shape, p: Params) -> dict[str, Any]:
        out = OUTPUTS[shape.c_dtype]
        # C: 4-byte pairs (bf16) or 8-byte pairs (fp32) where N is even, single elements otherwise; a TMA store
        # wants 16 bytes
        c_align = 16 if epilogue(shape, p) == "tma" else (2 * out.itemsize if c_pairs(shape, p) else out.itemsize)

        def operand(rows: int, cols: int, stride: int, what: str) -> dict[str, Any]:
            return {"dtype": shape.element.name, "shape": [rows, cols],
                    "layout": f"row-major ({what}), row stride {stride} elements (a row rounded up to 16 bytes)",
                    "alignment_bytes": 16}

        b = (operand(shape.n, shape.k, shape.ldb, "N×K: C = A·Bᵀ") if shape.b_layout == "nk"
             else operand(shape.k, shape.n, shape.ldb, "K×N: C = A·B"))

        return {
            "tensors": {"C": {"dtype": out.name, "shape": [shape.m, shape.c_cols],
                              "layout": f"row-major, contiguous, row stride {shape.c_cols} elements"
                                        + (f"; silu(A·B[:{shape.c_cols}]ᵀ) ⊙ A·B[{shape.c_cols}:]ᵀ"
                                           if shape.gate != "none" else ""),
                              "alignment_bytes": c_align},
                        "A": operand(shape.m, shape.k, shape.lda, "M×K"), "B": b,
                        **{name: {"dtype": "float32", "shape": list(size),
                                  "layout": "one value, multiplying C" if size == (1,) else
                                  f"row-major, a scale per {'row and' if name == 'scale_a' else '128 rows (of N) and'} "
                                  f"{SCALE_BLOCK} of K", "alignment_bytes": 4}
                           for name, size in _scale_shapes(shape).items()},
                        **({"bias": {"dtype": out.name, "shape": [shape.n],
                                     "layout": "contiguous, one per row of B, added before the gate",
                                     "alignment_bytes": out.itemsize}} if shape.bias else {}),
                        **({"residual": {"dtype": out.name, "shape": [shape.m, shape.c_cols],
                                         "layout": f"row-major, contiguous, row stride {shape.c_cols} elements, added "
                                                   "last",
                                         "alignment_bytes": out.itemsize * (2 if c_pairs(shape, p) else 1)}}
                           if shape.residual else {})},
            "aliasing": "C must not overlap A, B or any other input (no in-place use): every pointer is declared "
                        "__restrict__",
            **(self._working(shape, p) if reduces(p) else {}),
            "scalars": {},
            "tensor_maps": {name: spec.to_dict() for name, spec in self.tensor_maps(shape, p).items()},
        }


    def _working(self, shape: Shape, p: Params) -> dict[str, Any]:
        """What split K's extra arguments must be (their sizes, what the kernel assumes and leaves of them), and the
        order of its sums."""
        working = {
            "workspace": {"dtype": "float32", "elements": workspace_floats(shape, p),
                          "bytes": 4 * workspace_floats(shape, p), "alignment_bytes": 16,
                          "contents": "scratch: any values on entry (each unit writes its partial before any unit "
                                      "reads it); not shared by two launches running at once"},
            "counters": {"dtype": "uint32", "elements": counters(shape, p), "bytes": 4 * counters(shape, p),
                         "alignment_bytes": 4,
                         "contents": "all zero before the first launch (cuMemsetD32 once); every launch leaves "
                                     "them zero again, so that the next needs no memset; not shared by two launches "
                                     "running at once"},
        }
        pieces = f"{p.split_k} partials (slices of K) in slice order" if p.split_k > 1 else \
            "partials (the pieces of K each CTA took) in CTA order"
        return {"working": working,
                "determinism": f"each tile of C is the sum of its {pieces}, whichever finishes last: the same bits "
                               "every launch"}


OP = GemmSm90()
