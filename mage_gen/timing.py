"""A timing result: how it was taken, how many samples, the median and the spread; and the figure a tuner ranks
by (hot, cold, or both at once)."""

from __future__ import annotations

from dataclasses import asdict, dataclass

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
