"""A timing result: how it was taken, how many samples, the median and the spread."""

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
