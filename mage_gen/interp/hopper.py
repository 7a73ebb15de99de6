"""Hopper's asynchronous proxy, at the level the templates use it: mbarriers, TMA copies over tensor maps, wgmma
over shared-memory descriptors, the proxy fence, stmatrix; and a cluster's CTAs reaching each other (launch.Cluster
runs them together): mapa gives CTA r's shared address a as a + (r + 1) · CLUSTER_WINDOW, an mbarrier arrival may
land on another CTA's barrier, a multicast copy writes its box into every CTA its mask names and completes its
bytes on each one's mbarrier at the same address, and barrier.cluster holds every warp of the cluster until all
have arrived.

mbarrier: a phase completes when its pending arrivals and its transaction bytes both reach zero; try_wait.parity p
is true once the phase of parity p has completed (on a fresh barrier, parity 1 at once). A warp that waits in vain
yields to the others; where every warp waits and nothing can change, the launch is a hang (HangError).
TMA: a tensor map parameter holds the interpreter's own encoding of an ops.base.TensorMapSpec (TensorMap); a load
writes the box into shared memory in the map's swizzle (zeros out of bounds) and completes its bytes on the
mbarrier; those words may be read by the asynchronous proxy (wgmma) only by a warp that has seen that phase
complete. A store reads its box from shared memory, which no thread may have written without a
fence.proxy.async since, and writes the part inside the tensor; until a bulk wait_group releases it, no thread may
write the box again.
wgmma: each warp computes its 16 rows of the m64 tile when it issues (A and B read through their descriptors and
swizzle, products summed in float64, rounded once to f32 with the accumulators), and the accumulators take the
result at the wait_group that covers its group; until then no TMA copy or thread may write what it reads.
"""

from __future__ import annotations

import re
import struct
from dataclasses import dataclass

import numpy as np

from mage_gen.dtypes import E4M3
from mage_gen.interp import alu
from mage_gen.interp.errors import DivergenceError, InterpError, RaceError, StaleReadError, UnknownInstruction
from mage_gen.interp.fp import bf16_to_f32
from mage_gen.interp.memory import NONE
from mage_gen.interp.program import LANES, Decoder, parse_int

PARAM_GENERIC_BASE = 0x7D00_0000_0000  # generic address of parameter byte 0 (cvta.param)
CLUSTER_WINDOW = 1 << 24  # mapa: CTA r's shared byte a is a + (r + 1) · CLUSTER_WINDOW (a CTA's own: a)
TENSOR_MAP_BYTES = 128
_MAGIC = b"MGTMAPv1"
_MAP = struct.Struct("<8sQIIQQQII I")  # magic, address, element size, rank, dims[2], stride, box[2], swizzle
_SWIZZLE_MODES = {0: 0, 1: 128, 2: 64, 3: 32}  # a descriptor's bits 62-63 -> the swizzle's span in bytes


class HangError(InterpError):
    """Every warp of a block waits (an mbarrier phase, a barrier) and nothing it waits for can happen."""


@dataclass(frozen=True)
class TensorMap:
    """A tensor map argument: how `array` (one of the launch's pointer arguments) is read or written by TMA, as an
    ops.base.TensorMapSpec says (sizes and box innermost first, byte strides of the outer dimensions)."""

    spec: object
    array: np.ndarray

    def encode(self, address: int) -> bytes:
        s = self.spec
        if len(s.dims) != 2:
            raise UnknownInstruction(f"a rank-{len(s.dims)} tensor map is not modeled (2-D only)")
        size = {"bfloat16": 2, "float16": 2, "float32": 4, "uint8": 1}[s.dtype]
        body = _MAP.pack(_MAGIC, address, size, 2, s.dims[0], s.dims[1], s.strides[0], s.box[0], s.box[1],
                         s.swizzle)
        return body.ljust(TENSOR_MAP_BYTES, b"\0")


@dataclass(frozen=True)
class _Map:
    address: int
    size: int
    dims: tuple[int, int]
    stride: int
    box: tuple[int, int]
    swizzle: int


def _decode_map(w, addr: int, what: str) -> _Map:
    """The tensor map a generic address points to: a 128-byte parameter the launch encoded."""
    offset = addr - PARAM_GENERIC_BASE
    params = w.block.prog.entry.params
    if not any(p.offset == offset and p.size == TENSOR_MAP_BYTES for p in params):
        raise InterpError(f"{what}: {addr:#x} is not the address of a 128-byte tensor map parameter")
    raw = w.block.params[offset:offset + _MAP.size]
    magic, address, size, rank, d0, d1, stride, b0, b1, swizzle = _MAP.unpack(raw)
    if magic != _MAGIC:
        raise InterpError(f"{what}: the tensor map parameter at offset {offset} was not encoded (pass an "
                          "interp.TensorMap for it)")
    return _Map(address, size, (d0, d1), stride, (b0, b1), swizzle)


