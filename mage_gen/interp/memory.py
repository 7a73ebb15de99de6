"""Global and shared memory as 32-bit words, with the checks that make the interpreter adversarial.

Global: every buffer lies in one word array at a pointer-like address, with unmapped gaps between
buffers; an access that does not fall wholly inside one buffer, or is misaligned, is a MemoryFault.
Shared: starts as NaN; between two barriers it remembers, for every word, the thread that wrote it
and the thread(s) that read it, and which thread's cp.async is still filling it.
Visibility (a kernel that synchronizes across blocks, with fences and atomics): which global stores each
thread has been made to see, so that a read of a word another thread stored is checked for the release and
acquire (or the barrier) that order the store before it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from mage_gen.interp.errors import MemoryFault, RaceError, StaleReadError

GLOBAL_BASE = 0x7F00_0000_0000  # where the first buffer starts; looks like a device pointer
GAP_BYTES = 4096  # unmapped bytes between buffers
SHARED_GENERIC_BASE = 0x7E00_0000_0000  # generic address of shared-window address 0 (cvta)
SHARED_POISON = 0x7FC0DEAD  # a quiet NaN: shared memory's contents before anything is written
NONE, MANY = -1, -2

Describe = Callable[[int], str]  # thread id in the block -> 'thread (5,0,0) of block (0,0,0)'


class Global:
    @staticmethod
    def layout(sizes: list[int]) -> list[int]:
        """The address of each of arrays of these byte sizes, laid out in turn: 256-byte aligned, GAP_BYTES apart."""
        starts, total = [], 0
        for size in sizes:
            starts.append(GLOBAL_BASE + total)
            total += -(-size // 256) * 256 + GAP_BYTES
        return starts

    def __init__(self, arrays: list[np.ndarray]):
        # where each array starts, and (an empty one after them) where they end
        *offsets, total = (start - GLOBAL_BASE for start in self.layout([a.nbytes for a in arrays] + [0]))
        self.words = np.zeros(max(total, 4) // 4, dtype=np.uint32)
        self.arrays = arrays
        self.starts = np.array([GLOBAL_BASE + o for o in offsets], dtype=np.uint64)
        self.ends = np.array([GLOBAL_BASE + o + a.nbytes for o, a in zip(offsets, arrays)], dtype=np.uint64)
        for o, a in zip(offsets, arrays):
            raw = a.reshape(-1).view(np.uint8)
            self.words.view(np.uint8)[o:o + raw.size] = raw
        self.addresses = [int(s) for s in self.starts]
        self.writer: np.ndarray | None = None  # launch-wide thread that stored each word, +1 (0: none)
        self.kept: set[int] = set()  # addresses of the 128-byte lines asked for at evict-last, not yet released
        self.describe_owner: Describe = str  # launch-wide thread id -> words (set by the launch)
        self.visibility: Visibility | None = None  # set by the launch for a kernel with fences or atomics

    def copy_back(self) -> None:
        for start, a in zip(self.addresses, self.arrays):
            o = start - GLOBAL_BASE
            a.reshape(-1).view(np.uint8)[:] = self.words.view(np.uint8)[o:o + a.nbytes]

    def _index(self, addr: np.ndarray, nbytes: int, tids, describe: Describe, what: str) -> np.ndarray:
        addr = addr.astype(np.uint64, copy=False)
        k = np.searchsorted(self.starts, addr, side="right") - 1
        align = min(nbytes, 16)
        ok = (k >= 0) & ((addr % np.uint64(align)) == 0)
        ok[ok] &= addr[ok] + np.uint64(nbytes) <= self.ends[k[ok]]
        if not ok.all():
            bad = int(np.argmin(ok))
            a = int(addr[bad])
            inside = any(s <= a < e for s, e in zip(self.starts.tolist(), self.ends.tolist()))
            why = (f"misaligned {nbytes}-byte access" if inside and a % align
                   else f"{nbytes}-byte access outside every buffer")
            raise MemoryFault(f"{what}: {why} at global address {a:#x} by {describe(int(tids[bad]))}"
                              f"{self._nearest(a)}")
        return ((addr - np.uint64(GLOBAL_BASE)) >> np.uint64(2)).astype(np.int64)

    def _nearest(self, a: int) -> str:
        for i, (s, e) in enumerate(zip(self.starts.tolist(), self.ends.tolist())):
            if s - GAP_BYTES <= a < e + GAP_BYTES:
                return f" (argument buffer {i} spans {s:#x}..{e:#x})"
        return ""

    def check_line(self, addr, tids, describe: Describe, what: str) -> None:
        """A MemoryFault unless each lane's address starts a 128-byte line (which lies in one page) that holds a
        byte of some buffer: a cache operation on a line reaches no other memory than the line."""
        addr = addr.astype(np.uint64, copy=False)
        k = np.searchsorted(self.starts, addr + np.uint64(127), side="right") - 1
        ok = (k >= 0) & (addr % np.uint64(128) == 0)
        ok[ok] &= addr[ok] < self.ends[k[ok]]
        if not ok.all():
            bad = int(np.argmin(ok))
            a = int(addr[bad])
            why = "not 128-byte aligned" if a % 128 else "with no byte in any buffer"
            raise MemoryFault(f"{what}: a line at global address {a:#x}, {why}, by {describe(int(tids[bad]))}"
                              f"{self._nearest(a)}")

    def check_span(self, addr, nbytes: int, tids, describe: Describe, what: str) -> None:
        """A MemoryFault unless each lane's nbytes from its address lie in one buffer, 16-byte aligned."""
        self._index(addr, nbytes, tids, describe, what)

    def read(self, addr, nwords: int, tids, describe: Describe, what: str) -> np.ndarray:
        """(lanes, nwords) uint32 words at each lane's byte address; under a Visibility, a StaleReadError where a
        word another thread stored has not been made visible to the reading thread (tids: in its block)."""
        idx = self._index(addr, 4 * nwords, tids, describe, what)
        idx = idx[:, None] + np.arange(nwords)
        if self.visibility is not None and self.writer is not None:
            self.visibility.check_read(self, idx, tids, describe, what)
        return self.words[idx]

    def word_index(self, addr, nbytes: int, tids, describe: Describe, what: str) -> np.ndarray:
        """The index of each lane's first word, after the checks of an access of nbytes (an atomic's)."""
        return self._index(addr, nbytes, tids, describe, what)

    def read16(self, addr, tids, describe: Describe, what: str) -> np.ndarray:
        """The uint16 at each lane's 2-byte-aligned address inside a buffer (a 2-byte load of an input: the
        visibility of stores is not checked, as write16 is not race-checked)."""
        return self.words.view(np.uint16)[self._half_index(addr, tids, describe, what)]

    def write16(self, addr, values: np.ndarray, tids, describe: Describe, what: str) -> None:
        """2-byte stores of uint16 values at 2-byte-aligned addresses inside a buffer; not race-checked (ownership
        is kept per word, and two threads may own the two halves of one)."""
        self.words.view(np.uint16)[self._half_index(addr, tids, describe, what)] = values

    def _half_index(self, addr, tids, describe: Describe, what: str) -> np.ndarray:
        """The index of each lane's 16-bit element, after the checks of a 2-byte access."""
        self._index(addr, 2, tids, describe, what)
        return ((addr.astype(np.uint64) - np.uint64(GLOBAL_BASE)) >> np.uint64(1)).astype(np.int64)

    def write(self, addr, values: np.ndarray, tids, describe: Describe, what: str, owners=None) -> None:
        """Store; with owners (launch-wide thread ids), two threads storing to one word is a RaceError:
        which value a GPU would keep is undefined (the templates never store a word twice)."""
        idx = self._index(addr, 4 * values.shape[1], tids, describe, what)
        idx = idx[:, None] + np.arange(values.shape[1])
        if owners is not None:
            if self.writer is None:
                self.writer = np.zeros(self.words.size, dtype=np.int64)
            me = np.broadcast_to(np.asarray(owners, dtype=np.int64)[:, None] + 1, idx.shape)
            prev = self.writer[idx]
            self.writer[idx] = me
            if self.visibility is not None:
                self.visibility.stored(idx, me[:, 0] - 1)
            clash = ((prev != 0) & (prev != me)) | (self.writer[idx] != me)
            if clash.any():
                i = tuple(np.argwhere(clash)[0])
                other = int(prev[i]) if prev[i] not in (0, me[i]) else int(self.writer[idx][i])
                a = GLOBAL_BASE + 4 * int(idx[i])
                raise RaceError(f"{what}: global-memory race at global address {a:#x}: "
                                f"{describe(int(tids[i[0]]))} stores to a word that "
                                f"{self.describe_owner(other - 1)} also stores to in this launch")
        self.words[idx] = values


