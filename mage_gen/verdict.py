"""The gate's verdict on outputs, wherever they were computed (the GPU, the CPU interpreter, a peer's tensors):
relative error against the float64 reference, NaN never passing. Below both measure (which talks to the GPU) and
the interpreter (which must not)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from mage_gen.dtypes import of_storage
from mage_gen.ops import Op
from mage_gen.ops.base import on_every_core, row_blocks


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
    return _compared(out, ref).error


@dataclass(frozen=True)
class _Compared:
    diff2: float  # ‖out − ref‖²
    ref2: float  # ‖ref‖²
    nans: int
    first_nan: tuple[int, ...] | None  # out's index of its first NaN

    @property
    def error(self) -> float:
        return float(np.sqrt(self.diff2 / self.ref2 if self.ref2 else self.diff2))


def _compared(out: np.ndarray, ref: np.ndarray) -> _Compared:
    """out against ref in blocks of rows on every core, their sums taken in a fixed order (on one core, half a second
    of a trial at a GEMM's C of 10⁸ elements)."""
    rows = out.shape[0] if out.ndim else 1
    held = out.reshape(rows, -1)
    wanted = ref.reshape(rows, -1) if ref.size == out.size else None  # a NaN is news even beside the wrong size
    cols = held.shape[1]

    def block(at: slice) -> tuple[float, float, int, int]:
        values = widen(held[at]).astype(np.float64).ravel()
        nan = np.isnan(values)
        first = int(np.argmax(nan)) + at.start * cols if nan.any() else -1
        if wanted is None:
            return 0.0, 0.0, int(nan.sum()), first
        diff, exact = values - wanted[at].ravel(), wanted[at].ravel()
        return float(diff @ diff), float(exact @ exact), int(nan.sum()), first

    sums = on_every_core(block, row_blocks(rows, cols))
    first = next((s[3] for s in sums if s[3] >= 0), -1)
    if wanted is None and first < 0:
        raise ValueError(f"an output of {out.size} elements against a reference of {ref.size}")
    return _Compared(sum(s[0] for s in sums), sum(s[1] for s in sums), sum(s[2] for s in sums),
                     tuple(int(i) for i in np.unravel_index(first, out.shape)) if first >= 0 else None)


def widen(out: np.ndarray) -> np.ndarray:
    return of_storage(out.dtype).widen(out)


def compare_outputs(op: Op, shape: Any, outputs: dict[str, np.ndarray],
                    reference: dict[str, np.ndarray]) -> tuple[float, str]:
    """The gate's verdict on outputs, wherever they were computed: (relative error, reason it failed or '');
    any NaN fails."""
    worst = 0.0
    for name, ref in reference.items():
        out = outputs[name]
        compared = _compared(out, ref)
        if compared.nans:
            return float("inf"), (f"{name} has {compared.nans} NaN (first at {compared.first_nan}): "
                                  "unwritten or computed NaN")
        err = compared.error
        worst = max(worst, err)
        tolerance = op.tolerance_of(shape, name, of_storage(out.dtype))
        if not err <= tolerance:
            return err, f"{name} relative error {err:.3g} > tolerance {tolerance:g}"
    return worst, ""