def swizzled(addr: np.ndarray, span: int) -> np.ndarray:
    """A shared-memory byte address under the swizzle of `span` bytes (128, 64, 32; 0: none): the 16-byte chunk
    within the span XORed with the address's row of the span's repeat (Swizzle<3,4,3>, <2,4,3>, <1,4,3>)."""
    if span == 0:
        return addr
    bits = {128: 7, 64: 3, 32: 1}[span]
    return addr ^ (((addr >> 7) & bits) << 4)


class Barrier:
    """One mbarrier: the current phase's number, arrivals still to come, and transaction bytes outstanding."""

    def __init__(self, count: int):
        self.count, self.pending, self.tx, self.phase = count, count, 0, 0

    def describe(self) -> str:
        return (f"phase {self.phase} in progress, {self.pending} of {self.count} arrivals and {self.tx} transaction "
                "bytes outstanding")

    def settle(self) -> None:
        if self.pending == 0 and self.tx == 0:
            self.phase += 1
            self.pending = self.count


class AsyncState:
    """A block's asynchronous state: its mbarriers, and per word of shared memory what the async proxy did there."""

    def __init__(self, words: int):
        self.barriers: dict[int, Barrier] = {}
        self.epoch = 0  # bumped by every change a waiting warp could be waiting for
        self.clock = 0  # %globaltimer, in nanoseconds
        self.landed_bar = np.full(words, -1, dtype=np.int64)  # mbarrier whose phase a TMA copy's bytes complete
        self.landed_phase = np.zeros(words, dtype=np.int64)
        self.unfenced = np.full(words, NONE, dtype=np.int32)  # thread that wrote a word, not proxy-fenced since
        self.wgmma_reading = np.zeros(words, dtype=np.int32)  # wgmma in flight reading each word
        self.store_reading = np.full(words, NONE, dtype=np.int32)  # thread whose TMA store is still reading it

    def barrier(self, addr: int, what: str) -> Barrier:
        if addr not in self.barriers:
            raise InterpError(f"{what}: no mbarrier was initialised at shared address {addr:#x}")
        return self.barriers[addr]

    def generic_write(self, idx: np.ndarray, tids: np.ndarray, describe, what: str) -> None:
        """Threads' stores into shared words idx ((lanes, words), tids per lane): refused where the async proxy
        still reads them; each marked as written until its thread's fence.proxy.async."""
        for table, reader in ((self.wgmma_reading != 0, "a wgmma not yet waited for"),
                              (self.store_reading != NONE, "a TMA store not yet waited for")):
            if (busy := table[idx]).any():
                at = tuple(np.argwhere(busy)[0])
                raise RaceError(f"{what}: {describe(int(tids[at[0]]))} writes shared address {4 * int(idx[at]):#x}, "
                                f"which {reader} still reads")
        self.unfenced[idx] = np.broadcast_to(tids[:, None], idx.shape)
        self.landed_bar[idx] = -1


def cluster_blocks(block) -> list:
    """The blocks of block's cluster, rank by rank (block alone where the launch has no clusters)."""
    return block.cluster.blocks if block.cluster is not None else [block]


def peer(w, addr: int, what: str):
    """(the block, its own shared address) a shared::cluster address names: the warp's own block below
    CLUSTER_WINDOW, else the cluster's CTA of that rank (mapa)."""
    if addr < CLUSTER_WINDOW:
        return w.block, addr
    rank, local = addr // CLUSTER_WINDOW - 1, addr % CLUSTER_WINDOW
    blocks = cluster_blocks(w.block)
    if rank >= len(blocks):
        raise InterpError(f"{what}: shared::cluster address {addr:#x} names CTA {rank} of a cluster of {len(blocks)}")
    if all(x.done for x in blocks[rank].warps):  # its shared memory went with it
        raise InterpError(f"{what}: {w.block.describe(int(w.tids[w.live][0]))} reaches the shared memory of CTA "
                          f"{rank} of its cluster, which has exited")
    return blocks[rank], local


def _mapa(dec: Decoder, st, parts):
    if parts[1:] != ["shared::cluster", "u32"]:
        raise UnknownInstruction("only mapa.shared::cluster.u32 is modeled")
    d = dec.dst(st.operands[0])
    src = dec.src(st.operands[1], np.uint32)
    rank = dec.src(st.operands[2], np.uint32)
    what = _what(st)

    def fn(w, mask):
        a = np.broadcast_to(src(w.r), (LANES,)).astype(np.uint64)
        r = np.broadcast_to(rank(w.r), (LANES,)).astype(np.uint64)
        size = len(cluster_blocks(w.block))
        sel = w.active(mask)
        if (a[sel] >= CLUSTER_WINDOW).any() or (r[sel] >= size).any():
            raise InterpError(f"{what}: mapa of a shared address past {CLUSTER_WINDOW:#x} or of a rank past the "
                              f"cluster's {size} CTAs")
        w.put(d, (a + (r + np.uint64(1)) * np.uint64(CLUSTER_WINDOW)).astype(np.uint32), mask)
    return fn