class Visibility:
    """What each thread of the running block has been made to see of the launch's global stores, as a vector
    clock: a thread's stores are numbered, and see[t, u] is the last of thread u's it sees (u launch-wide).

    A bar.sync merges the clocks of the threads it releases (every store before it is seen after it by all of
    them). A release (fence.acq_rel / fence.sc / membar at gpu or sys scope, then a strong write such as an
    atomic; or an atomic .release / .acq_rel) attaches to the atomic's word what the thread saw at the fence (at
    the atomic); an acquire (an atomic .acquire / .acq_rel; or a relaxed atomic then such a fence) adds what the
    word carries to what the thread sees. A read of a word another thread stored in this launch is a
    StaleReadError unless the reader sees that store: blocks run one after another here, so a store a GPU could
    still be holding back is caught by what orders it, not by when it lands. CTA-scoped fences and atomics order
    nothing across blocks and are not counted. Atomics themselves are never stale (they act on the word's latest
    value)."""

    def __init__(self, threads: int, words: int):
        self.threads = threads  # of the launch
        self.stores = np.zeros(threads, dtype=np.int32)  # stores each thread has made
        self.seq = np.zeros(words, dtype=np.int32)  # per global word: its writer's store number
        self.carried: dict[int, np.ndarray] = {}  # global word -> the clock its releases attached
        self.first = 0
        self.see = np.zeros((0, threads), dtype=np.int32)
        self.released: dict[int, np.ndarray] = {}  # thread of the block -> its clock at its last fence
        self.acquired: dict[int, np.ndarray] = {}  # thread -> clocks its relaxed atomics read, for its next fence

    def begin_block(self, first: int, threads: int) -> None:
        self.first = first
        self.see = np.zeros((threads, self.threads), dtype=np.int32)
        self.released.clear()
        self.acquired.clear()

    def own(self, t: int) -> np.ndarray:
        """Thread t's clock (t in its block), its own stores included."""
        clock = self.see[t].copy()
        clock[self.first + t] = self.stores[self.first + t]
        return clock

    def stored(self, idx: np.ndarray, owners: np.ndarray) -> None:
        np.add.at(self.stores, owners, 1)
        self.seq[idx] = self.stores[owners][:, None]

    def barrier(self, tids: np.ndarray, arrived: Sequence[np.ndarray] = ()) -> None:
        """The threads tids (of the block) leave a barrier together: each sees what any of them saw or stored, and
        what the threads that only arrived there (bar.arrive) had seen or stored when they arrived (their clocks)."""
        merged = np.max([self.see[tids].max(axis=0), *arrived], axis=0)
        own = self.first + tids
        merged[own] = np.maximum(merged[own], self.stores[own])
        self.see[tids] = merged

    def fence(self, t: int) -> None:
        """A fence at gpu scope by thread t: what its relaxed atomics read is now seen; what it sees is released
        by its next strong write."""
        if t in self.acquired:
            self.see[t] = np.maximum(self.see[t], self.acquired.pop(t))
        self.released[t] = self.own(t)

    def atomic(self, word: int, t: int, sem: str) -> None:
        """An atomic of thread t on a global word, under sem (relaxed, acquire, release, acq_rel)."""
        carried = self.carried.get(word)
        give = self.own(t) if sem in ("release", "acq_rel") else self.released.get(t)
        if give is not None:
            self.carried[word] = give if carried is None else np.maximum(carried, give)
        if carried is not None:
            if sem in ("acquire", "acq_rel"):
                self.see[t] = np.maximum(self.see[t], carried)
            else:
                self.acquired[t] = carried if t not in self.acquired else np.maximum(self.acquired[t], carried)

    def check_read(self, glob: Global, idx: np.ndarray, tids, describe: Describe, what: str) -> None:
        writer = glob.writer[idx] - 1
        t = np.broadcast_to(np.asarray(tids, dtype=np.int64)[:, None], idx.shape)
        foreign = (writer >= 0) & (writer != self.first + t)
        if not foreign.any():
            return
        stale = foreign & (self.seq[idx] > self.see[t, np.maximum(writer, 0)])
        if stale.any():
            i = tuple(np.argwhere(stale)[0])
            raise StaleReadError(f"{what}: {describe(int(t[i]))} reads global address "
                                 f"{GLOBAL_BASE + 4 * int(idx[i]):#x}, which {glob.describe_owner(int(writer[i]))} "
                                 "stored with nothing that makes the store visible to it: no release (a gpu-scope "
                                 "fence before an atomic) and acquire (an atomic, then a fence) between them, nor a "
                                 "barrier of one block")


