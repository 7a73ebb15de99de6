"""A timing result: how it was taken, how many samples, the median and the spread; two subjects compared round by
round; and the figure a tuner ranks by (hot, cold, or both at once)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from math import comb

import numpy as np


@dataclass(frozen=True)
class Timing:
    method: str  # 'hot': launches replayed from a CUDA graph, inputs L2-warm; 'cold': L2 flushed before each
    samples: int
    median_us: float  # per launch
    spread_us: float  # interquartile range of the samples
    min_us: float

    @classmethod
    def from_samples(cls, method: str, samples_us: list[float]) -> Timing:
        values = np.asarray(samples_us, dtype=np.float64)
        q25, q50, q75 = np.percentile(values, [25, 50, 75])
        return cls(method=method, samples=len(values), median_us=float(q50), spread_us=float(q75 - q25),
                   min_us=float(values.min()))

    def ties_with(self, other: Timing) -> bool:
        """Two medians closer than the larger spread cannot be told apart."""
        return abs(self.median_us - other.median_us) <= max(self.spread_us, other.spread_us)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, values: dict) -> Timing:
        return cls(**values)


# the least coverage a RoundRatio's interval is widened to, where the rounds allow it
ROUND_RATIO_COVERAGE = 0.95


@dataclass(frozen=True)
class RoundRatio:
    """One subject's time over another's, taken round by round: the rounds interleave the two, so a round's ratio
    (of the two medians in it) is free of the drift and placement the round shares. The median of the rounds'
    ratios and a distribution-free interval for it: the k-th smallest to the k-th largest ratio, k as large as
    keeps the interval's coverage of the median at least ROUND_RATIO_COVERAGE (binomial, the rounds taken as
    independent draws). An interval that holds 1 means these rounds cannot tell the two apart."""

    rounds: int
    median: float
    low: float
    high: float
    coverage: float

    @property
    def verdict(self) -> str:
        return "slower" if self.low > 1.0 else "faster" if self.high < 1.0 else "tie"

    def to_dict(self) -> dict:
        return {**asdict(self), "verdict": self.verdict}


def median_interval(values: Sequence[float]) -> tuple[float, float, float]:
    """(low, high, coverage): order statistics bracketing the median of the values' distribution."""
    ordered = sorted(values)
    n = len(ordered)
    if n == 0:
        raise ValueError("median_interval: no values")

    def coverage(k: int) -> float:  # of [k-th smallest, k-th largest]: 1 - 2 P(Binomial(n, 1/2) < k)
        return 1.0 - 2.0 * sum(comb(n, i) for i in range(k)) / 2.0 ** n

    k = 1
    while k + 1 <= (n + 1) // 2 and coverage(k + 1) >= ROUND_RATIO_COVERAGE:
        k += 1
    return ordered[k - 1], ordered[n - k], coverage(k)


def round_ratio(mine: Sequence[Sequence[float]], theirs: Sequence[Sequence[float]]) -> RoundRatio:
    """mine[r] and theirs[r]: the two subjects' samples of round r."""
    if len(mine) != len(theirs) or not mine:
        raise ValueError(f"round_ratio: both subjects' samples of the same rounds, at least one (got {len(mine)} "
                         f"and {len(theirs)} rounds)")
    ratios = [float(np.median(a) / np.median(b)) for a, b in zip(mine, theirs)]
    low, high, coverage = median_interval(ratios)
    return RoundRatio(rounds=len(ratios), median=float(np.median(ratios)), low=low, high=high, coverage=coverage)


OBJECTIVES = ("hot", "cold", "both")


def both(hot: Timing, cold: Timing) -> Timing:
    """Hot and cold as one figure, the geometric mean of their medians: a percent gained on either counts the same,
    whatever their sizes. Its spread is the two relative spreads averaged (the first-order spread of the mean when
    the two move together, the case that makes it widest). The tuner calls two kernels tied on `both` only where
    each method alone ties them (tune._finish)."""
    median = float(np.sqrt(hot.median_us * cold.median_us))
    relative = (hot.spread_us / hot.median_us + cold.spread_us / cold.median_us) / 2
    return Timing(method="both", samples=min(hot.samples, cold.samples), median_us=median,
                  spread_us=median * relative, min_us=float(np.sqrt(hot.min_us * cold.min_us)))


def by_objective(hot: Timing, cold: Timing, objective: str) -> Timing:
    """The timing a tune with this objective ranks by."""
    if objective not in OBJECTIVES:
        raise ValueError(f"objective: one of {', '.join(OBJECTIVES)}, got {objective!r}")
    return hot if objective == "hot" else cold if objective == "cold" else both(hot, cold)