def barrier_cluster(dec: Decoder, st, parts):
    """barrier.cluster.arrive[.release|.relaxed].aligned and barrier.cluster.wait[.acquire].aligned: each warp arrives
    at the cluster's current phase, and a wait goes on once that phase has completed (launch.Cluster.settle)."""
    what = _what(st)
    op, mods = parts[2], [p for p in parts[3:] if p != "aligned"]
    if not ((op == "arrive" and mods in ([], ["release"], ["relaxed"])) or (op == "wait" and mods in ([], ["acquire"]))):
        raise UnknownInstruction(f"barrier.cluster.{'.'.join(parts[2:])} not implemented")

    def cluster_of(w):
        if w.block.cluster is None:
            raise InterpError(f"{what}: a cluster barrier in a launch without clusters (give run's cluster)")
        return w.block.cluster

    def arrive(w, mask):
        _whole(w, mask, what)
        if w.cluster_arrived is not None:
            raise InterpError(f"{what}: warp {w.index} of block {w.block.ctaid} arrives again before it waited")
        w.cluster_arrived = cluster_of(w).phase

    def wait(w, mask):
        _whole(w, mask, what)
        if w.cluster_arrived is None:
            raise InterpError(f"{what}: warp {w.index} of block {w.block.ctaid} waits without having arrived")
        if cluster_of(w).phase > w.cluster_arrived:
            w.cluster_arrived = None
        else:
            w.retry = ("cluster", w.cluster_arrived)
    return arrive if op == "arrive" else wait


def state(block) -> AsyncState:
    if block.asyncs is None:
        block.asyncs = AsyncState(block.shared.words.size)
    return block.asyncs


def _what(st) -> str:
    return f"line {st.line}: {st.text}"


def _uniform(values: np.ndarray, what: str, name: str) -> int:
    values = np.asarray(values)
    if values.size and (values != values.flat[0]).any():
        raise DivergenceError(f"{what}: the lanes give different {name}s")
    return int(values.flat[0])


def _bracket(text: str) -> str:
    text = text.strip()
    if not (text.startswith("[") and text.endswith("]")):
        raise UnknownInstruction(f"operand {text!r} is not [address]")
    return text[1:-1].strip()


# ---- mbarrier ----

def _mbarrier(dec: Decoder, st, parts):
    what = _what(st)
    op = parts[1]
    remote = op == "arrive" and "shared::cluster" in parts  # on a barrier a mapa address may name in another CTA
    mods = [p for p in parts[2:] if p not in ("shared", "shared::cta", "b64", "release", "acquire", "cta")
            and not (remote and p in ("shared::cluster", "cluster"))]
    if mods and not (op == "try_wait" and mods == ["parity"]) and not (op == "arrive" and mods == ["expect_tx"]):
        raise UnknownInstruction(f"mbarrier modifier(s) {mods} not implemented")
    if op == "init":
        base, off = dec.address(st.operands[0])
        count = dec.src(st.operands[1], np.uint32)

        def init(w, mask):
            a = state(w.block)
            sel = w.active(mask)
            for addr, n in zip(np.broadcast_to(base(w.r) + off, (LANES,))[sel].tolist(),
                               np.broadcast_to(count(w.r), (LANES,))[sel].tolist()):
                if addr % 8 or addr + 8 > w.block.shared.nbytes:
                    raise InterpError(f"{what}: an mbarrier at shared address {addr:#x} (8-byte aligned, inside the "
                                      "block's shared memory)")
                a.barriers[addr] = Barrier(int(n))
            a.epoch += 1
        return init
    if op == "arrive":
        if st.operands[0].strip() != "_":
            raise UnknownInstruction("mbarrier.arrive's state result not implemented (use _)")
        base, off = dec.address(st.operands[1])
        tx = dec.src(st.operands[2], np.uint32) if "expect_tx" in mods else None

        def arrive(w, mask):
            sel = w.active(mask)
            addrs = np.broadcast_to(base(w.r) + off, (LANES,))[sel].tolist()
            bytes_ = np.broadcast_to(tx(w.r), (LANES,))[sel].tolist() if tx is not None else [0] * len(addrs)
            for addr, nbytes in zip(addrs, bytes_):
                block, addr = peer(w, int(addr), what) if remote else (w.block, addr)
                a = state(block)
                a.epoch += 1
                bar = a.barrier(addr, what)
                bar.tx += int(nbytes)
                bar.pending -= 1
                if bar.pending < 0:
                    raise InterpError(f"{what}: more arrivals on the mbarrier at {addr:#x} than its {bar.count} a "
                                      "phase")
                bar.settle()
            state(w.block).epoch += 1
        return arrive
    if op == "try_wait":
        pred = dec.dst(st.operands[0])
        base, off = dec.address(st.operands[1])
        parity = dec.src(st.operands[2], np.uint32)

        def try_wait(w, mask):
            a = state(w.block)
            sel = w.active(mask)
            addr = _uniform(np.broadcast_to(base(w.r) + off, (LANES,))[sel], what, "mbarrier address")
            p = _uniform(np.broadcast_to(parity(w.r), (LANES,))[sel], what, "parity") & 1
            bar = a.barrier(addr, what)
            done = bar.phase % 2 != p
            w.put(pred, np.full(LANES, done), mask)
            if done:
                seen = bar.phase - 1 if (bar.phase - 1) % 2 == p else bar.phase - 2
                w.observed[addr] = max(w.observed.get(addr, -1), seen)
            else:
                w.waiting = (addr, p, a.epoch)
        return try_wait
    raise UnknownInstruction(f"mbarrier.{op} not implemented")


