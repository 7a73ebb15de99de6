"""What a compiled variant is made of, read from ptxas's report and the PTX alone: no GPU needed.

Memory instructions written from templates carry a `// tensor=NAME[.passK][.tail]` comment (see
templates/ptx.j2), so loads and stores are counted per tensor and per pass over it.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import asdict, dataclass, field

from mage_gen.compile import Compiled
from mage_gen.errors import CompileError

_WIDTHS = {"v2": "v2", "v4": "v4", "v8": "v8"}
_RESOURCE_PATTERNS = {
    "registers": r"Used (\d+) registers",
    "barriers": r"used (\d+) barriers",
    "shared_bytes": r"(\d+) bytes smem",
    "stack_bytes": r"(\d+) bytes stack frame",
    "spill_store_bytes": r"(\d+) bytes spill stores",
    "spill_load_bytes": r"(\d+) bytes spill loads",
}
_TAG = re.compile(r"//\s*tensor=([\w.]+)")
_GUARD = re.compile(r"^@!?%\w+\s+")


@dataclass(frozen=True)
class Census:
    registers: int
    barriers: int  # named barriers ptxas allots
    shared_bytes: int  # static shared memory
    stack_bytes: int
    spill_store_bytes: int
    spill_load_bytes: int
    # tensor -> access width ('scalar' | 'v2' | 'v4') -> instructions in the PTX; untagged accesses under '?'
    global_loads: dict[str, dict[str, int]] = field(default_factory=dict)
    global_stores: dict[str, dict[str, int]] = field(default_factory=dict)
    # tensor -> pass numbers that load it (a register-resident kernel reads its input in one pass)
    load_passes: dict[str, list[int]] = field(default_factory=dict)
    shared_loads: int = 0
    shared_stores: int = 0
    cp_async: dict[int, int] = field(default_factory=dict)  # bytes per copy -> instructions
    commit_groups: int = 0
    wait_groups: dict[int, int] = field(default_factory=dict)  # N of wait_group N -> instructions
    bar_sync: int = 0
    shfl_sync: int = 0
    rsqrt_approx: int = 0
    half_widen: int = 0  # 16-bit elements widened to f32 (cvt.f32.f16, or a bf16 pair's shl/and)
    half_narrow: int = 0  # cvt.rn.bf16x2.f32 / cvt.rn.f16x2.f32: two f32 rounded into one 32-bit pair
    mma: dict[str, int] = field(default_factory=dict)  # 'm16n8k16.bf16' -> mma.sync instructions
    ldmatrix: dict[str, int] = field(default_factory=dict)  # 'x4', 'x2.trans' -> ldmatrix instructions
    tf32_round: int = 0  # cvt.rna/.rn.tf32.f32: an f32 rounded to tf32 (3xTF32 splits each operand with it)
    # tensor -> cp.async.bulk.prefetch.L2 instructions: bytes asked of L2 for later loads, landing nowhere
    l2_prefetch: dict[str, int] = field(default_factory=dict)
    # tensor -> those of them under a cache policy (.L2::cache_hint), and createpolicy instructions by the
    # priority they give ('evict_last' -> 1)
    l2_prefetch_hinted: dict[str, int] = field(default_factory=dict)
    cache_policies: dict[str, int] = field(default_factory=dict)
    # tensor -> applypriority instructions: lines given back normal priority once read
    l2_released: dict[str, int] = field(default_factory=dict)
    # a load's full tag ('x.pass1') -> its global loads under a cache policy (.L2::cache_hint)
    global_loads_hinted: dict[str, int] = field(default_factory=dict)
    # Hopper's asynchronous instructions (HOPPER_OPS) -> instructions: wgmma by shape ('wgmma m64n256k16.bf16'), TMA
    # copies by tensor ('tma load A', 'tma load B multicast', 'tma store C'), mbarrier operations, fences,
    # setmaxnreg by count ('setmaxnreg.inc 232'), cluster barriers, stmatrix, atomics and gpu-scope fences
    hopper: dict[str, int] = field(default_factory=dict)
    # tensor -> the widest single global access to it, in bytes (a v2.f32 store: 8; a 16-byte cp.async: 16): the
    # alignment its pointer must have (aligned_contract)
    widest_access: dict[str, int] = field(default_factory=dict)
    # tensor -> TMA stores that read shared memory an ordinary store (st.shared, stmatrix) wrote since the last
    # fence.proxy.async, in the PTX's order: the asynchronous proxy may read what the threads wrote before it is
    # visible to it. A GPU need not show the race (the H200 did not, bench/NOTES.md), so it is refused from the PTX.
    unfenced_async_reads: dict[str, int] = field(default_factory=dict)

    @property
    def spill_bytes(self) -> int:
        return self.spill_store_bytes + self.spill_load_bytes

    def static_fault(self) -> str:
        """Why the PTX alone shows the kernel unsafe to run, or '': what the gate refuses before any launch."""
        if self.unfenced_async_reads:
            stores = ", ".join(f"{count} of {tensor}" for tensor, count in self.unfenced_async_reads.items())
            return (f"census: TMA stores ({stores}) read shared memory the threads wrote with no fence.proxy.async "
                    "since, which the asynchronous proxy need not see")
        return ""

    def passes_over(self, tensor: str) -> int:
        return len(self.load_passes.get(tensor, []))

    def loads_of(self, tensor: str, width: str | None = None, tail: bool | None = None) -> int:
        """Load instructions of a tensor, optionally of one width, and on (tail=True) or off the tail path."""
        return _count(self.global_loads, tensor, width, tail)

    def stores_of(self, tensor: str, width: str | None = None, tail: bool | None = None) -> int:
        return _count(self.global_stores, tensor, width, tail)

    def to_dict(self) -> dict:
        out = asdict(self)
        out["spill_bytes"] = self.spill_bytes
        out["passes"] = {tensor: len(passes) for tensor, passes in self.load_passes.items()}
        return out


def _count(table: dict[str, dict[str, int]], tensor: str, width: str | None, tail: bool | None) -> int:
    total = 0
    for tag, widths in table.items():
        parts = tag.split(".")
        if parts[0] != tensor or (tail is not None and ("tail" in parts) != tail):
            continue
        total += sum(n for w, n in widths.items() if width is None or w == width)
    return total


# ptxas -v always prints these for an entry function; without them the census would invent zeros (and a
# tie broken by fewer registers would pick the kernel whose report went missing).
_REQUIRED = ("registers", "stack_bytes", "spill_store_bytes", "spill_load_bytes")


def _resource(log: str, name: str, pattern: str, kernel: str) -> int:
    match = re.search(pattern, log)
    if match:
        return int(match.group(1))
    if name in _REQUIRED:
        first = " | ".join(log.strip().splitlines()[:4]) or "empty"
        raise CompileError(f"census: ptxas reported no {name.replace('_', ' ')} for {kernel} (its log: {first})")
    return 0  # no shared memory or barriers: ptxas leaves them out


_TF32_ROUND = re.compile(r"\bcvt\.rna?(?:\.satfinite)?\.tf32\.f32\b")
_MMA = re.compile(r"\bmma\.sync\.aligned\.(m\d+n\d+k\d+)\.row\.col\.f32\.(\w+)\.\w+\.f32\b")
_LDMATRIX = re.compile(r"\bldmatrix\.sync\.aligned\.m8n8\.(x[124])(\.trans)?\.")
_HALF_WIDEN = re.compile(r"\bcvt\.f32\.b?f16\b")
_BF16_PAIR_WIDEN = re.compile(r"// bf16x2 widened")  # half.j2's shl/and of a packed pair: two elements
_HALF_NARROW = re.compile(r"\bcvt\.rn\.b?f16x2\.f32\b")


# What the census counts of the Hopper vocabulary (templates/ptx.j2), as (key, pattern): a key may take the
# pattern's groups ('{0}'); an inline-asm block holds several instructions on one line, so each is found anywhere.
HOPPER_OPS = (
    ("wgmma {0}.{1}", re.compile(r"\bwgmma\.mma_async\.sync\.aligned\.(m64n\d+k\d+)\.f32\.(\w+)\.")),
    ("wgmma.fence", re.compile(r"\bwgmma\.fence\.sync\.aligned\b")),
    ("wgmma.commit_group", re.compile(r"\bwgmma\.commit_group\.sync\.aligned\b")),
    ("wgmma.wait_group {0}", re.compile(r"\bwgmma\.wait_group\.sync\.aligned\s+(\d+)")),
    ("mbarrier.init", re.compile(r"\bmbarrier\.init\.")),
    ("mbarrier.arrive.expect_tx", re.compile(r"\bmbarrier\.arrive\.expect_tx\.")),
    ("mbarrier.arrive", re.compile(r"\bmbarrier\.arrive\.shared::cta\.")),
    ("mbarrier.arrive.cluster", re.compile(r"\bmbarrier\.arrive(?:\.release\.cluster)?\.shared::cluster\.")),
    ("mbarrier.try_wait", re.compile(r"\bmbarrier\.try_wait\.")),
    ("mapa", re.compile(r"\bmapa\.")),
    ("tma load {0} multicast", re.compile(r"\bcp\.async\.bulk\.tensor\.\d+d\.shared::cluster\.global\S*\.multicast::cluster\S*\s.*tensor=(\w+)")),
    ("tma load {0}", re.compile(r"\bcp\.async\.bulk\.tensor\.\d+d\.shared::cluster\.global(?![^\s]*\.multicast)\S*\s.*tensor=(\w+)")),
    ("tma store {0}", re.compile(r"\bcp\.async\.bulk\.tensor\.\d+d\.global\.shared::cta\S*\s.*tensor=(\w+)")),
    ("bulk.commit_group", re.compile(r"\bcp\.async\.bulk\.commit_group\b")),
    ("bulk.wait_group", re.compile(r"\bcp\.async\.bulk\.wait_group\b")),
    ("fence.proxy.async", re.compile(r"\bfence\.proxy\.async\b")),
    ("fence.mbarrier_init", re.compile(r"\bfence\.mbarrier_init\b")),
    ("setmaxnreg.{0} {1}", re.compile(r"\bsetmaxnreg\.(inc|dec)\.sync\.aligned\.u32\s+(\d+)")),
    ("cluster barrier", re.compile(r"\bbarrier\.cluster\.arrive\b")),
    ("cluster rank", re.compile(r"%cluster_ctarank\b")),
    ("stmatrix {0}", re.compile(r"\bstmatrix\.sync\.aligned\.m8n8\.(x[124](?:\.trans)?)\.")),
    ("prefetch.tensormap", re.compile(r"\bprefetch\.tensormap\b")),
    ("trap", re.compile(r"\btrap;")),
    # ordering across blocks (a split-K reduction): atomics by their whole opcode ('atom.relaxed.gpu.global.add.u32'),
    # fences of ordinary memory by semantics and scope ('fence.acq_rel.gpu')
    ("atom{0}", re.compile(r"\batom(\.[\w.:]+)\s")),
    ("red{0}", re.compile(r"\bred(\.[\w.:]+)\s")),
    ("fence{0}", re.compile(r"\bfence(\.(?:sc|acq_rel)\.(?:cta|cluster|gpu|sys))\b")),
    ("membar.{0}", re.compile(r"\bmembar\.(cta|gl|sys)\b")),
)


# What orders ordinary shared-memory writes before the asynchronous proxy's reads of them, in program order: a
# write, the fence that publishes the writes before it, and a TMA store reading shared memory (tensor tagged)
_PROXY_EVENTS = re.compile(r"\b(?P<write>st\.shared\S*|stmatrix\S*|atom\.shared\S*|red\.shared\S*)\s"
                           r"|\b(?P<fence>fence\.proxy\.async)\b"
                           r"|\b(?P<store>cp\.async\.bulk\.tensor\.\d+d\.global\.shared::cta)\S*\s.*?tensor=(?P<tensor>\w+)")


class _ProxyOrder:
    """Follows the PTX's shared-memory writes, proxy fences and TMA stores in order (several may share an
    inline-asm line), counting the stores with a write since the last fence."""

    def __init__(self) -> None:
        self.written = False
        self.unfenced: Counter = Counter()

    def see(self, line: str) -> None:
        for event in _PROXY_EVENTS.finditer(line):
            if event["write"]:
                self.written = True
            elif event["fence"]:
                self.written = False
            elif self.written:
                self.unfenced[event["tensor"]] += 1


def _hopper_ops(line: str, counts: Counter) -> None:
    for key, pattern in HOPPER_OPS:
        for match in pattern.finditer(line):
            groups = tuple(g or "" for g in match.groups())
            counts[key.format(*groups) if groups else key] += 1


_TYPE_BYTES = {"8": 1, "16": 2, "32": 4, "64": 8}
_VECTOR = {"v2": 2, "v4": 4, "v8": 8}


def _access_bytes(parts: list[str], line: str) -> int:
    """Bytes one global ld/st, cp.async or bulk prefetch moves at its address."""
    if parts[0] == "cp":
        if "bulk" in parts:  # a bulk copy or prefetch wants 16-byte-aligned addresses
            return 16
        return int(line.rstrip(";").split(",")[2].strip().split()[0].rstrip(";"))
    size = next((_TYPE_BYTES[p[1:]] for p in reversed(parts) if p[:1] in "fbus" and p[1:] in _TYPE_BYTES), 4)
    return size * next((_VECTOR[p] for p in parts if p in _VECTOR), 1)


def aligned_contract(contract: dict, census: Census) -> dict:
    """The op's contract with each tensor's alignment raised to the widest access the kernel makes to it: a pointer
    the contract admits must be one no load or store of the kernel misaligns."""
    tensors = {name: {**t, "alignment_bytes": max(int(t["alignment_bytes"]), census.widest_access.get(name, 0))}
               for name, t in contract["tensors"].items()}
    return {**contract, "tensors": tensors}


def _width(parts: list[str]) -> str:
    return next((_WIDTHS[p] for p in parts if p in _WIDTHS), "scalar")


def _pass(tag: str) -> int:
    found = re.search(r"\.pass(\d+)", tag)
    return int(found.group(1)) if found else 1


def take_census(compiled: Compiled) -> Census:
    log = compiled.log
    loads: dict[str, Counter] = {}
    stores: dict[str, Counter] = {}
    passes: dict[str, set[int]] = {}
    counts: Counter = Counter()
    mma: Counter = Counter()
    ldmatrix: Counter = Counter()
    cp_async: Counter = Counter()
    waits: Counter = Counter()
    prefetches: Counter = Counter()
    hinted: Counter = Counter()
    policies: Counter = Counter()
    released: Counter = Counter()
    loads_hinted: Counter = Counter()
    hopper: Counter = Counter()
    widest: dict[str, int] = {}
    proxy_order = _ProxyOrder()
    for raw in compiled.ptx.splitlines():
        _hopper_ops(raw, hopper)
        if not raw.lstrip().startswith("//"):
            proxy_order.see(raw)
        # an inline-asm block holds several instructions on one line: conversions are counted wherever they are
        counts["half_widen"] += len(_HALF_WIDEN.findall(raw)) + 2 * len(_BF16_PAIR_WIDEN.findall(raw))
        counts["half_narrow"] += len(_HALF_NARROW.findall(raw))
        counts["tf32_round"] += len(_TF32_ROUND.findall(raw))
        for shape, kind in _MMA.findall(raw):
            mma[f"{shape}.{kind}"] += 1
        for count, trans in _LDMATRIX.findall(raw):
            ldmatrix[count + trans] += 1
        line = _GUARD.sub("", raw.strip())
        if not line or line.startswith("//") or line.startswith("."):
            continue
        opcode = line.split(None, 1)[0].rstrip(";")
        parts = opcode.split(".")
        tag_match = _TAG.search(line)
        tag = tag_match.group(1) if tag_match else "?"
        head = parts[0]
        tensor = tag.split(".")[0]
        if tag != "?" and head in ("ld", "st", "cp") and "global" in parts:  # cp: cp.async and the bulk copies
            widest[tensor] = max(widest.get(tensor, 0), _access_bytes(parts, line))
        if head in ("ld", "st") and "global" in parts:
            table = loads if head == "ld" else stores
            table.setdefault(tag, Counter())[_width(parts)] += 1
            if head == "ld":
                passes.setdefault(tag.split(".")[0], set()).add(_pass(tag))
                if "L2::cache_hint" in parts:
                    loads_hinted[tag] += 1
        elif head in ("ld", "st") and "shared" in parts:
            counts["shared_loads" if head == "ld" else "shared_stores"] += 1
        elif opcode.startswith("cp.async.bulk.prefetch.L2"):
            prefetches[tag.split(".")[0]] += 1
            if "L2::cache_hint" in parts:
                hinted[tag.split(".")[0]] += 1
        elif head == "applypriority":
            released[tag.split(".")[0]] += 1
        elif head == "createpolicy":
            policies[next((p.split("::")[1] for p in parts if p.startswith("L2::evict_")), "?")] += 1
        elif opcode.startswith("cp.async.commit_group"):
            counts["commit_groups"] += 1
        elif opcode.startswith("cp.async.wait_group"):
            waits[int(line.split()[1].rstrip(";"))] += 1
        elif opcode.startswith("cp.async.") and "shared" in parts:
            cp_async[int(line.rstrip(";").split(",")[2].strip().split()[0].rstrip(";"))] += 1
        elif opcode.startswith("bar.sync") or opcode.startswith("barrier.sync"):
            counts["bar_sync"] += 1
        elif opcode.startswith("shfl.sync"):
            counts["shfl_sync"] += 1
        elif opcode.startswith("rsqrt.approx"):
            counts["rsqrt_approx"] += 1
    return Census(
        **{name: _resource(log, name, pattern, compiled.kernel_name) for name, pattern in _RESOURCE_PATTERNS.items()},
        global_loads={k: dict(v) for k, v in sorted(loads.items())},
        global_stores={k: dict(v) for k, v in sorted(stores.items())},
        load_passes={k: sorted(v) for k, v in sorted(passes.items())},
        shared_loads=counts["shared_loads"], shared_stores=counts["shared_stores"],
        cp_async=dict(sorted(cp_async.items())), commit_groups=counts["commit_groups"],
        wait_groups=dict(sorted(waits.items())), bar_sync=counts["bar_sync"],
        shfl_sync=counts["shfl_sync"], rsqrt_approx=counts["rsqrt_approx"],
        half_widen=counts["half_widen"], half_narrow=counts["half_narrow"],
        mma=dict(sorted(mma.items())), ldmatrix=dict(sorted(ldmatrix.items())), tf32_round=counts["tf32_round"],
        l2_prefetch=dict(sorted(prefetches.items())), l2_prefetch_hinted=dict(sorted(hinted.items())),
        cache_policies=dict(sorted(policies.items())), l2_released=dict(sorted(released.items())),
        global_loads_hinted=dict(sorted(loads_hinted.items())),
        hopper=dict(sorted(hopper.items())),
        widest_access=dict(sorted(widest.items())),
        unfenced_async_reads=dict(sorted(proxy_order.unfenced.items())),
    )
