"""The gate's verdict on outputs, wherever they were computed (the GPU, the CPU interpreter, a peer's tensors):
relative error against the float64 reference, NaN never passing. Below both measure (which talks to the GPU) and
the interpreter (which must not)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from mage_gen.dtypes import of_storage
from mage_gen.ops import Op


@dataclass(frozen=True)
class GateResult:
    passed: bool
    reason: str  # why it failed; empty when it passed
    worst_error: float  # largest relative error over the runs (inf where a run failed outright)
    errors: dict[str, float] = field(default_factory=dict)  # gate run ('m=37') -> relative error
    fault: bool = False  # a CUDA error, not a wrong answer: the context may be unusable after it
    host_s: float = 0.0  # of the gate's time, the host's: fresh inputs, their float64 reference, the comparison

    def to_dict(self) -> dict:
        return {"passed": self.passed, "reason": self.reason, "worst_error": self.worst_error,
                "errors": dict(self.errors)}


def relative_error(out: np.ndarray, ref: np.ndarray) -> float:
    """‖out − ref‖ / ‖ref‖, out in any element type's storage (dtypes: uint16 holds bf16)."""
    denom = float(np.linalg.norm(ref))
    diff = float(np.linalg.norm(widen(out).astype(np.float64) - ref))
    return diff / denom if denom else diff


def widen(out: np.ndarray) -> np.ndarray:
    return of_storage(out.dtype).widen(out)


def compare_outputs(op: Op, shape: Any, outputs: dict[str, np.ndarray],
                    reference: dict[str, np.ndarray]) -> tuple[float, str]:
    """The gate's verdict on outputs, wherever they were computed: (relative error, reason it failed or '');
    any NaN fails."""
    worst = 0.0
    for name, ref in reference.items():
        out = outputs[name]
        if (nans := np.argwhere(np.isnan(widen(out)))).size:
            return float("inf"), (f"{name} has {len(nans)} NaN (first at {tuple(int(i) for i in nans[0])}): "
                                  "unwritten or computed NaN")
        err = relative_error(out, ref)
        worst = max(worst, err)
        tolerance = op.tolerance_of(shape, name, of_storage(out.dtype))
        if not err <= tolerance:
            return err, f"{name} relative error {err:.3g} > tolerance {tolerance:g}"
    return worst, ""
