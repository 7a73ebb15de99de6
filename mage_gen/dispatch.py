"""Which tuned entry serves a launch. An op whose kernels take a size at launch (layer norm's M) is tuned
at one or more run sizes, and tuned/ keeps one entry per size class: the run size it was tuned at. A
launch of any size takes the class that RULE picks. An op whose sizes are all fixed at generation
(matmul) has one entry per shape. Where it declares some of them class dims (gemm_sm90: M), its entries are
size classes over those: a shape with no entry of its own runs the params of the entry CLASS_RULE picks,
compiled for its own sizes. The command line's nearest-shape hint (nearest_shape) is only a suggestion.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from mage_gen.errors import ConfigError
from mage_gen.ops import Op
from mage_gen.ops.base import shape_dict
from mage_gen.timing import Timing, by_objective

RULE = ("the entries on the launch's side of the L2 size first (the bytes a launch must move at most the "
        "GPU's L2: L2-resident; more: DRAM-bound), of those the one tuned at the nearest run size on a log "
        "scale (the larger on a tie); where no entry is on the launch's side, the nearest of all")
CLASS_RULE = ("of the entries equal to the launch's shape in every field but the class dims (gemm_sm90: the same "
              "N, K, precision, C type and B layout), whose params are valid for its sizes, the one tuned at the "
              "nearest class sizes on a log scale (the larger on a tie); where none is, the same among the entries "
              "that also differ in the op's epilogue fields (gemm_sm90: gate, bias, residual: they change what the "
              "kernel does with its sums, not its main loop); none: the shape is untuned")
PEER_RULE = ("mage_gen.torch.linear asked with cublas_where_faster=True (as a patched model's nn.Linear asks) calls "
             "F.linear (cuBLAS) instead of the kernel for a bf16 product whose serving entry was timed slower than "
             "cuBLAS in its tune's final round, by the tune's objective (hot, cold, or the geometric mean of both): "
             "by the median of the rounds' ratios where the entry keeps them, else by the pooled medians; and for one "
             "whose serving entry was tuned at a class size more than PEER_REACH times the launch's or less than "
             "1/PEER_REACH of it, where its tune's verdict says nothing of the launch")
# How far (a factor of each class size) a size class's timing against cuBLAS speaks for a launch it serves: the
# H200's classes at 16, 128, 512, 2048 and 8192 tokens each speak for every M between them.
PEER_REACH = 4
SEED_RULE = ("a size class's search measures first its stored winner (with none, the winner of the class that "
             "serves its shape by CLASS_RULE), then its winners on other GPUs, then the winners of the tuned shapes "
             "nearest to it on a log scale over every size, whatever their types and epilogue (at one distance, those "
             "that differ from it in the fewest of those fields first), each whose params are valid for it and lie "
             "in the preset")
# --m auto: the L2-resident size fills at most this share of the L2, the DRAM-bound one at least this many L2s,
# so that neither sits near the boundary where hot and cold timings blur.
AUTO_L2_SHARE = 0.5
AUTO_DRAM_L2S = 4


@dataclass(frozen=True)
class SizeClass:
    key: str  # the tuned/ entry
    run: dict[str, int]  # the run size it was tuned at


def regime(op: Op, shape: Any, run: dict[str, int], l2_bytes: int) -> str:
    return "l2" if op.bytes_moved(shape, run) <= l2_bytes else "dram"


def record(op: Op, shape: Any, run: dict[str, int], l2_bytes: int) -> dict[str, Any] | None:
    """What a tuned/ entry records of its size class: the run size, its regime and the rule; None for an op
    with no run size."""
    if not op.run_dims:
        return None
    return {**run, "regime": regime(op, shape, run, l2_bytes), "bytes_moved": op.bytes_moved(shape, run),
            "l2_bytes": l2_bytes, "rule": RULE}


def _distance(a: dict[str, int], b: dict[str, int]) -> float:
    return sum(abs(math.log(a[k] / b[k])) for k in a)


def _sizes(dims: dict[str, Any]) -> dict[str, int]:
    return {k: v for k, v in dims.items() if isinstance(v, int) and not isinstance(v, bool)}


def _kinds(dims: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in dims.items() if k not in _sizes(dims)}


def choose(op: Op, shape: Any, run: dict[str, int], classes: Sequence[SizeClass], l2_bytes: int) -> SizeClass:
    """The class RULE picks for a launch of `run`."""
    if not classes:
        raise ValueError("choose() needs at least one size class")
    side = regime(op, shape, run, l2_bytes)
    same_side = [c for c in classes if regime(op, shape, c.run, l2_bytes) == side]
    pool = same_side or list(classes)
    return min(pool, key=lambda c: (_distance(run, c.run), [-c.run[k] for k in sorted(c.run)]))


def auto_runs(op: Op, shape: Any, l2_bytes: int) -> list[dict[str, int]]:
    """--m auto: the largest power-of-two M whose bytes fill at most AUTO_L2_SHARE of the L2, and the smallest
    whose bytes are at least AUTO_DRAM_L2S times the L2."""
    if op.run_dims != ("m",):
        raise ConfigError(f"m-auto: {op.name} takes no run size at launch; give its sizes")
    small = 1
    while op.bytes_moved(shape, {"m": small * 2}) <= AUTO_L2_SHARE * l2_bytes:
        small *= 2
    large = small
    while op.bytes_moved(shape, {"m": large}) < AUTO_DRAM_L2S * l2_bytes:
        large *= 2
    runs = [{"m": small}, {"m": large}]
    for run in runs:
        op.check_run(run)
    return runs


def cublas_serves(op: Op, shape: Any, entry: dict[str, Any] | None) -> bool:
    """Whether a bf16 launch of `shape` that `entry` serves calls cuBLAS when asked to where it is faster
    (PEER_RULE); no entry: no."""
    if entry is None:
        return False
    for name in op.class_dims:
        launch, tuned = vars(shape)[name], entry.get("shape", {}).get(name)
        if not tuned or max(launch, tuned) > PEER_REACH * min(launch, tuned):
            return True
    return peer_faster(entry)


def peer_faster(entry: dict[str, Any], peer: str = "cublas") -> bool:
    """Whether `peer` ran faster than the entry's winner in the tune's final round, by the tune's objective
    (PEER_RULE); an entry without both timings says no."""
    try:
        objective = entry["objective"]
        paired = entry["peers"][peer].get("winner_over_peer")
        if paired:  # the winner's time over the peer's, round by round
            hot, cold = paired["hot"]["median"], paired["cold"]["median"]
            return (hot if objective == "hot" else cold if objective == "cold" else (hot * cold) ** 0.5) > 1
        ours, theirs = (by_objective(Timing.from_dict(t["hot"]), Timing.from_dict(t["cold"]), objective)
                        for t in (entry["timings"], entry["peers"][peer]))
    except (KeyError, TypeError, ValueError, AttributeError):
        return False
    return theirs.median_us < ours.median_us


def choose_class(op: Op, shape: Any, tuned: dict[Any, Any]) -> tuple[Any, Any] | None:
    """(tuned shape, its params) that CLASS_RULE picks to serve `shape`, or None; `tuned` maps each tuned shape
    to its params."""
    if not op.class_dims:
        return None
    mine = vars(shape)  # every field, defaults too (shape_dict leaves them out)
    sizes = {name: mine[name] for name in op.class_dims}

    def rank(other: Any) -> tuple:
        at = {name: vars(other)[name] for name in sizes}
        return _distance(sizes, at), [-at[name] for name in op.class_dims]  # the larger on a tie

    for free in ((), op.epilogue_fields):
        served = _nearest(op, shape, tuned, lambda other: all(vars(other)[k] == v for k, v in mine.items()
                                                               if k not in sizes and k not in free), rank)
        if served is not None:
            return served
    return None


def neighbours(op: Op, shape: Any, tuned: dict[Any, Any], count: int) -> list[tuple[Any, Any]]:
    """Up to `count` (tuned shape, its params) by SEED_RULE, nearest first, no params twice."""
    mine = vars(shape)
    sizes = _sizes(mine)

    def rank(other: Any) -> tuple:
        theirs = vars(other)
        return (_distance(sizes, _sizes(theirs)), sum(theirs[k] != v for k, v in mine.items() if k not in sizes),
                sorted(shape_dict(other).items()))

    picked: list[tuple[Any, Any]] = []
    for other, params in _ranked(op, shape, tuned, lambda other: True, rank):
        if len(picked) < count and params not in (p for _, p in picked):
            picked.append((other, params))
    return picked


def nearest_shape(op: Op, shape: Any, tuned: dict[Any, Any]) -> tuple[Any, Any] | None:
    """(tuned shape, its params) nearest to `shape` on a log scale among those whose params are valid for
    `shape`, or None. `tuned` maps each tuned shape to its params."""
    mine = shape_dict(shape)

    def rank(other: Any) -> tuple:
        theirs = shape_dict(other)
        return _distance(_sizes(mine), _sizes(theirs)), sorted(theirs.items())

    # another dtype or form is another function, not a nearby size
    return _nearest(op, shape, tuned, lambda other: _kinds(shape_dict(other)) == _kinds(mine), rank)


def _nearest(op: Op, shape: Any, tuned: dict[Any, Any], comparable: Any, rank: Any) -> tuple[Any, Any] | None:
    """(tuned shape, its params) of the least rank among the tuned shapes comparable to `shape` whose params are
    valid for it, or None."""
    return next(iter(_ranked(op, shape, tuned, comparable, rank)), None)


def _ranked(op: Op, shape: Any, tuned: dict[Any, Any], comparable: Any, rank: Any) -> list[tuple[Any, Any]]:
    """(tuned shape, its params) of the tuned shapes comparable to `shape` whose params are valid for it, least
    rank first."""
    usable = []
    for other, params in tuned.items():
        if not comparable(other):
            continue
        try:
            op.validate(shape, params)
        except ConfigError:
            continue
        usable.append((rank(other), other, params))
    return [(other, params) for _, other, params in sorted(usable, key=lambda u: u[0])]
