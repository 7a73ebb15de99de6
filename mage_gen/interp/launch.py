"""A launch: kernel arguments into parameter bytes and global buffers, then every block in turn,
its warps interleaved at barriers."""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

from mage_gen.interp.decode import decode
from mage_gen.interp.errors import InterpError, UnknownInstruction
from mage_gen.interp.hopper import AsyncState, HangError, TensorMap
from mage_gen.interp.memory import Global, Shared, Visibility
from mage_gen.interp.program import LANES, Program
from mage_gen.interp.warp import Warp

_PACK = {"u8": "<B", "s8": "<b", "b8": "<B", "u16": "<H", "s16": "<h", "b16": "<H", "u32": "<I", "s32": "<i",
         "b32": "<I", "u64": "<Q", "s64": "<q", "b64": "<Q", "f32": "<f", "f64": "<d"}


@dataclass
class Stats:
    blocks: int = 0
    warp_steps: int = 0  # warp-instructions executed
    barriers: int = 0
    # 128-byte lines of global memory asked of L2 under an evict-last policy and never given normal priority
    # again: what a launch leaves in a GPU's L2 past its end (bench/NOTES.md, norms §14)
    kept_lines: int = 0


def _dim3(v) -> tuple[int, int, int]:
    v = (v,) if isinstance(v, int) else tuple(v)
    return (tuple(int(x) for x in v) + (1, 1, 1))[:3]


