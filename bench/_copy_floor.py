"""The copy of the same bytes: the floor a memory-bound kernel is measured against (the norm benches).

One copy kernel is a weak floor (a Triton copy of 4096 floats per program ran ~5% under what torch's copy reaches on
large sizes), so the floor is the fastest of several: Triton copies over block size and num_warps, and torch's `copy_`
(inside a CUDA graph, a memcpy node). A short interleaved pass picks the fastest hot and the fastest cold; those run
in the bench's rounds beside the kernels, and each method's floor is the faster of them there. Given the kernel's own
inputs (`sources`), the copies of those very buffers are candidates too: the same bytes can read a few percent faster
or slower from one allocation than from another (NOTES.md, norms §10), so the floor must be free to read what the
kernel reads."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mage_gen.measure import interleave
from mage_gen.peers import TorchSubject
from mage_gen.timing import Timing

FLOOR = "floor:copy"
_BLOCKS = (2048, 4096, 8192, 16384)  # floats per program
_WARPS = (4, 8, 16)
_PICK_ROUNDS, _PICK_PER_ROUND = 2, 3


@triton.jit
def _copy(src, dst, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(dst + offsets, tl.load(src + offsets, mask=offsets < n), mask=offsets < n)


@triton.jit
def _copy_two(src_a, dst_a, src_b, dst_b, n, BLOCK: tl.constexpr):
    # two buffers of n floats in one launch, as a residual-form kernel reads x and the residual in one
    pid = tl.program_id(0)
    first = tl.cdiv(n, BLOCK)
    if pid < first:
        offsets = pid * BLOCK + tl.arange(0, BLOCK)
        tl.store(dst_a + offsets, tl.load(src_a + offsets, mask=offsets < n), mask=offsets < n)
    else:
        offsets = (pid - first) * BLOCK + tl.arange(0, BLOCK)
        tl.store(dst_b + offsets, tl.load(src_b + offsets, mask=offsets < n), mask=offsets < n)


def _triton_copies(label: str, what: str, sources: list, targets: list) -> list[TorchSubject]:
    n = sources[0].numel()

    def go(block: int, warps: int):
        if len(sources) == 1:
            return lambda: _copy[(triton.cdiv(n, block),)](sources[0], targets[0], n, BLOCK=block, num_warps=warps)
        return lambda: _copy_two[(2 * triton.cdiv(n, block),)](sources[0], targets[0], sources[1], targets[1], n,
                                                               BLOCK=block, num_warps=warps)

    return [TorchSubject(f"{FLOOR}/{label}triton_b{block}_w{warps}", go(block, warps),
                         {"fn": f"Triton copy of {what}, {block} float32 per program, {warps} warps"})
            for block in _BLOCKS for warps in _WARPS]


def _candidates(nbytes: int, sources: tuple = ()) -> list[TorchSubject]:
    src = torch.zeros(nbytes // 8, dtype=torch.float32, device="cuda")  # reads nbytes / 2, writes as many
    dst = torch.empty_like(src)
    n = src.numel()
    subjects = _triton_copies("", f"{n} float32", [src], [dst])
    subjects.append(TorchSubject(f"{FLOOR}/torch_copy_", lambda: dst.copy_(src),
                                 {"fn": f"torch dst.copy_(src) of {n} float32 (a memcpy node in a CUDA graph)"}))
    if sources:
        # the kernel's inputs as floats (a 16-bit row has an even number of elements), copied into fresh buffers
        flat = [s.reshape(-1).view(torch.float32) for s in sources]
        into = [torch.empty_like(f) for f in flat]
        what = f"the kernel's own {' and '.join(f'{tuple(s.shape)} {s.dtype}' for s in sources)}"
        subjects += _triton_copies("inputs_", what, flat, into)
        if len(flat) == 1:
            subjects.append(TorchSubject(f"{FLOOR}/inputs_torch_copy_", lambda: into[0].copy_(flat[0]),
                                         {"fn": f"torch copy_ of {what} (a memcpy node in a CUDA graph)"}))
    return subjects


def picked_copies(nbytes: int, sources: tuple = ()) -> dict[str, TorchSubject]:
    """{"hot": the fastest hot, "cold": the fastest cold} (one subject where one copy is both) of the copies of
    nbytes (half read, half written) and of the given source tensors (the kernel's own activations, read where
    the kernel reads them); the others closed."""
    subjects = _candidates(nbytes, sources)
    picked = {}
    for method in ("hot", "cold"):
        timings = interleave(subjects, method, _PICK_ROUNDS, _PICK_PER_ROUND)
        best = min(subjects, key=lambda s: timings[s.name].median_us)
        best.config.setdefault("picked_from", {})[method] = {s.name.removeprefix(FLOOR + "/"): round(timings[s.name].median_us, 3)
                                                              for s in subjects}
        picked[method] = best
    for s in subjects:
        if s not in picked.values():
            s.close()
    return picked


def copy_subjects(nbytes: int, sources: tuple = ()) -> list[TorchSubject]:
    """The fastest hot and the fastest cold of the copies (picked_copies), to be timed in the bench's own rounds;
    settle then takes the faster of them per method."""
    picked = picked_copies(nbytes, sources)
    return [picked["hot"]] + ([picked["cold"]] if picked["cold"] is not picked["hot"] else [])


def settle(copies: list[TorchSubject], *tables: dict[str, Timing]) -> dict[str, str]:
    """After the rounds: the copies closed, and each method's table given its floor (FLOOR), the fastest copy
    in it; returns which copy that was, per method."""
    for copy in copies:
        copy.close()
    fastest = {}
    for table in tables:
        name = min((n for n in table if n.startswith(FLOOR + "/")), key=lambda n: table[n].median_us)
        table[FLOOR] = table[name]
        fastest[table[name].method] = name
    return fastest


CANDIDATES = (f"Triton copy kernels over {len(_BLOCKS)} block sizes × num_warps {'/'.join(map(str, _WARPS))} and "
              "torch's copy_ (a memcpy node in a graph), of a buffer of their own and of the kernel's own "
              "activations (x, and the residual in one launch with it), read where the kernel reads them")
METHOD = (f"the fastest of the copies of the same bytes (half read, half written): {CANDIDATES}; a pass of "
          f"{_PICK_ROUNDS}×{_PICK_PER_ROUND} picks the fastest hot and cold, which are then timed interleaved with "
          "the kernels; each method's floor is the faster of them there")
PICK = f"a pass of {_PICK_ROUNDS}×{_PICK_PER_ROUND} samples per method"
