"""Gate, then time. A variant is timed only after its output matched the float64 reference.

Gate: fresh random inputs for every check, the output poisoned with NaN and fenced by guard regions,
the run sizes the op names; relative norm ‖out − ref‖ / ‖ref‖ against the op's tolerance; NaN never passes.
The fresh inputs and their reference are drawn on the host (GateCases), or on the GPU where the op declares a
device_case (DeviceCases: a GEMM's weights). Then the kernel is checked once more at the size it is timed at, on
the timing inputs, before it is timed: their float64 reference is computed once per Bench and the comparison runs
on the GPU, so a DRAM-sized run costs milliseconds per trial, not seconds of CPU.
Hot: launches captured in a CUDA graph and replayed, median per launch, inputs L2-warm.
Cold: the L2 flushed by writing a buffer several times its size before each timed launch.
Either way the GPU is held (hold) while the host queues a sample, so that a sample is the GPU's time alone.
Where a bench or the tuner's final round compares subjects, it times each at several placements of the inputs
and outputs (Placement) and pools the samples.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import cache
from typing import Any, NamedTuple, Protocol

import numpy as np

from mage_gen import gpu
from mage_gen.compile import compile_source
from mage_gen.dtypes import DType
from mage_gen.dtypes import dtype as element_type
from mage_gen.errors import GpuError
from mage_gen.ops import Op
from mage_gen.ops.base import WORKING_KINDS, Operand, Stored, launch_args, tensor_maps, use_product64
from mage_gen.render import render
from mage_gen.timing import Timing
from mage_gen.verdict import GateResult, compare_outputs

GUARD_BYTES = 4096  # fenced on each side of every output
# per element size, a NaN with a payload no kernel computes, so any write to the fence shows
GUARD_BITS = {4: 0x7FBADBAD, 2: 0x7FBD}
MIN_FLUSH_BYTES = 256 << 20  # the least a cold sample writes before its launch
HOT_LAUNCHES_PER_GRAPH = 20  # at most: fewer where a replay would last longer than HOT_REPLAY_US
# A replay of a hot graph lasts about this long at most: a launch longer than HOT_REPLAY_US / HOT_LAUNCHES_PER_GRAPH
# is captured fewer times (once at least). The gaps between replays, a few microseconds, are then under a thousandth
# of a replay, and a 17 ms launch (70B's gate_up at M = 8192) is not run 20 times for every sample.
HOT_REPLAY_US = 5000.0
# How long the GPU is held before each timed sample while the host queues it (hold): longer than any subject's host
# path from the flush to its launch (Inductor's guards, Triton's launcher: tens of microseconds)
HOLD_US = 1000
# Held while a subject is timed: what another thread of this process puts on the GPU meanwhile (a gate's float64
# reference drawn ahead, product_on_gpu) waits for it, so that a sample stays the GPU's time for that subject alone
timing_lock = threading.Lock()


def fenced_output(shape: tuple[int, ...], element: DType) -> gpu.Buffer:
    """Room for an output with GUARD_BYTES of fence on each side."""
    return gpu.Buffer(int(np.prod(shape)) * element.itemsize + 2 * GUARD_BYTES)


class Bound:
    """A kernel bound to device buffers for one run size: inputs uploaded, outputs fenced; working buffers
    (ops.base.Arg kinds scratch and zeroed) of its own, scratch poisoned with NaN at each poison, zeroed set to zero
    once, at the start, and checked to be zero again with the outputs (the kernel must leave them so)."""

    def __init__(self, op: Op, shape: Any, params: Any, kernel: gpu.Kernel, run: dict[str, int],
                 inputs: dict[str, np.ndarray] | None, on_device: dict[str, gpu.Buffer] | None = None,
                 share_inputs: bool = False, outputs: dict[str, gpu.Buffer] | None = None):
        """inputs: the host's arrays, or None where on_device holds them alone (a case drawn on the GPU).
        on_device: the inputs already uploaded; each is copied on the device into this run's own buffer
        (a kernel that writes into an input spoils only its own copy), or with share_inputs read where it is:
        the same memory the peers of a bench read, whose placement moves a DRAM-bound kernel's time by percents
        (bench/NOTES.md, norms §10). outputs: fenced buffers of the outputs (a Placement's) to write into, shared
        with whatever else is timed there, in place of buffers of this run's own."""
        self.op, self.kernel, self.run = op, kernel, run
        self.launch_geometry = op.geometry(shape, params, run)
        self.inputs = inputs
        self.output_shapes = op.output_shapes(shape, run)
        self.output_dtypes: dict[str, DType] = op.output_dtypes(shape)
        self.buffers: dict[str, gpu.Buffer] = {}
        self.working = {arg.name: arg for arg in launch_args(op, shape, params) if arg.kind in WORKING_KINDS}
        self._borrowed: set[str] = set()  # inputs read in place, freed by their owner
        if (share_inputs or inputs is None) and on_device is None:
            raise ValueError("share_inputs, or inputs not given, needs the inputs on the device (on_device)")
        try:
            for name, held in (inputs if inputs is not None else on_device).items():
                if share_inputs:
                    self.buffers[name] = on_device[name]
                    self._borrowed.add(name)
                    continue
                self.buffers[name] = gpu.Buffer(held.nbytes)
                if on_device is None:
                    self.buffers[name].upload(held)
                else:
                    self.buffers[name].copy_from(on_device[name])
            for name, out_shape in self.output_shapes.items():
                if outputs is not None:
                    self.buffers[name] = outputs[name]
                    self._borrowed.add(name)
                else:
                    self.buffers[name] = fenced_output(out_shape, self.output_dtypes[name])
            for name, arg in self.working.items():
                self.buffers[name] = gpu.Buffer(4 * max(arg.elements, 1))
                self.buffers[name].upload(np.full(max(arg.elements, 1), 0 if arg.kind == "zeroed" else gpu.NAN_BITS,
                                                  dtype=np.uint32))
            scalars = op.scalars(shape, run)
            values: list[tuple[str, int | float]] = []
            outputs = self.output_pointers()
            pointers = {**{name: buf.ptr for name, buf in self.buffers.items()}, **outputs}
            for arg in launch_args(op, shape, params):
                if arg.kind in ("out", "in", *WORKING_KINDS):
                    values.append(("ptr", pointers[arg.name]))
                else:
                    values.append((arg.kind, scalars[arg.name]))
            # TMA tensor maps, after the pointers: each encoded over the buffer of the tensor it maps
            for spec in tensor_maps(op, shape, params).values():
                values.append(("tmap", gpu.tensor_map(pointers[spec.tensor], spec)))
            self.args = gpu.KernelArgs(values)
        except Exception:
            self.free()
            raise

    def output_pointers(self) -> dict[str, int]:
        """Where each output's elements begin, past its fence: what the kernel is handed."""
        return {name: self.buffers[name].ptr + GUARD_BYTES for name in self.output_shapes}

    def poison(self, stream: gpu.Stream) -> None:
        for name in self.output_shapes:
            buf, size = self.buffers[name], self.output_dtypes[name].itemsize
            fill = buf.fill32 if size == 4 else buf.fill16
            fill(GUARD_BITS[size], stream.handle)
            fill(self.output_dtypes[name].nan_bits & (0xFFFFFFFF if size == 4 else 0xFFFF), stream.handle,
                 offset_bytes=GUARD_BYTES, count=(buf.nbytes - 2 * GUARD_BYTES) // size)
        for name, arg in self.working.items():
            if arg.kind == "scratch":  # what a kernel that read it before writing it would read: NaN
                self.buffers[name].fill32(gpu.NAN_BITS, stream.handle)

    def enqueue(self, stream_handle: Any) -> None:
        g = self.launch_geometry
        self.kernel.launch(g.grid, g.block, g.dynamic_shared_bytes, self.args, stream_handle, g.cluster)

    def _bits(self, name: str) -> tuple[type, int]:
        size = self.output_dtypes[name].itemsize
        return (np.uint32 if size == 4 else np.uint16), GUARD_BYTES // size

    def fence_complaints(self) -> list[str]:
        """A complaint for every output whose fence was written; reads the fences alone."""
        complaints = []
        for name in self.output_shapes:
            buf, (bits, guard) = self.buffers[name], self._bits(name)
            fence = np.concatenate([buf.download_range(0, guard, bits),
                                    buf.download_range(buf.nbytes - GUARD_BYTES, guard, bits)])
            if (changed := int(np.count_nonzero(fence != GUARD_BITS[np.dtype(bits).itemsize]))):
                complaints.append(f"wrote {changed} elements outside {name}")
        return complaints

    def outputs(self) -> tuple[dict[str, np.ndarray], list[str]]:
        """The outputs (in their element type's storage), and a complaint for every output whose fence was
        written."""
        results, complaints = {}, []
        for name, out_shape in self.output_shapes.items():
            bits, guard = self._bits(name)
            raw = self.buffers[name].download(bits)
            fence = np.concatenate([raw[:guard], raw[-guard:]])
            if (changed := int(np.count_nonzero(fence != GUARD_BITS[np.dtype(bits).itemsize]))):
                complaints.append(f"wrote {changed} elements outside {name}")
            storage = self.output_dtypes[name].storage
            results[name] = raw[guard:-guard].view(storage).reshape(out_shape)
        return results, complaints + self.working_complaints()

    def working_complaints(self) -> list[str]:
        """A complaint for every working buffer the kernel must leave zero and did not."""
        complaints = []
        for name, arg in self.working.items():
            if arg.kind == "zeroed" and (left := int(np.count_nonzero(self.buffers[name].download(np.uint32)))):
                complaints.append(f"left {left} of the {arg.elements} words of {name} not zero (the kernel must leave "
                                  "them zero for its next launch)")
        return complaints

    def free(self) -> None:
        for name, buf in self.buffers.items():
            if name not in self._borrowed:
                buf.free()
        self.buffers.clear()


class HostCase(NamedTuple):
    """A gate case drawn on the host: fresh inputs, and their float64 reference the outputs are compared with there."""

    inputs: dict[str, np.ndarray]
    reference: dict[str, np.ndarray]

    def bind(self, op: Op, shape: Any, params: Any, kernel: gpu.Kernel, run: dict[str, int]) -> Bound:
        return Bound(op, shape, params, kernel, run, self.inputs)

    def verdict(self, op: Op, shape: Any, bound: Bound, stream: gpu.Stream) -> tuple[float, str]:
        outputs, complaints = bound.outputs()
        return (float("inf"), "; ".join(complaints)) if complaints else \
            compare_outputs(op, shape, outputs, self.reference)

    def free(self) -> None:
        pass


def _stream_of(streams: dict[tuple, np.random.Generator], rng: np.random.Generator,
               run: dict[str, int]) -> np.random.Generator:
    """The stream of the generator a run size draws its cases from: its own, spawned from rng at its first case."""
    key = tuple(run.items())
    if key not in streams:
        streams[key] = rng.spawn(1)[0]
    return streams[key]


class GateCases:
    """The gate's cases: inputs drawn for one check only, with their float64 reference.

    ahead: as soon as a case of one run size is taken, the next of that size is drawn on a background thread, so
    that it is ready when the next variant is gated. A case is still used by one check alone; what moves is when
    it is drawn. On a host of few cores, the inputs and reference of a persistent grid's covering run (16M
    elements at d = 4096) cost more than the rest of a trial, and this way overlap the search's work between
    trials and the GPU's within them. Each run size then draws from its own stream of the generator, so a seed
    still fixes every case."""

    def __init__(self, op: Op, shape: Any, rng: np.random.Generator, ahead: bool = False):
        self.op, self.shape, self.rng = op, shape, rng
        self._streams: dict[tuple, np.random.Generator] = {}
        self._next: dict[tuple, Future[HostCase]] = {}
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="gate-cases") if ahead else None

    def take(self, run: dict[str, int]) -> HostCase:
        if self._pool is None:
            return self._draw(run, self.rng)
        key, stream = tuple(run.items()), _stream_of(self._streams, self.rng, run)
        pending = self._next.pop(key, None)
        case = pending.result() if pending is not None else self._draw(run, stream)
        self._next[key] = self._pool.submit(self._draw, run, stream)
        return case

    def _draw(self, run: dict[str, int], rng: np.random.Generator) -> HostCase:
        inputs = self.op.make_inputs(self.shape, run, rng)
        return HostCase(inputs, self.op.reference(self.shape, inputs, self.op.scalars(self.shape, run)))

    def close(self) -> None:
        """Drops the cases drawn ahead; one being drawn finishes on its own."""
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
        self._next.clear()


class TensorMemory:
    """A torch tensor's device memory, read as a gpu.Buffer is (.ptr, .nbytes) with its elements (.size); the
    memory goes with the tensor, after free() drops it."""

    def __init__(self, tensor: Any):
        self.tensor = tensor.contiguous()
        self.ptr, self.size = self.tensor.data_ptr(), self.tensor.numel()
        self.nbytes = self.size * self.tensor.element_size()

    def free(self) -> None:
        self.tensor = None


@dataclass(frozen=True)
class DeviceCase:
    """A gate case drawn on the GPU: the inputs, and their float64 reference to compare outputs with there."""

    inputs: dict[str, TensorMemory]
    reference: DeviceReference

    def bind(self, op: Op, shape: Any, params: Any, kernel: gpu.Kernel, run: dict[str, int]) -> Bound:
        # read where they were drawn: the case serves this one launch, its reference already made
        return Bound(op, shape, params, kernel, run, None, on_device=self.inputs, share_inputs=True)

    def verdict(self, op: Op, shape: Any, bound: Bound, stream: gpu.Stream) -> tuple[float, str]:
        return self.reference.compare(bound, stream)

    def free(self) -> None:
        for memory in self.inputs.values():
            memory.free()
        self.reference.free()


def output_tolerances(op: Op, shape: Any) -> dict[str, float]:
    """The gate's bound on each output, at the element type the kernel writes it in."""
    return {name: op.tolerance_of(shape, name, dtype) for name, dtype in op.output_dtypes(shape).items()}


class DeviceCases:
    """The gate's cases drawn on the GPU by the op's device_case (ops.base.OpFamily), each used by one check alone:
    a GEMM's weights take seconds to draw and multiply on the host, milliseconds there. Each run size draws from its
    own stream of the generator, which seeds torch's, so a seed fixes every case as it does GateCases'."""

    def __init__(self, op: Op, shape: Any, rng: np.random.Generator):
        self.op, self.shape, self.rng = op, shape, rng
        self._streams: dict[tuple, np.random.Generator] = {}
        self._draw = op.device_case.resolve()

    def take(self, run: dict[str, int]) -> DeviceCase:
        import torch

        seed = int(_stream_of(self._streams, self.rng, run).integers(1 << 62))
        with timing_lock:
            inputs, reference = self._draw(self.shape, run, seed, "cuda")
            torch.cuda.synchronize()  # drawn on torch's stream; read on ours
        return DeviceCase({name: TensorMemory(t) for name, t in inputs.items()},
                          DeviceReference({name: TensorMemory(t) for name, t in reference.items()},
                                          self.op.output_dtypes(self.shape), output_tolerances(self.op, self.shape)))


# Set, the gate draws every op's cases on the host (GateCases), where an op would have them drawn on the GPU.
HOST_CASES_ENV = "MAGE_GEN_HOST_CASES"


def gate_cases(op: Op, shape: Any, rng: np.random.Generator) -> GateCases | DeviceCases:
    """Where a bench's gate draws its cases: on the GPU where the op has a device_case and torch sees the GPU (and
    MAGE_GEN_HOST_CASES is not set), else on the host, each drawn ahead of the check that takes it."""
    if op.device_case is not None and not os.environ.get(HOST_CASES_ENV):
        try:
            import torch
        except ImportError:
            torch = None
        if torch is not None and torch.cuda.is_available():
            return DeviceCases(op, shape, rng)
    return GateCases(op, shape, rng, ahead=True)


def _hang_or(op: Op, params: Any, exc: Exception, seconds: float) -> str:
    """A launch that failed after its waits' watchdog would have fired (an op whose kernels trap a wait that never
    completes declares watchdog_s) was a hang; any other failure is what the driver said."""
    watchdog = getattr(op, "watchdog_s", None)
    if watchdog is not None and seconds >= 0.9 * watchdog(params):
        return (f"hang: the launch failed after {seconds:.1f} s, when a wait that had not completed for "
                f"{watchdog(params):g} s trapped (an mbarrier phase that never completes); the driver said: {exc}")
    return str(exc)


def gate(op: Op, shape: Any, params: Any, kernel: gpu.Kernel, run: dict[str, int],
         rng: np.random.Generator, stream: gpu.Stream, cases: GateCases | DeviceCases | None = None) -> GateResult:
    """cases: where the fresh cases come from (a Bench's, gate_cases); drawn on the host from rng when not given."""
    cases = cases or GateCases(op, shape, rng)
    errors: dict[str, float] = {}
    host = 0.0
    for gate_run in op.gate_runs(shape, run, params):
        key = ",".join(f"{k}={v}" for k, v in gate_run.items()) or "fixed"
        bound = case = None
        launched = time.perf_counter()
        try:
            started = time.perf_counter()
            case = cases.take(gate_run)
            host += time.perf_counter() - started
            bound = case.bind(op, shape, params, kernel, gate_run)
            bound.poison(stream)
            launched = time.perf_counter()
            bound.enqueue(stream.handle)
            stream.synchronize()
            started = time.perf_counter()
            err, reason = case.verdict(op, shape, bound, stream)
            host += time.perf_counter() - started
        except GpuError as exc:
            with contextlib.suppress(GpuError):  # a lost context refuses even this; the fault is the news
                _free(bound, case)
            return GateResult(False, f"{gate_run}: {_hang_or(op, params, exc, time.perf_counter() - launched)}",
                              float("inf"), errors, fault=True, host_s=host)
        except BaseException:
            _free(bound, case)
            raise
        _free(bound, case)
        errors[key] = err
        if reason:
            return GateResult(False, f"{gate_run}: {reason}", err, errors, host_s=host)
    return GateResult(True, "", max(errors.values()), errors, host_s=host)


def _free(bound: Bound | None, case: HostCase | DeviceCase | None) -> None:
    if bound is not None:
        bound.free()
    if case is not None:
        case.free()


class DeviceReference:
    """A float64 reference held on the GPU; outputs of its run size are compared with it there."""

    _BLOCK = 256

    def __init__(self, reference: dict[str, Any], dtypes: dict[str, DType], tolerances: dict[str, float]):
        """reference: each output's, a host array (uploaded here) or float64 memory already on the device (a
        DeviceCase's TensorMemory: .ptr, .size, .free()); dtypes: each output's element type, as the kernel writes
        it; tolerances: the op's for each output."""
        self.dtypes, self.tolerances = dtypes, tolerances
        self.sizes = {name: int(ref.size) for name, ref in reference.items()}
        self.buffers: dict[str, Any] = {}
        self._sums, self._bad = gpu.Buffer(16), gpu.Buffer(8)
        for name, ref in reference.items():
            if isinstance(ref, np.ndarray):
                self.buffers[name] = gpu.Buffer(ref.size * 8)
                self.buffers[name].upload(np.ascontiguousarray(ref, dtype=np.float64))
            else:
                self.buffers[name] = ref

    def compare(self, bound: Bound, stream: gpu.Stream) -> tuple[float, str]:
        """(relative error, reason it failed or ''), as compare_outputs judges: a written fence, a working buffer
        not left zero, or any NaN or infinite output fails."""
        complaints = bound.fence_complaints() + bound.working_complaints()
        if complaints:
            return float("inf"), "; ".join(complaints)
        return self.compare_at({name: bound.buffers[name].ptr + GUARD_BYTES for name in self.buffers},
                               stream)

    def compare_at(self, outputs: dict[str, int], stream: gpu.Stream,
                   tolerances: dict[str, float] | None = None) -> tuple[float, str]:
        """The same verdict on outputs at the given device addresses (a peer's tensors), written and synced;
        tolerances: where given, in place of the op's."""
        worst = 0.0
        blocks = max(1, min(-(-max(self.sizes.values()) // self._BLOCK), 8 * gpu.open_device().sms))
        for name, address in outputs.items():
            ref = self.buffers[name]
            kernel = _comparator(self.dtypes[name].ptx)
            self._sums.fill32(0, stream.handle)
            self._bad.fill32(0, stream.handle)
            args = gpu.KernelArgs([("ptr", address), ("ptr", ref.ptr),
                                   ("i64", self.sizes[name]), ("ptr", self._sums.ptr), ("ptr", self._bad.ptr)])
            kernel.launch((blocks, 1, 1), (self._BLOCK, 1, 1), 0, args, stream.handle)
            stream.synchronize()
            diff2, ref2 = (float(v) for v in self._sums.download(np.float64))
            bad = int(self._bad.download(np.uint64)[0])
            if bad:
                return float("inf"), f"{name} has {bad} NaN or infinite values: unwritten or computed NaN"
            err = float(np.sqrt(diff2 / ref2)) if ref2 else float(np.sqrt(diff2))
            worst = max(worst, err)
            tolerance = (tolerances or self.tolerances)[name]
            if not err <= tolerance:
                return err, f"{name} relative error {err:.3g} > tolerance {tolerance:g}"
        return worst, ""

    def free(self) -> None:
        for buf in (*self.buffers.values(), self._sums, self._bad):
            buf.free()


@cache
def _comparator(element: str) -> gpu.Kernel:
    source = render("measure/compare.cu.j2", {"DTYPE": element}, f"mage_gen_compare_{element}", None)
    return gpu.Kernel(compile_source(source, gpu.open_device().arch).cubin, source.kernel_name)


# ---- timing ----

class Subject(Protocol):
    """Anything timed the same way: a generated kernel or a peer. hot: `replays` samples, each a replay of a graph
    of `launches` launches, per launch."""

    name: str

    def hot(self, replays: int, launches: int = HOT_LAUNCHES_PER_GRAPH) -> list[float]: ...
    def cold(self, count: int) -> list[float]: ...
    def close(self) -> None: ...


@cache
def hold_kernel() -> gpu.Kernel:
    source = render("measure/hold.cu.j2", {}, "mage_gen_hold", None)
    return gpu.Kernel(compile_source(source, gpu.open_device().arch).cubin, source.kernel_name)


def hold(stream: Any) -> None:
    """Keeps `stream` busy for HOLD_US, so that what the host queues next (a flush, the start event, the launches,
    the stop event) runs back to back. A start event recorded on an idle GPU is stamped at once, and the sample
    would count the host's time to reach the launch: microseconds, tens of percent of a short kernel, and not the
    same for cuda-python, torch, Triton's launcher or Inductor's guards."""
    if HOLD_US:
        hold_kernel().launch((1, 1, 1), (1, 1, 1), 0, gpu.KernelArgs([("i64", HOLD_US * 1000)]), stream)


def own_lines_only() -> None:
    """Lines of L2 loaded at evict-last priority outlive the flush and any stream of normal traffic (bench/NOTES.md,
    norms §14): left by one subject, they are hits for the next one that reads the same bytes, and its time is
    partly the other's (Triton right after Inductor, whose norms load x at evict-last, ran RMSNorm 4096×8192 hot
    in 33.4 µs, 35.0 when Inductor had not run; norms §19). Called before each subject's hot replays and each
    cold sample, so each is timed on the lines it left itself (hot) or on none (cold)."""
    gpu.reset_persisting_l2()


def flush_bytes() -> int:
    """What a cold sample writes before its launch: four times this GPU's L2 (as the driver reports it), and at
    least MIN_FLUSH_BYTES, so that none of the inputs' lines survive in it."""
    return max(MIN_FLUSH_BYTES, 4 * gpu.open_device().l2_bytes)


@cache
def flush_buffer() -> gpu.Buffer:
    return gpu.Buffer(flush_bytes())


def hot_launches(launch_us: float) -> int:
    """Launches per hot graph for a launch of about launch_us: HOT_LAUNCHES_PER_GRAPH, or fewer where a replay of
    that many would last longer than HOT_REPLAY_US."""
    if not launch_us > 0:
        return HOT_LAUNCHES_PER_GRAPH
    return max(1, min(HOT_LAUNCHES_PER_GRAPH, math.ceil(HOT_REPLAY_US / launch_us)))


def launches_for(subjects: Sequence[Subject]) -> int:
    """Launches per hot graph for subjects timed together, the same for each: hot_launches of the fastest one's
    launch, from a replay of one launch each."""
    return hot_launches(min(min(s.hot(1, 1)) for s in subjects)) if subjects else HOT_LAUNCHES_PER_GRAPH


class TimedAlone:
    """A subject whose samples (its _hot and _cold) are taken holding timing_lock."""

    def hot(self, replays: int, launches: int = HOT_LAUNCHES_PER_GRAPH) -> list[float]:
        with timing_lock:
            return self._hot(replays, launches)

    def cold(self, count: int) -> list[float]:
        with timing_lock:
            return self._cold(count)


class KernelSubject(TimedAlone):
    """A gated kernel bound to inputs of the tuned size, timed on its own stream."""

    def __init__(self, name: str, bound: Bound, stream: gpu.Stream):
        self.name, self.bound, self.stream = name, bound, stream
        self.events = gpu.EventPair()
        self._graph: gpu.Graph | None = None
        self._launches = 0  # in the graph captured

    def _hot(self, replays: int, launches: int) -> list[float]:
        if self._graph is not None and self._launches != launches:
            self._graph.destroy()
            self._graph = None
        if self._graph is None:
            self._graph = self.stream.capture(lambda handle: [self.bound.enqueue(handle) for _ in range(launches)])
            self._launches = launches
        own_lines_only()
        self._graph.launch(self.stream)  # warm-up: inputs into L2, code into the instruction cache
        # the replays back to back behind a hold, an event between each and the next
        events = gpu.EventSeries(replays + 1)
        try:
            hold(self.stream.handle)
            for i in range(replays):
                events.record(i, self.stream.handle)
                self._graph.launch(self.stream)
            events.record(replays, self.stream.handle)
            return [gap / launches for gap in events.gaps_us()]
        finally:
            events.destroy()

    def _cold(self, count: int) -> list[float]:
        flush = flush_buffer()
        samples = []
        for i in range(count):
            own_lines_only()
            hold(self.stream.handle)
            flush.fill32(i, self.stream.handle)
            self.events.start(self.stream)
            self.bound.enqueue(self.stream.handle)
            self.events.stop(self.stream)
            samples.append(self.events.elapsed_us())
        return samples

    def close(self) -> None:
        if self._graph is not None:
            self._graph.destroy()
            self._graph = None
        self.events.destroy()  # the worker process lives for many trials
        self.bound.free()


def interleave(subjects: Sequence[Subject], method: str, rounds: int, per_round: int,
               launches: int | None = None) -> dict[str, Timing]:
    """Round-robin sampling, so drift in clocks or temperature falls on every subject alike."""
    return interleave_placed([subjects], method, rounds, per_round, launches)[0]


def interleave_placed(placed: Sequence[Sequence[Subject]], method: str, rounds: int, per_round: int,
                      launches: int | None = None) -> tuple[dict[str, Timing], list[dict[str, Timing]]]:
    """interleave, round r taken at placement r % len(placed) (placed[p]: the subjects timed there, the same
    names at every placement): each name's samples pooled over the placements, and each placement's own."""
    return pool_rounds(interleave_rounds(placed, method, rounds, per_round, launches), method, len(placed))


def round_order(placed: Sequence[Sequence[Subject]], r: int, alternate: bool = True) -> Sequence[Subject]:
    """The subjects of round r in the order they are timed: placement r % len(placed)'s, reversed on every other
    pass over the placements where `alternate`. A GPU at its power limit lowers its clocks as heavy work goes on, so
    a subject timed after another heavy one can run slower than timed first (bench/NOTES.md, Hopper GEMM §16);
    reversing gives each placement both orders."""
    group = placed[r % len(placed)]
    return group[::-1] if alternate and (r // len(placed)) % 2 else group


def interleave_rounds(placed: Sequence[Sequence[Subject]], method: str, rounds: int, per_round: int,
                      launches: int | None = None, alternate: bool = True) -> list[dict[str, list[float]]]:
    """The samples of interleave_placed round by round (round r at placement r % len(placed), in round_order), each
    subject's by name: what a paired comparison of two subjects reads (timing.round_ratio). launches: per hot graph,
    the same for every subject; launches_for the first placement's subjects where not given."""
    names = sorted(s.name for s in placed[0])
    if any(sorted(s.name for s in group) != names for group in placed):
        raise ValueError("interleave: every placement must hold the same subjects")
    if method == "hot":
        launches = launches or launches_for(placed[0])
    take = (lambda s: s.hot(per_round, launches)) if method == "hot" else (lambda s: s.cold(per_round))
    return [{subject.name: take(subject) for subject in round_order(placed, r, alternate)} for r in range(rounds)]


def pool_rounds(taken: Sequence[dict[str, list[float]]], method: str, placements: int
                ) -> tuple[dict[str, Timing], list[dict[str, Timing]]]:
    """interleave_rounds' samples as interleave_placed reports them: pooled by name, and by placement."""
    names = list(taken[0]) if taken else []
    pooled = {name: Timing.from_samples(method, [v for by in taken for v in by[name]]) for name in names}
    # a placement no round reached (fewer rounds than placements) has no timing
    by_placement = [{name: Timing.from_samples(method, [v for by in taken[p::placements] for v in by[name]])
                     for name in names} for p in range(min(len(taken), placements))]
    return pooled, by_placement


def common_to_every_placement(placed: Sequence[Sequence[Any]]) -> tuple[list[list[Any]], list[str]]:
    """The subjects whose name every placement holds, per placement, and the names some placement lacks (a
    kernel or peer that failed its check there): those are timed nowhere (closing them is the caller's, with
    the rest)."""
    names = set.intersection(*({s.name for s in group} for group in placed)) if placed else set()
    kept = [[s for s in group if s.name in names] for group in placed]
    return kept, sorted({s.name for group in placed for s in group} - names)


# ---- one GPU, one op and size: what the tuner and the benches call ----

@dataclass(frozen=True)
class Evaluation:
    gate: GateResult
    hot: Timing | None = None  # None when the gate failed: a failed variant is never timed
    cold: Timing | None = None
    # where the evaluation's wall time went: load, gate (with the timed-size check), of it gate_host, timing
    seconds: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {"gate": self.gate.to_dict(), "hot": self.hot.to_dict() if self.hot else None,
                "cold": self.cold.to_dict() if self.cold else None}


# Between one placement's buffers and the last's: a spacer 3 MB longer per placement, so that each set lies on
# other pages
PLACEMENT_SPACER_BYTES = 3 << 20


class Placement:
    """The timing inputs at addresses of their own, and one set of fenced outputs that everything timed there
    writes. Where x and y lie moves a DRAM-bound norm's time by 2-4% either way, and favours one kernel over
    another (bench/NOTES.md, norms §15): a ranking or ratio taken at one placement is that placement's. So
    rounds are taken at several, every subject timed at each, all of them reading and writing the same memory
    there. Placement 0 reads the timing buffers themselves; a later one a copy of them, after a spacer."""

    def __init__(self, index: int, source: dict[str, gpu.Buffer], output_shapes: dict[str, tuple[int, ...]],
                 output_dtypes: dict[str, DType]):
        self.index = index
        self._owned: list[gpu.Buffer] = []
        try:
            if index:
                self._owned.append(gpu.Buffer(index * PLACEMENT_SPACER_BYTES))
                self.inputs = {}
                for name, buf in source.items():
                    self.inputs[name] = gpu.Buffer(buf.nbytes)
                    self._owned.append(self.inputs[name])
                    self.inputs[name].copy_from(buf)
            else:
                self.inputs = dict(source)
            self.outputs = {}
            for name, out_shape in output_shapes.items():
                self.outputs[name] = fenced_output(out_shape, output_dtypes[name])
                self._owned.append(self.outputs[name])
        except BaseException:
            self.free()
            raise

    def input_pointers(self) -> dict[str, int]:
        return {name: buf.ptr for name, buf in self.inputs.items()}

    def output_pointers(self) -> dict[str, int]:
        """Where each output's elements begin, past its fence."""
        return {name: buf.ptr + GUARD_BYTES for name, buf in self.outputs.items()}

    def free(self) -> None:
        for buf in self._owned:
            buf.free()
        self._owned.clear()


def product_on_gpu(a: Operand, b: Operand) -> np.ndarray:
    """a @ b in float64 by cuBLAS, through torch (an H200 does about 50 TFLOP/s of it, its host's cores about one),
    never while a subject is being timed. Stored operands cross at their own width and are widened on the GPU."""
    import torch

    with timing_lock, torch.no_grad():
        return (float64_tensor(a, "cuda") @ float64_tensor(b, "cuda")).cpu().numpy()


# the integer type of each storage width: torch reads no uint16, and a same-width view keeps the bits
_SAME_WIDTH_INTS = {1: np.uint8, 2: np.int16, 4: np.int32}


def float64_tensor(operand: Operand, device: str) -> Any:
    """The operand as a float64 torch tensor on `device`; a Stored one widened there from its storage's bits."""
    import torch

    if not isinstance(operand, Stored):
        return torch.from_numpy(operand).to(device)
    from mage_gen.device_cases import widened

    values = operand.values
    return widened(torch.from_numpy(values.view(_SAME_WIDTH_INTS[values.dtype.itemsize])).to(device), operand.dtype)


def _use_the_gpu_for_large_references() -> None:
    """Large float64 products of the ops' references (ops.base.product64) on the GPU, where torch sees one."""
    try:
        import torch
    except ImportError:
        return
    if torch.cuda.is_available():
        use_product64(product_on_gpu)


class Bench:
    """Loads, gates and times variants of one op and size on the current GPU."""

    def __init__(self, op: Op, shape: Any, run: dict[str, int], seed: int | None = None,
                 inputs: dict[str, np.ndarray] | None = None):
        """inputs: the timing inputs (another op's, to time two ops on the same values); drawn from the seed where
        not given. The gate draws its own either way."""
        self.op, self.shape, self.run = op, shape, run
        self.device = gpu.open_device()
        self.stream = gpu.Stream()
        self.rng = np.random.default_rng(seed)
        _use_the_gpu_for_large_references()
        self.cases = gate_cases(op, shape, self.rng)
        self._timing_inputs: dict[str, np.ndarray] | None = inputs
        self._timing_on_device: dict[str, gpu.Buffer] | None = None
        self._timing_reference: DeviceReference | None = None
        self._placements: list[Placement] = []

    def load(self, variant: Any) -> gpu.Kernel:
        launch = self.op.geometry(self.shape, variant.params, self.run)
        return gpu.Kernel(variant.compiled.cubin, variant.source.kernel_name, launch.dynamic_shared_bytes,
                          variant.carveout)

    def timing_inputs(self) -> dict[str, np.ndarray]:
        """The inputs every variant (and peer) is timed on; the gate draws fresh ones for every check."""
        if self._timing_inputs is None:
            self._timing_inputs = self.op.make_inputs(self.shape, self.run, self.rng)
        return self._timing_inputs

    def timing_reference(self) -> DeviceReference:
        """The float64 reference of the timing inputs, computed once and kept on the GPU."""
        if self._timing_reference is None:
            inputs = self.timing_inputs()
            self._timing_reference = DeviceReference(
                self.op.reference(self.shape, inputs, self.op.scalars(self.shape, self.run)),
                self.op.output_dtypes(self.shape), output_tolerances(self.op, self.shape))
        return self._timing_reference

    def timing_buffers(self) -> dict[str, gpu.Buffer]:
        """The timing inputs on the GPU, uploaded once: each subject copies them, or with share_inputs reads them
        in place, as peers given their pointers do (make_peers' device_inputs)."""
        if self._timing_on_device is None:
            uploaded = {}
            for key, array in self.timing_inputs().items():
                uploaded[key] = gpu.Buffer(array.nbytes)
                uploaded[key].upload(array)
            self._timing_on_device = uploaded
        return self._timing_on_device

    def inputs_changed(self) -> list[str]:
        """The timing inputs whose buffers no longer hold them, bit for bit: what a kernel or peer reading them in
        place wrote into."""
        gpu.synchronize()  # what other streams (torch's) still have queued
        changed = []
        for name, array in self.timing_inputs().items():
            expected = np.ascontiguousarray(array).view(np.uint8).ravel()
            for place in [None, *self._placements[1:]]:
                held = (self.timing_buffers() if place is None else place.inputs)[name].download(np.uint8)
                if not np.array_equal(held, expected):
                    changed.append(name if place is None else f"{name} (placement {place.index})")
        return changed

    def placement(self, index: int) -> Placement:
        """The timing inputs and shared outputs at placement `index` (0: the timing buffers themselves), made
        once each and kept until free_placements."""
        while len(self._placements) <= index:
            self._placements.append(Placement(len(self._placements), self.timing_buffers(),
                                              self.op.output_shapes(self.shape, self.run),
                                              self.op.output_dtypes(self.shape)))
        return self._placements[index]

    def free_placements(self) -> None:
        """Frees what the placements allocated (not the timing buffers); their subjects must be closed first."""
        for place in self._placements:
            place.free()
        self._placements.clear()

    def subject(self, variant: Any, kernel: gpu.Kernel, name: str | None = None,
                share_inputs: bool = False, placement: int | None = None) -> KernelSubject:
        """placement: read that placement's inputs and write its shared outputs (share_inputs is then implied)."""
        if placement is not None:
            place = self.placement(placement)
            bound = Bound(self.op, self.shape, variant.params, kernel, self.run, self.timing_inputs(),
                          on_device=place.inputs, share_inputs=True, outputs=place.outputs)
        else:
            bound = Bound(self.op, self.shape, variant.params, kernel, self.run, self.timing_inputs(),
                          on_device=self.timing_buffers(), share_inputs=share_inputs)
        # Fences poisoned from the start: what is read back from them after timing is then a real check,
        # not uninitialised memory.
        bound.poison(self.stream)
        return KernelSubject(name or variant.source.kernel_name, bound, self.stream)

    def check_tensor(self, name: str, tensor: Any) -> tuple[float, str]:
        """A peer's output (a contiguous CUDA tensor of the timed size, of the output's dtype) against the timing
        reference."""
        expected = self.op.output_dtypes(self.shape)[name]
        got = str(tensor.dtype).removeprefix("torch.")
        if got == expected.name:
            return self.timing_reference().compare_at({name: tensor.data_ptr()}, self.stream)
        if got not in ("bfloat16", "float16") or expected.itemsize != 4:
            return float("inf"), f"{name} is {tensor.dtype}, not {expected.name}"
        # A peer that returns the output rounded to a 16-bit type (cuBLAS bf16 GEMM as torch.matmul gives it):
        # widened on the GPU and held to the op's tolerance for that type.
        import torch

        wide = tensor.float()
        torch.cuda.synchronize()
        narrow = element_type(got)
        return self.timing_reference().compare_at({name: wide.data_ptr()}, self.stream,
                                                  {name: self.op.tolerance_of(self.shape, name, narrow)})

    def checked_subject(self, variant: Any, kernel: gpu.Kernel, name: str | None = None,
                        share_inputs: bool = False, placement: int | None = None
                        ) -> tuple[KernelSubject | None, GateResult]:
        """Gate (fresh inputs at the op's gate sizes), then checked_at: a subject only for a kernel that passed
        both."""
        result = gate(self.op, self.shape, variant.params, kernel, self.run, self.rng, self.stream, self.cases)
        if not result.passed:
            return None, result
        subject, err, reason = self.checked_at(variant, kernel, name, share_inputs, placement)
        key = ",".join(f"{k}={v}" for k, v in self.run.items()) or "fixed"
        errors = {**result.errors, f"{key} (timing inputs)": err}
        if reason:
            return None, GateResult(False, f"{self.run} on the timing inputs: {reason}", err, errors,
                                    host_s=result.host_s)
        return subject, GateResult(True, "", max(errors.values()), errors, host_s=result.host_s)

    def checked_at(self, variant: Any, kernel: gpu.Kernel, name: str | None = None, share_inputs: bool = False,
                   placement: int | None = None) -> tuple[KernelSubject | None, float, str]:
        """One launch at the timed size on the timing inputs (a placement's, where given) into a poisoned,
        fenced output, compared on the GPU: (the subject where it matched, the error, why not or '').
        A kernel that passed the gate is checked so again at each further placement it is timed at."""
        subject = self.subject(variant, kernel, name, share_inputs, placement)
        try:
            subject.bound.poison(self.stream)
            subject.bound.enqueue(self.stream.handle)
            self.stream.synchronize()
            err, reason = self.timing_reference().compare(subject.bound, self.stream)
        except BaseException:
            subject.close()
            raise
        if reason:
            subject.close()
            return None, err, reason
        return subject, err, ""

    def evaluate(self, variant: Any, hot_replays: int = 10, cold_count: int = 10) -> Evaluation:
        """Gate, then time; a failure is a failed Evaluation, except a CUDA error that left the context
        unusable: that raises GpuError, so that whoever owns the process (the tuner's worker) starts a fresh
        one rather than failing every later trial in a dead context."""
        if fault := variant.census.static_fault():  # a race the GPU need not show: refused unlaunched
            return Evaluation(GateResult(False, fault, float("inf")))
        kernel = None
        try:
            started = time.perf_counter()
            kernel = self.load(variant)
            loaded = time.perf_counter() - started
            evaluation = self._gate_and_time(variant, kernel, hot_replays, cold_count)
            evaluation = dataclasses.replace(evaluation, seconds={"load": loaded, **evaluation.seconds})
        except GpuError as exc:  # the load refused (too much shared memory for this GPU, a bad image)
            evaluation = Evaluation(GateResult(False, f"load: {exc}", float("inf"), fault=True))
        except BaseException:
            if kernel is not None:
                with contextlib.suppress(GpuError):
                    kernel.unload()
            raise
        if evaluation.gate.fault:
            try:
                gpu.synchronize()  # raises where the context is lost (an illegal address); not after a refused launch
            except GpuError as exc:  # the trial's own reason first: what the gate saw (a hang, an illegal address)
                raise GpuError(f"{evaluation.gate.reason} (the context is lost: {exc})") from None
        if kernel is not None:
            kernel.unload()
        return evaluation

    def _gate_and_time(self, variant: Any, kernel: gpu.Kernel, hot_replays: int, cold_count: int) -> Evaluation:
        started = time.perf_counter()
        try:
            subject, result = self.checked_subject(variant, kernel)
        except GpuError as exc:
            return Evaluation(GateResult(False, f"timed-size check: {exc}", float("inf"), fault=True))
        gated = time.perf_counter()
        seconds = {"gate": gated - started, "gate_host": result.host_s}
        if subject is None:
            return Evaluation(result, seconds=seconds)
        try:
            try:
                hot = Timing.from_samples("hot", subject.hot(hot_replays, launches_for([subject])))
                cold = Timing.from_samples("cold", subject.cold(cold_count))
                return Evaluation(result, hot, cold, seconds={**seconds, "timing": time.perf_counter() - gated})
            finally:
                subject.close()
        except GpuError as exc:
            return Evaluation(GateResult(False, f"timing: {exc}", float("inf"), fault=True))