class Shared:
    """One block's shared memory and its race bookkeeping for the current barrier interval."""

    def __init__(self, nbytes: int):
        self.nbytes = nbytes
        n = max(1, -(-nbytes // 4))
        self.words = np.full(n, SHARED_POISON, dtype=np.uint32)
        self.writer = np.full(n, NONE, dtype=np.int32)
        self.reader = np.full(n, NONE, dtype=np.int32)
        self.pending = np.full(n, NONE, dtype=np.int32)  # thread whose cp.async is filling the word
        # the warps that read each word read by several threads (MANY), as bits: a named barrier of them all
        # orders every one of those reads
        self.reader_warps = np.zeros(n, dtype=np.uint64)

    def new_interval(self, tids: np.ndarray | None = None) -> None:
        """A barrier: every access before it is ordered before every one after it; with tids (a named barrier),
        only those threads' accesses."""
        if tids is None:
            self.writer.fill(NONE)
            self.reader.fill(NONE)
            self.reader_warps.fill(0)
            return
        for table in (self.writer, self.reader):
            table[np.isin(table, tids)] = NONE
        many = np.flatnonzero(self.reader == MANY)
        if many.size:
            warps = np.bitwise_or.reduce(np.uint64(1) << np.unique(np.asarray(tids) // 32).astype(np.uint64))
            ordered = many[(self.reader_warps[many] & ~warps) == 0]
            self.reader[ordered] = NONE
            self.reader_warps[ordered] = 0

    def index(self, addr, nwords: int, tids, describe: Describe, what: str) -> np.ndarray:
        """(lanes, nwords) word indices; a MemoryFault outside the block's shared memory."""
        addr = np.asarray(addr).astype(np.int64) & 0xFFFFFFFF
        nbytes = 4 * nwords
        ok = (addr % min(nbytes, 16) == 0) & (addr + nbytes <= self.nbytes)
        if not ok.all():
            bad = int(np.argmin(ok))
            a = int(addr[bad])
            why = "misaligned" if a % min(nbytes, 16) else f"out-of-bounds (the block has {self.nbytes} bytes)"
            raise MemoryFault(f"{what}: {why} {nbytes}-byte shared access at shared address {a:#x} "
                              f"by {describe(int(tids[bad]))}")
        return (addr >> 2)[:, None] + np.arange(nwords)

    def check_pending(self, idx, t, describe: Describe, what: str, writing: bool) -> None:
        p = self.pending[idx]
        if (p != NONE).any():
            i = tuple(np.argwhere(p != NONE)[0])
            verb = "writes" if writing else "reads"
            raise StaleReadError(f"{what}: {describe(int(t[i]))} {verb} shared address {4 * int(idx[i]):#x} while "
                                 f"a cp.async of {describe(int(p[i]))} is still filling it (no wait_group "
                                 "has waited for it)")

    def read(self, idx: np.ndarray, tids: np.ndarray, describe: Describe, what: str) -> np.ndarray:
        t = np.broadcast_to(tids[:, None], idx.shape)
        self.check_pending(idx, t, describe, what, False)
        wr = self.writer[idx]
        bad = (wr != NONE) & (wr != t)
        if bad.any():
            i = tuple(np.argwhere(bad)[0])
            raise RaceError(f"{what}: shared-memory race at shared address {4 * int(idx[i]):#x}: "
                            f"{describe(int(t[i]))} reads bytes that {describe(int(wr[i]))} wrote since the "
                            "last barrier")
        r = self.reader[idx]
        self.reader[idx] = t
        multi = (self.reader[idx] != t) | ((r != NONE) & (r != t))
        warps = t // 32
        first = int(warps.flat[0]) if warps.size else 0
        if (warps == first).all():  # one warp's read (a load always is): one bit, duplicates harmless
            self.reader_warps[idx] |= np.uint64(1) << np.uint64(first)
        else:
            np.bitwise_or.at(self.reader_warps, idx.ravel(), (np.uint64(1) << warps.astype(np.uint64)).ravel())
        if multi.any():
            self.reader[idx[multi]] = MANY
        return self.words[idx]

    def check_conflict(self, idx: np.ndarray, t: np.ndarray, describe: Describe, what: str) -> None:
        """A write by threads t to words idx races with another thread's access since the last barrier."""
        for table, verb in ((self.writer, "wrote"), (self.reader, "read")):
            o = table[idx]
            bad = (o != NONE) & (o != t)
            if bad.any():
                i = tuple(np.argwhere(bad)[0])
                who = "several other threads" if int(o[i]) == MANY else describe(int(o[i]))
                raise RaceError(f"{what}: shared-memory race at shared address {4 * int(idx[i]):#x}: "
                                f"{describe(int(t[i]))} writes bytes that {who} {verb} since the last barrier")

    def claim_write(self, idx: np.ndarray, tids: np.ndarray, describe: Describe, what: str) -> None:
        """Check that the writing threads own these words in this interval, and record them as writer."""
        t = np.broadcast_to(tids[:, None], idx.shape)
        self.check_conflict(idx, t, describe, what)
        self.writer[idx] = t
        clash = self.writer[idx] != t
        if clash.any():
            i = tuple(np.argwhere(clash)[0])
            raise RaceError(f"{what}: shared-memory race at shared address {4 * int(idx[i]):#x}: "
                            f"{describe(int(t[i]))} and {describe(int(self.writer[idx][i]))} write it in the "
                            "same instruction")

    def write(self, idx: np.ndarray, tids: np.ndarray, values: np.ndarray, describe: Describe, what: str) -> None:
        self.check_pending(idx, np.broadcast_to(tids[:, None], idx.shape), describe, what, True)
        self.claim_write(idx, tids, describe, what)
        self.words[idx] = values
