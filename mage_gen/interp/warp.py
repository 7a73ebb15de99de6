"""One warp: 32 lanes as numpy vectors under an active mask, min-PC reconvergence.

The warp runs the group of live lanes with the smallest PC; lanes that branch elsewhere wait with
their own PC and rejoin when the running group reaches it. run() returns at a barrier or when every
lane has exited. cp.async copies are held per warp until the wait_group that requires them."""

from __future__ import annotations

import numpy as np

from mage_gen.interp.errors import DivergenceError, InterpError, MemoryFault, UnknownInstruction
from mage_gen.interp.memory import NONE, SHARED_GENERIC_BASE
from mage_gen.interp.program import ARRIVE, BAR, BRA, LANES, OP, view

INF = 1 << 60
ALL = np.ones(LANES, dtype=bool)
BARRIER, SPIN, DONE = "barrier", "spin", "done"  # why run() returned


class Warp:
    def __init__(self, block, prog, index: int, tids: np.ndarray, specials: dict[str, np.ndarray]):
        self.block, self.prog, self.instrs, self.index = block, prog, prog.instrs, index
        zeros = {dt: np.zeros(LANES, dtype=dt) for dt in set(prog.slot_dtypes)}
        self.r = [zeros[dt] for dt in prog.slot_dtypes]
        for name, values in specials.items():
            self.r[prog.slots[name]] = values.astype(np.uint32)
        self.tids = tids
        self.live = tids >= 0
        self.mask = None if self.live.all() else self.live.copy()
        self.pc = 0
        self.pcs = np.zeros(LANES, dtype=np.int64)
        self.other_min = INF
        self.done = not self.live.any()
        self.cp_open: list[list] = []  # issued, not committed: [lanes, idx, data, tids]
        self.cp_groups: list[list] = []  # committed: [lanes mask, records]
        self.steps = 0
        self.barrier: tuple[int, int | None] | None = None  # (id, threads or None: all) of the bar.sync it waits at
        # the asynchronous proxy (interp/hopper.py): the try_wait that failed last (mbarrier address, parity, the
        # block's epoch then), the latest phase seen complete of each mbarrier, wgmma issued and not yet waited for
        # (the open group, the committed groups, each register's value once they complete), TMA stores by thread
        self.waiting: tuple[int, int, int] | None = None
        self.observed: dict[int, int] = {}
        self.wgmma_open: list = []
        self.wgmma_groups: list[list] = []
        self.wgmma_shadow: dict[int, np.ndarray] = {}
        self.wgmma_committed = self.wgmma_done = 0  # groups committed, and completed, since the launch
        self.retry: tuple | None = None  # an instruction that cannot go on yet (what it waits for): run again later
        self.bulk_open: dict[int, list] = {}
        self.bulk_groups: dict[int, list[list]] = {}
        self.cluster_arrived: int | None = None  # the barrier.cluster phase it arrived at, not yet waited for

    # ---- register writes ----
    def put(self, d: int, value: np.ndarray, m) -> None:
        if d < 0:
            return
        if m is None:
            self.r[d] = value
        else:
            old = self.r[d]
            if old.dtype != value.dtype:
                old = view(old, value.dtype)
            self.r[d] = np.where(m, value, old)

    def put_lanes(self, d: int, vals: np.ndarray, m) -> None:
        """Write the values of the active lanes only (vals has one row per active lane)."""
        if d < 0:  # the sink `_` of a vector load
            return
        if m is None:
            self.r[d] = vals
        else:
            new = view(self.r[d], vals.dtype).copy()
            new[m] = vals
            self.r[d] = new

    def active(self, m):
        return slice(None) if m is None else m

    def describe_lane(self, lane: int) -> str:
        return self.block.describe(int(self.tids[lane]))

    # ---- memory ----
    def _split(self, addr):
        """Generic addresses: (which lanes point into the shared window, their shared-window addresses)."""
        a = addr.astype(np.uint64)
        sh = (a >= np.uint64(SHARED_GENERIC_BASE)) & (a < np.uint64(SHARED_GENERIC_BASE + (1 << 32)))
        return sh, a - np.uint64(SHARED_GENERIC_BASE)

    def _spaces(self, space: str, addr, sel) -> list[tuple[str, np.ndarray, object, np.ndarray | None]]:
        """(space, addresses, lane selection, which of the lanes) per state space the access touches:
        a generic access splits between the shared window and global memory."""
        if space != "generic":
            return [(space, addr, sel, None)]
        sh, local = self._split(addr)
        if sh.all():
            return [("shared", local, sel, None)]
        if not sh.any():
            return [("global", addr, sel, None)]
        return [("shared", local[sh], _sub(sel, sh), sh), ("global", addr[~sh], _sub(sel, ~sh), ~sh)]

    def load(self, space: str, addr, nwords: int, sel, what: str) -> np.ndarray:
        if space == "shared::cluster":
            return self._load_cluster(addr, nwords, sel, what)
        parts = self._spaces(space, addr, sel)
        out = np.empty((len(addr), nwords), dtype=np.uint32) if len(parts) > 1 else None
        b = self.block
        for where, a, s, lanes in parts:
            tids = self.tids[s]
            if where == "global":
                values = b.glob.read(a, nwords, tids, b.describe, what)
            else:
                values = b.shared.read(b.shared.index(a, nwords, tids, b.describe, what), tids, b.describe, what)
            if lanes is None:
                return values
            out[lanes] = values
        return out

    def _load_cluster(self, addr, nwords: int, sel, what: str) -> np.ndarray:
        """Each lane's words from the shared memory of the cluster's CTA its address names (hopper.peer: mapa's
        window), as they are: a word its CTA has not written yet reads as the poison NaN. A peer's reads are not
        entered in its race bookkeeping, which follows its own threads."""
        from mage_gen.interp.hopper import peer

        tids = self.tids[sel]
        out = np.empty((len(addr), nwords), dtype=np.uint32)
        for i, a in enumerate(np.asarray(addr).tolist()):
            block, local = peer(self, int(a), what)
            idx = block.shared.index(np.array([local]), nwords, tids[i:i + 1], self.block.describe, what)
            out[i] = block.shared.words[idx[0]]
        return out

    def store(self, space: str, addr, values: np.ndarray, sel, what: str) -> None:
        b = self.block
        for where, a, s, lanes in self._spaces(space, addr, sel):
            tids = self.tids[s]
            v = values if lanes is None else values[lanes]
            if where == "global":
                b.glob.write(a, v, tids, b.describe, what, tids + b.first_tid)
            else:
                idx = b.shared.index(a, v.shape[1], tids, b.describe, what)
                if b.asyncs is not None:
                    b.asyncs.generic_write(idx, tids, b.describe, what)
                b.shared.write(idx, tids, v, b.describe, what)

    def prefetch_l2(self, addr, sizes: np.ndarray, sel, what: str, keep: bool = False) -> None:
        """keep: under an evict-last policy, so every line the bytes touch is kept until released."""
        b = self.block
        tids = self.tids[sel]
        for size in np.unique(sizes).tolist():
            lanes = sizes == size
            if size <= 0 or size % 16:
                raise MemoryFault(f"{what}: a bulk prefetch of {size} bytes (a positive multiple of 16 is asked)")
            b.glob.check_span(addr[lanes], size, tids[lanes], b.describe, what)
        if keep:
            for a, size in zip(addr.tolist(), sizes.tolist()):
                self.keep_lines(np.array([a]), size)

    def keep_lines(self, addr, size: int) -> None:
        """The lines `size` bytes from each address touch, read under an evict-last policy: kept until released."""
        kept = self.block.glob.kept
        for a in addr.tolist():
            kept.update(range(a // 128 * 128, a + size, 128))

    def apply_priority(self, addr, sel, what: str) -> None:
        b = self.block
        b.glob.check_line(addr, self.tids[sel], b.describe, what)
        b.glob.kept.difference_update(addr.tolist())

    # ---- cp.async ----
    def cp_issue(self, dst, src, size: int, ssz, sel, what: str) -> None:
        b, sh = self.block, self.block.shared
        tids = self.tids[sel]
        lanes = np.arange(LANES)[sel]
        nw = size // 4
        idx = sh.index(dst, nw, tids, b.describe, what)
        if ssz is None:
            data = b.glob.read(src, nw, tids, b.describe, what)
        else:
            ssz = np.asarray(ssz).astype(np.int64)
            data = np.zeros((len(tids), nw), dtype=np.uint32)
            for v in np.unique(ssz).tolist():
                if v == 0:
                    continue
                if v > size or v % 4:
                    raise UnknownInstruction(f"{what}: src-size {v} of a {size}-byte cp.async not implemented")
                rows = ssz == v
                data[rows, :v // 4] = b.glob.read(src[rows], v // 4, tids[rows], b.describe, what)
        t = np.broadcast_to(tids[:, None], idx.shape)
        sh.check_pending(idx, t, b.describe, what, True)
        sh.check_conflict(idx, t, b.describe, what)  # it may land any time from now to its wait
        sh.pending[idx] = t
        self.cp_open.append([lanes, idx, data, tids, what])

    def cp_commit(self, m) -> None:
        cur = self.live if m is None else m
        taken, keep = [], []
        for rec in self.cp_open:
            rows = cur[rec[0]]
            if rows.all():
                taken.append(rec)
            else:
                if rows.any():
                    taken.append([x[rows] for x in rec[:4]] + [rec[4]])
                keep.append([x[~rows] for x in rec[:4]] + [rec[4]])
        self.cp_open = keep
        self.cp_groups.append([cur.copy(), taken])

    def cp_wait(self, n: int, m, what: str) -> None:
        cur = self.live if m is None else m
        seen = np.zeros(LANES, dtype=np.int64)
        for g in reversed(self.cp_groups):
            land = cur & g[0] & (seen >= n)
            seen += g[0]
            if not land.any():
                continue
            rest = []
            for rec in g[1]:
                rows = land[rec[0]]
                if rows.any():
                    self._land(rec[1][rows], rec[2][rows], rec[3][rows], rec[4])
                if not rows.all():
                    rest.append([x[~rows] for x in rec[:4]] + [rec[4]])
            g[0] = g[0] & ~land
            g[1] = rest
        self.cp_groups = [g for g in self.cp_groups if g[0].any()]

    def _land(self, idx, data, tids, what: str) -> None:
        b, sh = self.block, self.block.shared
        sh.pending[idx] = NONE
        sh.claim_write(idx, tids, b.describe, what)
        sh.words[idx] = data

    # ---- control ----
    def _reschedule(self, pc: int, cur: np.ndarray) -> int:
        self.pcs[cur] = pc
        live = self.live
        pcs = np.where(live, self.pcs, INF)
        new = int(pcs.min())
        group = pcs == new
        rest = live & ~group
        self.other_min = int(pcs[rest].min()) if rest.any() else INF
        self.mask = None if group.all() else group
        return new

    def run(self) -> str:
        """Execute until a barrier (BARRIER, self.barrier saying which), a try_wait on an mbarrier phase not yet
        complete (SPIN: the others run before it tries again), or until every lane has exited (DONE)."""
        instrs, r = self.instrs, self.r
        pc, mask = self.pc, self.mask
        steps = 0
        self.waiting = None
        try:
            while True:
                ins = instrs[pc]
                steps += 1
                m = mask
                if ins.guard >= 0:
                    g = r[ins.guard]
                    if ins.neg:
                        g = ~g
                    m = g if mask is None else mask & g
                    if not m.any():
                        pc += 1
                        if pc >= self.other_min:
                            pc = self._reschedule(pc, ALL if mask is None else mask)
                            mask = self.mask
                        continue
                    if mask is None and m.all():
                        m = None
                kind = ins.kind
                if kind == OP:
                    ins.fn(self, m)
                    if self.retry is not None:  # the same instruction again, once something has changed
                        self.waiting = (*self.retry, self.block.asyncs.epoch)
                        self.retry = None
                        self.pc, self.mask = pc, mask
                        self.steps += steps
                        return SPIN
                    pc += 1
                    if self.waiting is not None:
                        self.pc, self.mask = pc, mask
                        self.steps += steps
                        return SPIN
                elif kind == BRA:
                    cur = ALL if mask is None else mask
                    if m is None or m is mask or (m == cur).all():  # every running lane branches
                        pc = ins.target
                    else:
                        if ins.uni:
                            raise DivergenceError(f"line {ins.line}: {ins.text}: bra.uni taken by only some lanes "
                                                  f"of {self.block.describe(int(self.tids[self.live][0]))}'s warp")
                        self.pcs[cur & ~m] = pc + 1
                        self.pcs[m] = ins.target
                        pc = self._reschedule(ins.target, m)
                        mask = self.mask
                        continue
                elif kind == BAR or kind == ARRIVE:
                    if ins.guard >= 0 or self.other_min != INF:
                        raise DivergenceError(f"line {ins.line}: {ins.text}: {ins.text.split()[0]} reached by part of "
                                              f"a diverged warp ({self.block.describe(int(self.tids[self.live][0]))}'s)")
                    ident, count = ins.fn(r)
                    ident, count = np.unique(np.asarray(ident)), None if count is None else np.unique(np.asarray(count))
                    if ident.size != 1 or (count is not None and count.size != 1):
                        raise DivergenceError(f"line {ins.line}: {ins.text}: the lanes name different barriers")
                    named = (int(ident[0]), None if count is None else int(count[0]))
                    if kind == ARRIVE:  # counted at the barrier, and the warp goes on
                        self.block.arrive(self, named, ins)
                        pc += 1
                        continue
                    self.barrier = named
                    self.pc, self.mask = pc + 1, mask
                    self.steps += steps
                    return BARRIER
                else:  # EXIT
                    cur = ALL if mask is None else mask
                    leaving = cur if m is None else m
                    self.live = self.live & ~leaving
                    if not self.live.any():
                        self.done = True
                        self.steps += steps
                        return DONE
                    remaining = cur & ~leaving
                    if remaining.any():
                        mask = remaining
                        pc += 1
                    else:
                        pc = self._reschedule(INF, leaving)
                        mask = self.mask
                        continue
                if pc >= self.other_min:
                    pc = self._reschedule(pc, ALL if mask is None else mask)
                    mask = self.mask
        except InterpError:
            raise
        except Exception as exc:  # a numpy error inside an instruction: name it
            raise InterpError(f"line {ins.line}: {ins.text}: {type(exc).__name__}: {exc}") from exc


def _sub(sel, part: np.ndarray):
    """The lanes selector for a subset 'part' of the lanes that 'sel' selects."""
    lanes = np.arange(LANES)[sel][part]
    out = np.zeros(LANES, dtype=bool)
    out[lanes] = True
    return out