# ---- TMA ----

_TENSOR = re.compile(r"\[\s*(%\w+)\s*,\s*\{\s*([^}]*)\}\s*\]")


def _tensor_operand(dec: Decoder, text: str):
    m = _TENSOR.fullmatch(text.strip())
    if not m:
        raise UnknownInstruction(f"tensor operand {text!r} not understood")
    coords = [dec.src(c, np.int32) for c in m.group(2).split(",")]
    if len(coords) != 2:
        raise UnknownInstruction("only 2-D tensor copies are modeled")
    return dec.src(m.group(1), np.uint64), coords


def _box_addresses(m: _Map, dst: int) -> np.ndarray:
    """Shared byte address of each element of the box (rows × inner), in the map's swizzle."""
    b0, b1 = m.box
    row_bytes = b0 * m.size
    if m.swizzle and row_bytes != m.swizzle:
        raise UnknownInstruction(f"a {m.swizzle}-byte swizzle over box rows of {row_bytes} bytes is not modeled")
    offsets = np.arange(b1)[:, None] * row_bytes + np.arange(b0)[None, :] * m.size
    return swizzled(dst + offsets, m.swizzle)


def _cp_bulk_tensor(dec: Decoder, st, parts):
    what = _what(st)
    q = parts[4:]
    if not q or q[0] != "2d":
        raise UnknownInstruction("only 2-D cp.async.bulk.tensor is modeled")
    load = q[1] == "shared::cluster" and q[2] == "global"
    if load:
        multicast = "multicast::cluster" in q
        extra = [p for p in q[3:] if p not in ("tile", "mbarrier::complete_tx::bytes", "L2::cache_hint",
                                                "multicast::cluster")]
        if extra or "L2::cache_hint" in q and multicast:
            raise UnknownInstruction(f"cp.async.bulk.tensor modifier(s) {q[3:]} not implemented")
        dbase, doff = dec.address(st.operands[0])
        tmap, coords = _tensor_operand(dec, st.operands[1])
        bbase, boff = dec.address(st.operands[2])
        ctas = dec.src(st.operands[3], np.uint16) if multicast else None

        def tma_load(w, mask):
            dsts = np.broadcast_to(dbase(w.r) + doff, (LANES,))
            bars = np.broadcast_to(bbase(w.r) + boff, (LANES,))
            masks = np.broadcast_to(ctas(w.r), (LANES,)) if multicast else None
            for lane, m, x, y in _issued(w, mask, tmap, coords, what):
                dst, bar = int(dsts[lane]) & 0xFFFFFFFF, int(bars[lane])
                if multicast:  # the box into every CTA the mask names, at the same addresses
                    blocks = cluster_blocks(w.block)
                    bits = int(masks[lane])
                    if bits >> len(blocks):
                        raise InterpError(f"{what}: a multicast mask {bits:#x} names CTAs past the cluster's "
                                          f"{len(blocks)}")
                    targets = [(blocks[r], dst, bar) for r in range(len(blocks)) if bits >> r & 1]
                else:
                    into, local = peer(w, dst, what)
                    targets = [(into, local, bar)]
                for into, at, bar_at in targets:
                    a = state(into)
                    _tma_load(w, a, m, at, x, y, bar_at, a.barrier(bar_at, what), int(w.tids[lane]), what, into)
                    a.epoch += 1
            state(w.block).epoch += 1
        return tma_load
    if q[1] == "global" and q[2] == "shared::cta":
        if [p for p in q[3:] if p not in ("tile", "bulk_group")]:
            raise UnknownInstruction(f"TMA store modifiers {q[3:]} not implemented")
        tmap, coords = _tensor_operand(dec, st.operands[0])
        sbase, soff = dec.address(st.operands[1])

        def tma_store(w, mask):
            a = state(w.block)
            srcs = np.broadcast_to(sbase(w.r) + soff, (LANES,))
            for lane, m, x, y in _issued(w, mask, tmap, coords, what):
                tid = int(w.tids[lane])
                w.bulk_open.setdefault(tid, []).append(_tma_store(w, a, m, int(srcs[lane]) & 0xFFFFFFFF, x, y, tid,
                                                                  what))
        return tma_store
    raise UnknownInstruction("cp.async.bulk.tensor form not implemented")


def _issued(w, mask, tmap, coords, what: str):
    """(lane, tensor map, x, y) of each active lane: each issues a copy of its own."""
    maps = np.broadcast_to(tmap(w.r), (LANES,))
    xs, ys = (np.broadcast_to(c(w.r), (LANES,)) for c in coords)
    for lane in np.flatnonzero(np.ones(LANES, bool) if mask is None else mask).tolist():
        yield lane, _decode_map(w, int(maps[lane]), what), int(xs[lane]), int(ys[lane])