def _split3(i: int, dims: tuple[int, int, int]) -> tuple[int, int, int]:
    return i % dims[0], (i // dims[0]) % dims[1], i // (dims[0] * dims[1])


def describe_thread(tid: int, ntid, ctaid) -> str:
    x, y, z = _split3(tid, ntid)
    return f"thread ({x},{y},{z}) of block ({ctaid[0]},{ctaid[1]},{ctaid[2]})"


class Cluster:
    """The CTAs of one thread-block cluster, run together (their warps interleaved): each reaches the others'
    shared memory and mbarriers (mapa, multicast copies, remote arrivals), and barrier.cluster holds every warp of
    them until all have arrived."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.blocks: list[Block] = []
        self.phase = 0  # barrier.cluster phases completed

    def settle(self) -> bool:
        """Completes the barrier's phase once every warp still running has arrived; whether it did."""
        live = [w for b in self.blocks for w in b.warps if not w.done]
        if not live or any(w.cluster_arrived != self.phase for w in live):
            return False
        self.phase += 1
        for b in self.blocks:
            b.asyncs.epoch += 1
        return True

    def run(self, stats: Stats, reverse: bool = False) -> None:
        """Every block's warps in turn, as Block.run does for one, until all have exited (with `reverse`, the last
        rank's first); a hang where none can go on."""
        while True:
            ran = released = False
            for b in reversed(self.blocks) if reverse else self.blocks:
                ran |= b.step()
                released |= b._release(stats)
            released |= self.settle()
            if all(w.done for b in self.blocks for w in b.warps):
                break
            if not ran and not released:
                raise HangError("every warp of the cluster of blocks "
                                f"{', '.join(str(b.ctaid) for b in self.blocks)} waits and nothing it waits for can "
                                "happen: " + "; ".join(b._wait_of(w) for b in self.blocks for w in b.warps
                                                        if not w.done))
        for b in self.blocks:
            for w in b.warps:
                stats.warp_steps += w.steps


class Block:
    def __init__(self, prog: Program, glob: Global, params: bytes, shared_bytes: int,
                 ctaid: tuple[int, int, int], ntid: tuple[int, int, int], nctaid: tuple[int, int, int],
                 cluster: Cluster | None = None):
        self.prog, self.glob, self.params, self.ctaid, self.ntid = prog, glob, params, ctaid, ntid
        self.cluster = cluster
        self.rank = 0
        if cluster is not None:
            self.rank = len(cluster.blocks)
            cluster.blocks.append(self)
        self.shared = Shared(shared_bytes)
        # bar.arrive's arrivals not yet completed, by barrier id: (warp, count, the clock of what each of its threads
        # saw of global memory when it arrived: what a waiter sees once the barrier completes)
        self.arrivals: dict[int, list[tuple[Any, int, list[np.ndarray]]]] = {}
        self.asyncs = AsyncState(self.shared.words.size) if prog.async_proxy else None
        n = ntid[0] * ntid[1] * ntid[2]
        self.first_tid = n * (ctaid[0] + nctaid[0] * (ctaid[1] + nctaid[1] * ctaid[2]))  # launch-wide id of tid 0
        if glob.visibility is not None:
            glob.visibility.begin_block(self.first_tid, n)
        self.warps = []
        for w in range(-(-n // LANES)):
            t = w * LANES + np.arange(LANES)
            tids = np.where(t < n, t, -1)
            specials = {
                "%tid.x": t % ntid[0], "%tid.y": (t // ntid[0]) % ntid[1], "%tid.z": t // (ntid[0] * ntid[1]),
                "%laneid": np.arange(LANES), "%warpid": np.full(LANES, w),
                **{f"%ntid.{a}": np.full(LANES, ntid[i]) for i, a in enumerate("xyz")},
                **{f"%ctaid.{a}": np.full(LANES, ctaid[i]) for i, a in enumerate("xyz")},
                **{f"%nctaid.{a}": np.full(LANES, nctaid[i]) for i, a in enumerate("xyz")},
                "%cluster_ctarank": np.full(LANES, self.rank),
                "%cluster_nctarank": np.full(LANES, 1 if cluster is None else cluster.size),
            }
            self.warps.append(Warp(self, prog, w, tids, specials))

    def describe(self, tid: int) -> str:
        return describe_thread(tid, self.ntid, self.ctaid)

    def step(self) -> bool:
        """Each warp that can go on runs until it waits or exits; whether any ran."""
        ran = False
        for w in self.warps:
            if w.done or w.barrier is not None:
                continue
            if w.waiting is not None and w.waiting[2] == self._epoch():
                continue  # nothing it could be waiting for has happened since it last tried
            w.run()
            ran = True
        return ran

    def run(self, stats: Stats) -> None:
        """The warps in turn, each until it waits (a barrier, an mbarrier phase) or exits; a barrier lets its warps
        go once all it waits for are there; a warp whose mbarrier wait failed runs again once something changed.
        Where nothing can change any more, the block hangs (HangError)."""
        while True:
            ran = self.step()
            released = self._release(stats)
            if all(w.done for w in self.warps):
                break
            if not ran and not released:
                raise HangError(f"every warp of block {self.ctaid} waits and nothing it waits for can happen: "
                                + "; ".join(self._wait_of(w) for w in self.warps if not w.done))
        for w in self.warps:  # copies never waited for never land: nothing may read them anyway
            stats.warp_steps += w.steps

    def _epoch(self) -> int:
        return self.asyncs.epoch if self.asyncs is not None else 0

    def arrive(self, w: Any, named: tuple[int, int | None], ins: Any) -> None:
        """Warp w's bar.arrive at barrier named[0] of named[1] threads: counted there, and the warp goes on."""
        ident, count = named
        if any(a is w for a, _, _ in self.arrivals.get(ident, [])):
            raise InterpError(f"line {ins.line}: {ins.text}: {self.describe(int(w.tids[w.live][0]))}'s warp arrives "
                              f"at barrier {ident} again before it has completed")
        seen = [] if self.glob.visibility is None else [self.glob.visibility.own(int(t)) for t in w.tids[w.tids >= 0]]
        self.arrivals.setdefault(ident, []).append((w, count, seen))

    def _release(self, stats: Stats) -> bool:
        """Lets go the warps of every barrier that has all it waits for; whether any went. bar.sync 0 waits for every
        thread that has not exited; a named barrier for its count of threads, a warp arriving for all 32, whether it
        waits there (bar.sync) or only arrives (bar.arrive). What an arriving warp stored before it arrived is seen
        by the waiters; in shared memory every access of the barrier's threads before it completes counts as ordered
        before every one after (the race tables keep no order finer than a barrier's)."""
        live = [w for w in self.warps if not w.done]
        at: dict[int, list] = {ident: [] for ident in self.arrivals}
        for w in live:
            if w.barrier is not None:
                at.setdefault(w.barrier[0], []).append(w)
        released = False
        for ident, warps in at.items():
            arrived = self.arrivals.get(ident, [])
            counts = {w.barrier[1] for w in warps} | {count for _, count, _ in arrived}
            if len(counts) > 1:
                raise InterpError(f"block {self.ctaid}: warps wait at barrier {ident} for different counts {counts}")
            count = counts.pop()
            if count is None:
                if len(warps) < len(live):
                    continue
                self.shared.new_interval()
                if self.glob.visibility is not None:
                    self.glob.visibility.barrier(np.concatenate([w.tids[w.live] for w in warps]))
            else:
                threads = LANES * (len(warps) + len(arrived))
                if threads < count:
                    continue
                if threads > count:
                    raise InterpError(f"block {self.ctaid}: {threads} threads at barrier {ident}, which waits for "
                                      f"{count}")
                tids = np.concatenate([w.tids[w.tids >= 0] for w in warps] or [np.zeros(0, np.int64)])
                self.shared.new_interval(np.concatenate([tids, *(a.tids[a.tids >= 0] for a, _, _ in arrived)]))
                if self.glob.visibility is not None and tids.size:
                    self.glob.visibility.barrier(tids, [clock for _, _, seen in arrived for clock in seen])
                self.arrivals.pop(ident, None)
            for w in warps:
                w.barrier = None
            stats.barriers += 1
            if self.asyncs is not None:
                self.asyncs.epoch += 1
            released = True
        return released

    def _wait_of(self, w) -> str:
        first = self.describe(int(w.tids[w.live][0]))
        if w.barrier is not None:
            return f"warp {w.index} (from {first}) at barrier {w.barrier[0]}"
        if w.waiting[0] == "wgmma":
            return (f"warp {w.index} (from {first}) at a wgmma.wait_group for its warpgroup's group "
                    f"{w.waiting[1]}, which another of its warps has not issued")
        if w.waiting[0] == "cluster":
            return (f"warp {w.index} (from {first}) at barrier.cluster.wait for phase {w.waiting[1]}, which a warp of "
                    "the cluster has not arrived at")
        addr, parity, _ = w.waiting
        bar = self.asyncs.barriers[addr]
        return (f"warp {w.index} (from {first}) on the mbarrier at {addr:#x} for parity {parity} "
                f"({bar.describe()})")


def _params(prog: Program, args: list) -> tuple[bytes, list[np.ndarray]]:
    params = prog.entry.params
    if len(args) != len(params):
        raise InterpError(f"entry {prog.entry.name} takes {len(params)} parameters, got {len(args)} arguments")
    arrays = [a for a in args if isinstance(a, np.ndarray)]
    for a in arrays:
        if not a.flags.c_contiguous:
            raise InterpError("array arguments must be C-contiguous (results are copied back into them)")
    # the module's own arrays first, where the decoder put their symbols (Program.global_offsets)
    module = [np.frombuffer(data, dtype=np.uint8).copy() for data in prog.entry.globals.values()]
    glob = Global(module + arrays)
    address_of = {id(a): glob.addresses[len(module) + i] for i, a in enumerate(arrays)}
    buf = bytearray(params[-1].offset + params[-1].size if params else 0)
    k = len(module)
    for p, a in zip(params, args):
        if isinstance(a, TensorMap):
            if p.size != len(a.encode(0)) or id(a.array) not in address_of:
                raise InterpError(f"parameter {p.name} ({p.size} bytes) takes a tensor map of an array that is also "
                                  "passed as a pointer argument")
            buf[p.offset:p.offset + p.size] = a.encode(address_of[id(a.array)])
        elif isinstance(a, np.ndarray):
            if p.size != 8:
                raise InterpError(f"parameter {p.name} is .{p.type}, not a pointer")
            value = glob.addresses[k]
            k += 1
            struct.pack_into("<Q", buf, p.offset, value)
        else:
            fmt = _PACK.get(p.type)
            if fmt is None:
                raise InterpError(f"parameter type .{p.type} not supported")
            if p.type.startswith(("u", "s", "b")):
                a = int(a) & ((1 << (8 * p.size)) - 1)
                fmt = {1: "<B", 2: "<H", 4: "<I", 8: "<Q"}[p.size]
            struct.pack_into(fmt, buf, p.offset, a)
    return bytes(buf), glob


def run(ptx: str, entry: str, grid, block, dynamic_shared: int, args: list, stats: Stats | None = None,
        reverse: bool = False, cluster=1) -> Stats:
    """Execute one launch of `entry`. args in PTX parameter order: numpy arrays for pointer parameters
    (C-contiguous; every array is copied back after the launch, so outputs land in place) and Python
    ints/floats for scalars. Raises an InterpError subclass for anything undefined or unsupported.
    Counts into `stats` where given. The blocks run one after another, in the order of their index, or with
    `reverse` the other way round: what a kernel computes must not depend on which block comes first. cluster:
    CTAs per thread-block cluster along x; a cluster's blocks run together (Cluster), the clusters one after
    another, and with `reverse` a cluster's last rank goes first at every turn."""
    prog = decode(ptx, entry)
    grid, block, cluster = _dim3(grid), _dim3(block), _dim3(cluster)
    if block[0] * block[1] * block[2] > 1024 or min(block) < 1 or min(grid) < 1:
        raise InterpError(f"launch of {grid} blocks × {block} threads is not valid")
    if cluster[1:] != (1, 1) or grid[0] % cluster[0]:
        raise InterpError(f"a cluster of {cluster} CTAs: clusters along x that divide the grid's {grid[0]} are modeled")
    if cluster[0] > 1 and prog.cross_block:
        raise UnknownInstruction("fences and atomics across blocks inside clusters are not modeled (blocks of a "
                                 "cluster run together, others one after another)")
    params, glob = _params(prog, args)
    dyn_base = -(-prog.static_shared // prog.dynamic_align) * prog.dynamic_align
    shared_bytes = (dyn_base + dynamic_shared) if dynamic_shared else prog.static_shared
    stats = Stats() if stats is None else stats
    n = block[0] * block[1] * block[2]
    glob.describe_owner = lambda owner: describe_thread(owner % n, block, _split3(owner // n, grid))
    if prog.cross_block:
        glob.visibility = Visibility(n * grid[0] * grid[1] * grid[2], glob.words.size)
    order = [(x, y, z) for z in range(grid[2]) for y in range(grid[1]) for x in range(0, grid[0], cluster[0])]
    with np.errstate(all="ignore"):
        for first in reversed(order) if reverse else order:
            if cluster[0] == 1:
                Block(prog, glob, params, shared_bytes, first, block, grid).run(stats)
            else:
                together = Cluster(cluster[0])
                for x in range(first[0], first[0] + cluster[0]):
                    Block(prog, glob, params, shared_bytes, (x, *first[1:]), block, grid, together)
                together.run(stats, reverse)
            stats.blocks += cluster[0]
    glob.copy_back()
    stats.kept_lines += len(glob.kept)
    return stats

