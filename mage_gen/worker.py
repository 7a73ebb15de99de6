"""Trials in a worker process that the tuner can lose. A variant that writes out of bounds leaves the
CUDA context unusable, and one that never finishes never returns: either would take the study down in
process. Here the backend runs in a spawned child (a fresh CUDA context, never a forked one); a crash,
a CUDA error or no answer in time fails that trial with the reason, and the child is started again.
"""

from __future__ import annotations

import multiprocessing as mp
import statistics
import time
import traceback
from pathlib import Path
from collections.abc import Callable, Sequence
from typing import Any

from mage_gen.errors import GpuError, MageError, NoGpuError
from mage_gen.measure import Evaluation
from mage_gen.verdict import GateResult

MIN_TIMEOUT_S = 2.0
FIRST_TIMEOUT_S = 120.0  # nothing measured yet: module load, the first references, peers' compiles
TIMEOUT_FACTOR = 10.0  # a trial may take this many times the median trial so far


def _serve(factory: Callable[[], Any], conn: Any) -> None:
    """The child: build the backend, then answer (method, args) requests until the pipe closes."""
    try:
        backend = factory()
        conn.send(("ready", (backend.device, backend.arch)))
    except NoGpuError as exc:
        conn.send(("no_gpu", str(exc)))
        return
    except BaseException as exc:  # noqa: BLE001 - whatever it was, the parent must hear of it
        conn.send(("failed", f"{type(exc).__name__}: {exc}"))
        return
    while True:
        try:
            method, args = conn.recv()
        except EOFError:
            return
        # the final round's steps are told as they end, so that the parent's wait is for one step at a time
        told = {"progress": lambda done, total: conn.send(("progress", (done, total)))} if method == "final" else {}
        try:
            conn.send(("ok", getattr(backend, method)(*args, **told)))
        except GpuError as exc:
            # The context may be unusable after this: answer, then let the parent start a new child.
            conn.send(("gpu_error", str(exc)))
            return
        except BaseException as exc:  # noqa: BLE001
            conn.send(("error", _one_line(exc)))


def _one_line(exc: BaseException) -> str:
    """The exception and the innermost frames it came through, on one line: the parent reports it as one."""
    what = " ".join("".join(traceback.format_exception_only(type(exc), exc)).split())
    frames = traceback.extract_tb(exc.__traceback__)[-4:]
    where = " ← ".join(f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in reversed(frames))
    return f"{what} (at {where})" if where else what


class IsolatedBackend:
    """A Backend whose evaluate() and final() run in a child process built by `factory` (picklable)."""

    def __init__(self, factory: Callable[[], Any], min_timeout_s: float = MIN_TIMEOUT_S,
                 first_timeout_s: float = FIRST_TIMEOUT_S):
        self._factory = factory
        self._context = mp.get_context("spawn")
        self._min_timeout_s, self._first_timeout_s = min_timeout_s, first_timeout_s
        self._durations: list[float] = []
        self.restarts = 0
        self._process: Any = None
        self._conn: Any = None
        self.device, self.arch = self._start()

    def _start(self) -> tuple[dict[str, Any], str]:
        parent, child = self._context.Pipe()
        self._process = self._context.Process(target=_serve, args=(self._factory, child), daemon=True)
        self._process.start()
        child.close()
        self._conn = parent
        if not parent.poll(self._first_timeout_s):
            self._stop()
            raise MageError(f"worker: the measuring process did not start in {self._first_timeout_s:.0f} s")
        try:
            kind, payload = parent.recv()
        except EOFError:
            self._stop()
            raise MageError("worker: the measuring process died while starting") from None
        if kind != "ready":
            self._stop()
            if kind == "no_gpu":
                raise NoGpuError(payload)
            raise MageError(f"worker: the measuring process could not start: {payload}")
        return payload

    def _stop(self) -> None:
        if self._process is not None and self._process.is_alive():
            self._process.kill()
        if self._process is not None:
            self._process.join(5)
        self._process = None

    def _restart(self) -> None:
        self._stop()
        self.restarts += 1
        self._start()

    def timeout_s(self) -> float:
        if not self._durations:
            return self._first_timeout_s
        return max(self._min_timeout_s, TIMEOUT_FACTOR * statistics.median(self._durations))

    def _call(self, method: str, args: tuple, timeout_s: float,
              progress: Callable[[int, int], None] | None = None) -> tuple[str, Any]:
        """('ok', result) or (failure kind, reason); after a failure the child is a new one. The child's progress
        messages go to `progress`, each starting the timeout again."""
        started = time.monotonic()
        try:
            self._conn.send((method, args))
            kind = "progress"
            while kind == "progress":
                answered = self._conn.poll(timeout_s)
                kind, payload = self._conn.recv() if answered else ("timeout", None)
                if kind == "progress" and progress:
                    progress(*payload)
        except (EOFError, BrokenPipeError, ConnectionResetError):
            kind, payload = "died", None
        if kind == "ok":
            self._durations.append(time.monotonic() - started)
            return kind, payload
        if kind == "timeout":
            payload = f"no answer in {timeout_s:.1f} s (a kernel that never finishes?)"
        elif kind == "died":
            self._process.join(5)
            payload = f"the measuring process died (exit code {self._process.exitcode})"
        elif kind == "gpu_error":
            payload = f"CUDA error, context discarded: {payload}"
        if kind != "error":
            self._restart()
        return kind, payload

    def evaluate(self, variant: Any) -> Evaluation:
        kind, payload = self._call("evaluate", (variant,), self.timeout_s())
        if kind == "ok":
            return payload
        restarted = "" if kind == "error" else "; the worker was restarted"
        return Evaluation(GateResult(False, f"worker: {payload}{restarted}", float("inf")))

    def final(self, variants: Sequence[Any], progress: Callable[[int, int], None] | None = None):
        # Peers compile and every finalist is re-gated here: give each step the first-call allowance, at least.
        timeout = max(self._first_timeout_s, 20 * self.timeout_s())
        kind, payload = self._call("final", (list(variants),), timeout, progress)
        if kind == "error":
            # The final round is the first to import torch and Triton in this process; torch 2.11 was seen to
            # fail that import now and then (a custom op of its own refused at registration). A fresh process
            # has always imported it: the round is tried once more there, the trials being safe in the study.
            self._restart()
            kind, payload = self._call("final", (list(variants),), timeout, progress)
        if kind != "ok":
            raise MageError(f"worker: the final round failed: {payload}")
        return payload

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
        self._stop()


def gpu_backend(op_name: str, shape: Any, run: dict[str, int], seed: int | None) -> Any:
    """The factory the tuner sends to the child: a GpuBackend, built there."""
    from mage_gen.backends import GpuBackend
    from mage_gen.ops import get_op

    return GpuBackend(get_op(op_name), shape, run, seed)