def _in_tensor(m: _Map, x: int, y: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(element columns, rows, inside) of the box at (x, y)."""
    b0, b1 = m.box
    cols = x + np.arange(b0)[None, :]
    rows = y + np.arange(b1)[:, None]
    inside = (cols >= 0) & (cols < m.dims[0]) & (rows >= 0) & (rows < m.dims[1])
    return np.broadcast_to(cols, (b1, b0)), np.broadcast_to(rows, (b1, b0)), inside


def _tma_load(w, a: AsyncState, m: _Map, dst: int, x: int, y: int, bar_addr: int, bar: Barrier, tid: int,
              what: str, into=None) -> None:
    """The box at (x, y) into the shared memory of block `into` (the warp's own where None) at dst, its bytes
    completed on that block's mbarrier bar (its AsyncState a)."""
    glob, sh = w.block.glob, (into or w.block).shared
    span = m.box[0] * m.size
    if m.swizzle and dst % (8 * span):
        raise InterpError(f"{what}: a TMA copy under a {m.swizzle}-byte swizzle into shared address {dst:#x}, not "
                          f"{8 * span}-byte aligned: the swizzle pattern would be off")
    cols, rows, inside = _in_tensor(m, x, y)
    values = np.zeros(inside.shape, dtype={1: np.uint8, 2: np.uint16, 4: np.uint32}[m.size])
    if inside.any():
        addr = np.uint64(m.address) + (rows[inside] * m.stride + cols[inside] * m.size).astype(np.uint64)
        words = glob.read(addr - addr % np.uint64(4), 1, np.full(addr.size, tid), w.block.describe, what)[:, 0]
        shift = ((addr % np.uint64(4)) * np.uint64(8)).astype(np.uint32)
        values[inside] = ((words >> shift) & np.uint32((1 << (8 * m.size)) - 1)).astype(values.dtype)
    targets = _box_addresses(m, dst)
    if targets.max() + m.size > sh.nbytes:
        raise InterpError(f"{what}: the box lands past the block's {sh.nbytes} bytes of shared memory")
    idx = np.unique(targets // 4)
    if (busy := a.wgmma_reading[idx]).any():
        raise RaceError(f"{what}: a TMA copy writes shared address {4 * int(idx[np.argmax(busy > 0)]):#x}, which a "
                        "wgmma not yet waited for still reads (a stage freed before its wgmma completed)")
    if (reading := a.store_reading[idx] != NONE).any():
        raise RaceError(f"{what}: a TMA copy writes shared address {4 * int(idx[np.argmax(reading)]):#x}, which a TMA "
                        "store not yet waited for still reads")
    raw = sh.words.view(np.uint8)
    for k in range(m.size):
        raw[targets + k] = (values.astype(np.uint32) >> np.uint32(8 * k)).astype(np.uint8)
    a.landed_bar[idx] = bar_addr
    a.landed_phase[idx] = bar.phase
    a.unfenced[idx] = NONE
    bar.tx -= values.size * m.size
    bar.settle()


def _tma_store(w, a: AsyncState, m: _Map, src: int, x: int, y: int, tid: int, what: str) -> np.ndarray:
    glob, sh = w.block.glob, w.block.shared
    targets = _box_addresses(m, src)
    idx = targets // 4
    if (dirty := a.unfenced[idx] != NONE).any():
        i = np.argwhere(dirty)[0]
        raise StaleReadError(f"{what}: a TMA store reads shared address {4 * int(idx[tuple(i)]):#x}, which "
                             f"{w.block.describe(int(a.unfenced[idx][tuple(i)]))} wrote with no fence.proxy.async "
                             "since: the asynchronous proxy need not see it")
    raw = sh.words.view(np.uint8)
    values = np.zeros(targets.shape, dtype=np.uint32)
    for k in range(m.size):
        values |= raw[targets + k].astype(np.uint32) << np.uint32(8 * k)
    cols, rows, inside = _in_tensor(m, x, y)
    if inside.any():
        addr = np.uint64(m.address) + (rows[inside] * m.stride + cols[inside] * m.size).astype(np.uint64)
        v = values[inside]
        if m.size == 4:
            glob.write(addr, v[:, None], np.full(addr.size, tid), w.block.describe, what)
        else:
            glob.write16(addr, v.astype(np.uint16), np.full(addr.size, tid), w.block.describe, what)
    flat = np.unique(idx)
    a.store_reading[flat] = tid
    return flat


def _cp_bulk_group(dec: Decoder, st, parts):
    what = _what(st)
    q = parts[3:]
    if q == ["commit_group"]:
        def commit(w, mask):
            for tid in w.tids[w.active(mask)].tolist():
                w.bulk_groups.setdefault(tid, []).append(w.bulk_open.pop(tid, []))
        return commit
    if q and q[0] == "wait_group" and q[1:] in ([], ["read"]):
        n = parse_int(st.operands[0])

        def wait(w, mask):
            a = state(w.block)
            for tid in w.tids[w.active(mask)].tolist():
                groups = w.bulk_groups.get(tid, [])
                done, w.bulk_groups[tid] = groups[:max(0, len(groups) - n)], groups[max(0, len(groups) - n):]
                for group in done:
                    for idx in group:
                        a.store_reading[idx[a.store_reading[idx] == tid]] = NONE
        return wait
    raise UnknownInstruction(f"cp.async.bulk {'.'.join(q)} not implemented ({what})")


def cp_bulk(dec: Decoder, st, parts):
    """cp.async.bulk.* other than the L2 prefetch (memops): tensor copies and the store's bulk groups."""
    if parts[3:4] == ["tensor"]:
        return _cp_bulk_tensor(dec, st, parts)
    return _cp_bulk_group(dec, st, parts)


# ---- wgmma ----

_WGMMA = re.compile(r"m64n(\d+)k(16|32)")
# wgmma's input types: bytes an element, and K of one instruction (32 bytes of each row either way)
_WGMMA_INPUTS = {"bf16": (2, 16), "e4m3": (1, 32)}
_E4M3 = E4M3.widen(np.arange(256, dtype=np.uint8)).astype(np.float64)


def _operand_elements(w, a: AsyncState, desc: int, rows: int, trans: bool, what: str,
                      name: str, kind: str = "bf16") -> tuple[np.ndarray, np.ndarray]:
    """The rows × K elements (16 bf16, or 32 e4m3: 32 bytes of each row) an operand reads through its descriptor
    (A's 64 rows, or B's N), as float64, K along the second axis, and the shared words they lie in; checks what the
    async proxy may read."""
    size, depth = _WGMMA_INPUTS[kind]
    start = (desc & 0x3FFF) << 4
    lbo = ((desc >> 16) & 0x3FFF) << 4
    sbo = ((desc >> 32) & 0x3FFF) << 4
    if (desc >> 49) & 7:
        raise UnknownInstruction(f"{what}: a descriptor base offset is not modeled")
    span = _SWIZZLE_MODES[(desc >> 62) & 3]
    r = np.arange(rows)[:, None]
    k = np.arange(depth)[None, :]
    per = 16 // size  # elements of a core matrix's 16-byte row
    if not trans:  # K-major: a row's elements side by side, rows `span` bytes apart within 8-row groups
        if span:
            offsets = (r // 8) * sbo + (r % 8) * span + k * size
        else:  # core matrices of 8 rows × 16 bytes: SBO between row groups, LBO along K
            offsets = (r // 8) * sbo + (k // per) * lbo + (r % 8) * 16 + (k % per) * size
    else:  # N-major (B): element (k, n) with n along the span's columns, LBO between spans, SBO between k-groups
        if not span:
            raise UnknownInstruction(f"{what}: an N-major operand without a swizzle is not modeled")
        per = span // 2
        offsets = (r // per) * lbo + (k // 8) * sbo + (k % 8) * span + (r % per) * 2
    addr = swizzled(start + offsets, span)
    sh = w.block.shared
    if addr.max() + size > sh.nbytes:
        raise InterpError(f"{what}: {name} read through its descriptor reaches past the block's shared memory")
    idx = addr // 4
    landed, phases = a.landed_bar[idx], a.landed_phase[idx]
    for bar in np.unique(landed[landed >= 0]).tolist():
        late = (landed == bar) & (phases > w.observed.get(bar, -1))
        if late.any():
            at = tuple(np.argwhere(late)[0])
            raise StaleReadError(f"{what}: {name} reads shared address {4 * int(idx[at]):#x}, which a TMA copy fills "
                                 f"on the mbarrier at {bar:#x} in its phase {int(phases[at])}, and warp {w.index} "
                                 "has not seen that phase complete")
    if (dirty := a.unfenced[idx] != NONE).any():
        raise StaleReadError(f"{what}: {name} reads shared address {4 * int(idx[dirty][0]):#x}, written by a thread "
                             "with no fence.proxy.async since")
    held = (sh.words[idx] >> ((addr % 4) * 8).astype(np.uint32)) & np.uint32((1 << 8 * size) - 1)
    if kind == "e4m3":
        return _E4M3[held], np.unique(idx)
    return bf16_to_f32(held.astype(np.uint16)).astype(np.float64), np.unique(idx)


def _wgmma(dec: Decoder, st, parts):
    what = _what(st)
    op = parts[1]
    if op == "fence":
        return lambda w, mask: _whole(w, mask, what)
    if op == "commit_group":
        def commit(w, mask):
            _whole(w, mask, what)
            w.wgmma_groups.append(w.wgmma_open)
            w.wgmma_open = []
            w.wgmma_committed += 1
            state(w.block).epoch += 1  # a warp of its warpgroup may wait for this group
        return commit
    if op == "wait_group":
        n = parse_int(st.operands[0])

        def wait(w, mask):
            _whole(w, mask, what)
            needed = w.wgmma_committed - n  # groups that must be complete, counted from the first
            if needed <= w.wgmma_done:
                return
            # A group is the warpgroup's: it runs once all four warps have issued it, and completes for all of them.
            group_warps = w.block.warps[w.index - w.index % 4:w.index - w.index % 4 + 4]
            if any(peer.wgmma_committed < needed for peer in group_warps):
                w.retry = ("wgmma", needed)  # a peer has not issued its part yet: this warp waits, and tries again
                return
            a = state(w.block)
            for peer in group_warps:
                _complete(peer, a, needed - peer.wgmma_done)
        return wait
    if op != "mma_async" or parts[2:4] != ["sync", "aligned"]:
        raise UnknownInstruction(f"wgmma.{op} form not implemented")
    shape = _WGMMA.fullmatch(parts[4])
    kind = parts[6] if len(parts) == 8 and parts[5] == "f32" and parts[6] == parts[7] else None
    if not shape or kind not in _WGMMA_INPUTS or int(shape.group(2)) != _WGMMA_INPUTS[kind][1]:
        raise UnknownInstruction("only wgmma.mma_async.sync.aligned m64nNk16.f32.bf16.bf16 and m64nNk32.f32.e4m3.e4m3 "
                                 "are modeled")
    n = int(shape.group(1))
    transposable = kind == "bf16"  # fp8 takes no transpose operands
    if len(st.operands) != (8 if transposable else 6):
        raise UnknownInstruction("wgmma with both operands in shared memory takes d, desc-a, desc-b, scale-d, "
                                 "imm-scale-a, imm-scale-b" + (", imm-trans-a, imm-trans-b" if transposable else ""))
    d = [dec.dst(x) for x in dec.vector(st.operands[0])]
    if len(d) != n // 2:
        raise UnknownInstruction(f"m64n{n}k16 with f32 accumulators takes {n // 2} registers")
    desc_a, desc_b = dec.src(st.operands[1], np.uint64), dec.src(st.operands[2], np.uint64)
    scale_d = dec.src(st.operands[3], np.bool_)
    imm = [parse_int(x) for x in st.operands[4:]] + ([] if transposable else [0, 0])
    if imm[0] != 1 or imm[1] != 1 or imm[2] != 0:
        raise UnknownInstruction("wgmma with negated inputs or a transposed A not modeled")
    trans_b = bool(imm[3])
    lane = np.arange(LANES)
    j = np.arange(n // 2)[None, :]
    rows = lane[:, None] // 4 + 8 * ((j % 4) // 2)  # within the warp's 16 rows
    cols = 8 * (j // 4) + 2 * (lane[:, None] % 4) + j % 2

    def fn(w, mask):
        _whole(w, mask, what)
        a = state(w.block)
        quarter = w.index % 4  # the warp's 16 rows of the warpgroup's 64
        da = _uniform(np.broadcast_to(desc_a(w.r), (LANES,)), what, "descriptor")
        db = _uniform(np.broadcast_to(desc_b(w.r), (LANES,)), what, "descriptor")
        accumulate = _uniform(np.broadcast_to(scale_d(w.r), (LANES,)), what, "scale-d")
        # A: 64 rows K-major; the warp's 16 begin 16·quarter rows in, two 8-row groups per quarter
        a_all, a_idx = _operand_elements(w, a, da, 64, False, what, "wgmma's A", kind)
        b_all, b_idx = _operand_elements(w, a, db, n, trans_b, what, "wgmma's B", kind)
        product = a_all[16 * quarter:16 * quarter + 16] @ b_all.T  # (16, n)
        current = np.stack([w.wgmma_shadow.get(s, w.r[s]).view(np.float32) for s in d], axis=1).astype(np.float64)
        result = (product[rows, cols] + (current if accumulate else 0.0)).astype(np.float32)
        for k, slot in enumerate(d):
            w.wgmma_shadow[slot] = result[:, k]
        idx = np.concatenate([a_idx, b_idx])
        a.wgmma_reading[idx] += 1
        w.wgmma_open.append((d, result, idx))
    return fn


def _complete(w, a: AsyncState, count: int) -> None:
    """The warp's first `count` committed wgmma groups done: their results in its registers, their reads over."""
    for group in w.wgmma_groups[:max(0, count)]:
        for slots, result, idx in group:
            for j, slot in enumerate(slots):
                w.put(slot, result[:, j], None)
            a.wgmma_reading[idx] -= 1
    w.wgmma_groups = w.wgmma_groups[max(0, count):]
    w.wgmma_done += max(0, count)
    w.wgmma_shadow = {}
    for group in [*w.wgmma_groups, w.wgmma_open]:  # results still pending: their registers' values to be
        for slots, result, _ in group:
            for j, slot in enumerate(slots):
                w.wgmma_shadow[slot] = result[:, j]


def _whole(w, mask, what: str) -> None:
    if mask is not None:
        raise DivergenceError(f"{what}: every lane of the warp executes a .sync.aligned instruction together")


# ---- the rest of the vocabulary ----

def _fence(dec: Decoder, st, parts):
    what = _what(st)
    q = parts[1:]
    if q == ["proxy", "async", "shared::cta"] or q == ["proxy", "async"]:
        def fence(w, mask):
            a = state(w.block)
            for tid in w.tids[w.active(mask)].tolist():
                a.unfenced[a.unfenced == tid] = NONE
        return fence
    if q[:1] == ["mbarrier_init"]:
        return lambda w, mask: None
    if len(q) in (1, 2) and q[-1] in ("cta", "cluster", "gpu", "sys") and q[:-1] in ([], ["sc"], ["acq_rel"]):
        from mage_gen.interp.memops import memory_fence  # ordinary memory: fence{.sem}.scope

        return memory_fence(q[-1] in ("gpu", "sys"))
    raise UnknownInstruction(f"fence.{'.'.join(q)} not implemented ({what})")


def _setmaxnreg(dec: Decoder, st, parts):
    count = parse_int(st.operands[0])
    if parts[1] not in ("inc", "dec") or count % 8 or not 24 <= count <= 256:
        raise InterpError(f"{_what(st)}: setmaxnreg takes inc or dec and a multiple of 8 in 24..256")
    what = _what(st)
    return lambda w, mask: _whole(w, mask, what)  # registers are not counted here


def _stmatrix(dec: Decoder, st, parts):
    # stmatrix.sync.aligned.m8n8.x{1,2,4}.shared{::cta}.b16 [addr], {r...}
    mods = parts[1:]
    if mods[:3] != ["sync", "aligned", "m8n8"] or mods[-1] != "b16" or mods[3] not in ("x1", "x2", "x4") \
            or mods[4:-1] not in (["shared"], ["shared::cta"]):
        raise UnknownInstruction("only stmatrix.sync.aligned.m8n8.x{1,2,4}.shared.b16 (no .trans) is modeled")
    count = int(mods[3][1])
    base, off = dec.address(st.operands[0])
    regs = [dec.src(x, np.uint32) for x in dec.vector(st.operands[1])]
    if len(regs) != count:
        raise UnknownInstruction(f"stmatrix .x{count} takes {count} registers")
    what = _what(st)
    lane = np.arange(LANES)
    giving = lane < 8 * count

    def fn(w, mask):
        _whole(w, mask, what)
        addr = np.broadcast_to(base(w.r) + off, (LANES,)).astype(np.uint64)[giving]
        if (addr % np.uint64(16)).any():
            raise InterpError(f"{what}: stmatrix row addresses must be 16-byte aligned")
        values = np.stack([np.broadcast_to(r(w.r), (LANES,)).astype(np.uint32) for r in regs])  # (matrix, lane)
        # row g of matrix j: lanes 4g..4g+3 hold its four words, register j
        words = values.reshape(count, 8, 4).reshape(8 * count, 4)
        w.store("shared", addr, words, giving, what)
    return fn


def _prefetch(dec: Decoder, st, parts):
    if parts[1:] != ["tensormap"]:
        raise UnknownInstruction("prefetch form not implemented")
    src = dec.src(_bracket(st.operands[0]), np.uint64)
    what = _what(st)

    def fn(w, mask):
        for addr in np.broadcast_to(src(w.r), (LANES,))[w.active(mask)].tolist():
            _decode_map(w, int(addr), what)
    return fn


def _trap(dec: Decoder, st, parts):
    what = _what(st)

    def fn(w, mask):
        raise InterpError(f"{what}: trap by {w.describe_lane(int(np.flatnonzero(w.live if mask is None else mask)[0]))}")
    return fn


def _mov(dec: Decoder, st, parts):
    """mov of %globaltimer (a clock the interpreter advances) or of a parameter's address (a tensor map's, which
    cvta.param makes generic); every other mov is alu's."""
    src = st.operands[1].strip() if len(st.operands) == 2 else ""
    if src == "%globaltimer":
        d = dec.dst(st.operands[0])

        def clock(w, mask):
            a = state(w.block)
            a.clock += 1
            w.put(d, np.full(LANES, a.clock, dtype=np.uint64), mask)
        return clock
    if src in dec.params:
        d = dec.dst(st.operands[0])
        value = np.uint64(PARAM_GENERIC_BASE + dec.params[src].offset)
        return lambda w, mask: w.put(d, np.full(LANES, value, dtype=np.uint64), mask)
    return alu.BUILDERS["mov"](dec, st, parts)


def _cvta(dec: Decoder, st, parts):
    if "param" in parts:  # a parameter's address is its generic one already (_mov)
        s = dec.src(st.operands[1], np.uint64)
        d = dec.dst(st.operands[0])
        return lambda w, mask: w.put(d, np.broadcast_to(s(w.r), (LANES,)).astype(np.uint64), mask)
    return alu.BUILDERS["cvta"](dec, st, parts)


BUILDERS = {"mbarrier": _mbarrier, "wgmma": _wgmma, "fence": _fence, "setmaxnreg": _setmaxnreg,
            "stmatrix": _stmatrix, "prefetch": _prefetch, "trap": _trap, "mapa": _mapa, "mov": _mov,
            "cvta": _cvta}
