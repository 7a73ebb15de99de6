"""What a generated kernel must beat, measured the way the kernel is: torch and a Triton kernel written
here (the `peers` extra). Each peer is gated against the same float64 reference before it is timed.
Without torch there are simply no peers."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from mage_gen.measure import FLUSH_BYTES, HOT_LAUNCHES_PER_GRAPH, interleave, relative_error
from mage_gen.ops import Op

try:
    import torch
except ImportError:  # the core and the CPU tests never need it
    torch = None
try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None

TRITON_WARPS = (2, 4, 8, 16)

if triton is not None:

    @triton.jit
    def _triton_layernorm(X, Y, W, B, N, eps, BLOCK: tl.constexpr):
        # One program per row, the whole row in one block: the usual Triton layer norm.
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        mask = cols < N
        x = tl.load(X + row * N + cols, mask=mask, other=0.0)
        mean = tl.sum(x, axis=0) / N
        diff = tl.where(mask, x - mean, 0.0)
        rstd = 1.0 / tl.sqrt(tl.sum(diff * diff, axis=0) / N + eps)
        w = tl.load(W + cols, mask=mask)
        b = tl.load(B + cols, mask=mask)
        tl.store(Y + row * N + cols, diff * rstd * w + b, mask=mask)


class TorchSubject:
    """A callable that enqueues work on torch's current stream, timed like a generated kernel."""

    def __init__(self, name: str, run: Callable[[], Any], config: dict[str, Any] | None = None):
        self.name, self.run, self.config = name, run, config or {}
        self._graph = None
        self._begin = torch.cuda.Event(enable_timing=True)
        self._end = torch.cuda.Event(enable_timing=True)

    def hot(self, replays: int) -> list[float]:
        if self._graph is None:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # warm-up off the default stream, as graph capture requires
                for _ in range(3):
                    self.run()
            torch.cuda.current_stream().wait_stream(side)
            self._graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self._graph):
                for _ in range(HOT_LAUNCHES_PER_GRAPH):
                    self.run()
            self._graph.replay()
        samples = []
        for _ in range(replays):
            self._begin.record()
            self._graph.replay()
            self._end.record()
            self._end.synchronize()
            samples.append(self._begin.elapsed_time(self._end) * 1000.0 / HOT_LAUNCHES_PER_GRAPH)
        return samples

    def cold(self, count: int) -> list[float]:
        flush = _torch_flush_buffer()
        samples = []
        for _ in range(count):
            flush.zero_()
            self._begin.record()
            self.run()
            self._end.record()
            self._end.synchronize()
            samples.append(self._begin.elapsed_time(self._end) * 1000.0)
        return samples

    def close(self) -> None:
        self._graph = None


_FLUSH: list = []


def _torch_flush_buffer():
    if not _FLUSH:
        _FLUSH.append(torch.empty(FLUSH_BYTES // 4, dtype=torch.int32, device="cuda"))
    return _FLUSH[0]


def _layernorm_candidates(shape: Any, inputs: dict[str, np.ndarray], eps: float) -> dict[str, list[TorchSubject]]:
    x, w, b = (torch.from_numpy(inputs[k]).cuda() for k in ("x", "w", "b"))
    m, d = x.shape
    candidates = {"torch": [TorchSubject(
        "torch", lambda: torch.nn.functional.layer_norm(x, (d,), w, b, eps), {"fn": "F.layer_norm"})]}
    if triton is not None:
        y = torch.empty_like(x)
        block = triton.next_power_of_2(d)

        def triton_run(warps: int) -> Callable[[], Any]:
            def go():
                _triton_layernorm[(m,)](x, y, w, b, d, eps, BLOCK=block, num_warps=warps)
                return y
            return go

        candidates["triton"] = [TorchSubject(f"triton/w{warps}", triton_run(warps),
                                             {"num_warps": warps, "BLOCK": block}) for warps in TRITON_WARPS]
    return candidates


_CANDIDATES = {"layernorm": _layernorm_candidates}


def make_peers(op: Op, shape: Any, run: dict[str, int], inputs: dict[str, np.ndarray],
               reference: dict[str, np.ndarray], pick_replays: int = 10) -> tuple[list[TorchSubject], dict[str, str]]:
    """The op's peers, each gated on `inputs`; of a family with configs (Triton's num_warps) the fastest
    hot. Returns (peers, {name: why it is missing})."""
    if torch is None or not torch.cuda.is_available():
        return [], {"torch": "torch with CUDA is not installed here (pip install 'mage-gen[peers]')"}
    if op.name not in _CANDIDATES:
        return [], {"peers": f"no peers are written for {op.name}"}
    missing: dict[str, str] = {} if triton is not None else {"triton": "triton is not installed"}
    scalars = op.scalars(shape, run)
    chosen = []
    for family, subjects in _CANDIDATES[op.name](shape, inputs, float(scalars.get("eps", 0.0))).items():
        passing = []
        for subject in subjects:
            out = subject.run()
            torch.cuda.synchronize()
            got = out.detach().cpu().numpy()
            ref = next(iter(reference.values()))
            err = relative_error(got, ref) if not np.isnan(got).any() else float("inf")
            if err <= op.tolerance:
                subject.config["gate_error"] = err
                passing.append(subject)
            else:
                missing[subject.name] = f"failed the gate: relative error {err:.3g}"
        if not passing:
            continue
        if len(passing) > 1:
            timings = interleave(passing, "hot", rounds=2, per_round=pick_replays // 2 or 1)
            best = min(passing, key=lambda s: timings[s.name].median_us)
            best.config["picked_from"] = {s.name: round(timings[s.name].median_us, 3) for s in passing}
        else:
            best = passing[0]
        best.name = family
        chosen.append(best)
    return chosen, missing
