"""The only module that talks to the CUDA driver (cuda.bindings.driver): context, memory, modules,
launches, CUDA graphs and events. Every CUresult is checked and named in the error."""

from __future__ import annotations

import contextlib
import ctypes
import struct
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import cache
from typing import Any

import numpy as np
from cuda.bindings import driver as cu

from mage_gen.errors import GpuError, NoGpuError

NAN_BITS = 0x7FC00000  # the float32 quiet NaN that poisons outputs before a launch
NO_CLUSTER = (1, 1, 1)  # a launch's cluster dimension where it has no cluster: launched with plain cuLaunchKernel
TENSOR_MAP_BYTES = 128  # sizeof(CUtensorMap), 64-byte aligned


def check(result: Any, call: str) -> Any:
    err, *values = result if isinstance(result, tuple) else (result,)
    if err != cu.CUresult.CUDA_SUCCESS:
        _, name = cu.cuGetErrorName(err)
        raise GpuError(f"{call} failed: {name.decode() if isinstance(name, bytes) else err}")
    return values[0] if len(values) == 1 else tuple(values) if values else None


@dataclass(frozen=True)
class DeviceInfo:
    name: str
    cc: tuple[int, int]
    sms: int
    l2_bytes: int
    max_shared_per_block: int  # opt-in limit for dynamic shared memory
    driver: str

    @property
    def arch(self) -> str:
        return f"sm_{self.cc[0]}{self.cc[1]}"

    def to_dict(self) -> dict:
        return {"name": self.name, "cc": f"{self.cc[0]}.{self.cc[1]}", "sms": self.sms,
                "l2_bytes": self.l2_bytes, "driver": self.driver}


class Buffer:
    """Device memory of `nbytes`; freed by `free()` (the context outlives every buffer of a run)."""

    def __init__(self, nbytes: int):
        self.nbytes = nbytes
        self.ptr = int(check(cu.cuMemAlloc(max(nbytes, 4)), "cuMemAlloc"))

    def upload(self, array: np.ndarray, offset_bytes: int = 0) -> None:
        data = np.ascontiguousarray(array)
        check(cu.cuMemcpyHtoD(self.ptr + offset_bytes, data.ctypes.data, data.nbytes), "cuMemcpyHtoD")

    def download(self, dtype: Any = np.float32) -> np.ndarray:
        out = np.empty(self.nbytes // np.dtype(dtype).itemsize, dtype=dtype)
        check(cu.cuMemcpyDtoH(out.ctypes.data, self.ptr, out.nbytes), "cuMemcpyDtoH")
        return out

    def download_range(self, offset_bytes: int, count: int, dtype: Any = np.float32) -> np.ndarray:
        out = np.empty(count, dtype=dtype)
        check(cu.cuMemcpyDtoH(out.ctypes.data, self.ptr + offset_bytes, out.nbytes), "cuMemcpyDtoH")
        return out

    def copy_from(self, source: Buffer) -> None:
        """A device-to-device copy of source's bytes into the start of this buffer, finished when it returns:
        work queued on a non-blocking stream does not wait for the legacy stream an async copy would use."""
        check(cu.cuMemcpyDtoD(self.ptr, source.ptr, source.nbytes), "cuMemcpyDtoD")
        synchronize()

    def fill32(self, bits: int, stream: Any = 0, offset_bytes: int = 0, count: int | None = None) -> None:
        count = (self.nbytes - offset_bytes) // 4 if count is None else count
        check(cu.cuMemsetD32Async(self.ptr + offset_bytes, bits, count, stream), "cuMemsetD32Async")

    def fill16(self, bits: int, stream: Any = 0, offset_bytes: int = 0, count: int | None = None) -> None:
        count = (self.nbytes - offset_bytes) // 2 if count is None else count
        check(cu.cuMemsetD16Async(self.ptr + offset_bytes, bits, count, stream), "cuMemsetD16Async")

    def free(self) -> None:
        if self.ptr:
            check(cu.cuMemFree(self.ptr), "cuMemFree")
            self.ptr = 0


class Kernel:
    """One entry of a loaded cubin."""

    def __init__(self, cubin: bytes, name: str, dynamic_shared_bytes: int = 0, carveout: int | None = None):
        """carveout: the share of the SM's unified L1/shared memory, in percent, preferred for shared memory
        (CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT). A hint the driver maps to a split of its own: on the
        H200, 0, 7 and 100 gave 8, 164 and 228 KB, and no preference 16 KB (bench/NOTES.md, norms §26). None
        leaves the choice to the driver."""
        if carveout is not None and not 0 <= carveout <= 100:
            raise ValueError(f"carveout: a percentage from 0 to 100, got {carveout}")
        self.name = name
        self.module = check(cu.cuModuleLoadData(cubin), f"cuModuleLoadData({name})")
        self.function = check(cu.cuModuleGetFunction(self.module, name.encode()), f"cuModuleGetFunction({name})")
        # Static and dynamic shared memory together over 48 KB fail to launch until the dynamic limit is raised
        # (its default is 48 KB less the static part).
        static = check(cu.cuFuncGetAttribute(cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES,
                                              self.function), f"cuFuncGetAttribute({name}, static shared)") \
            if dynamic_shared_bytes else 0
        if dynamic_shared_bytes and static + dynamic_shared_bytes > 48 * 1024:
            check(cu.cuFuncSetAttribute(
                self.function, cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                dynamic_shared_bytes), f"cuFuncSetAttribute({name}, max dynamic shared)")
        if carveout is not None:
            check(cu.cuFuncSetAttribute(
                self.function, cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT,
                carveout), f"cuFuncSetAttribute({name}, shared memory carveout)")

    def launch(self, grid: tuple[int, int, int], block: tuple[int, int, int], shared: int,
               args: KernelArgs, stream: Any = 0, cluster: tuple[int, int, int] = NO_CLUSTER) -> None:
        """cluster: CTAs per thread-block cluster (ops.base.Launch.cluster). A kernel compiles no cluster shape in:
        one of more than one CTA is launched with cuLaunchKernelEx and its cluster dimension attribute, others
        with cuLaunchKernel. Both are captured into a CUDA graph alike."""
        if tuple(cluster) == NO_CLUSTER:
            check(cu.cuLaunchKernel(self.function, *grid, *block, shared, stream, args.address, 0),
                  f"cuLaunchKernel({self.name})")
        else:
            check(cu.cuLaunchKernelEx(launch_config(grid, block, shared, stream, cluster), self.function,
                                      args.address, 0), f"cuLaunchKernelEx({self.name}, cluster {tuple(cluster)})")

    def read_global(self, name: str, dtype: Any) -> np.ndarray:
        """The module's global variable `name` as an array of dtype (what a probe's kernel recorded there); the
        caller synchronizes first."""
        pointer, size = check(cu.cuModuleGetGlobal(self.module, name.encode()), f"cuModuleGetGlobal({name})")
        out = np.empty(size // np.dtype(dtype).itemsize, dtype=dtype)
        check(cu.cuMemcpyDtoH(out.ctypes.data, pointer, out.nbytes), "cuMemcpyDtoH")
        return out

    def unload(self) -> None:
        if self.module is not None:
            check(cu.cuModuleUnload(self.module), "cuModuleUnload")
            self.module = None


def launch_config(grid: tuple[int, int, int], block: tuple[int, int, int], shared: int, stream: Any,
                  cluster: tuple[int, int, int]) -> Any:
    """cuLaunchKernelEx's CUlaunchConfig: the grid, block, dynamic shared memory and stream, and one attribute,
    CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION, the cluster's CTAs along x, y and z (the grid a multiple of it)."""
    config = cu.CUlaunchConfig()
    config.gridDimX, config.gridDimY, config.gridDimZ = grid
    config.blockDimX, config.blockDimY, config.blockDimZ = block
    config.sharedMemBytes = shared
    config.hStream = stream
    attribute = cu.CUlaunchAttribute()
    attribute.id = cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
    attribute.value.clusterDim.x, attribute.value.clusterDim.y, attribute.value.clusterDim.z = cluster
    config.attrs = [attribute]  # copied into the config's own array
    config.numAttrs = 1
    return config


def max_active_clusters(kernel: Kernel, block: tuple[int, int, int], shared: int, cluster: int) -> int:
    """How many clusters of `cluster` CTAs (along x) of this kernel the device runs at once: a persistent grid of
    more waits for a second wave. The driver's answer: which SMs a GPC can pair decides it. The cluster shape is
    given as a launch gives it (no kernel compiles one in)."""
    config = launch_config((cluster, 1, 1), block, shared, 0, (cluster, 1, 1))
    return int(check(cu.cuOccupancyMaxActiveClusters(kernel.function, config),
                      f"cuOccupancyMaxActiveClusters({kernel.name})"))


class FixedLaunch:
    """One kernel at a fixed grid, block and shared memory, launched with new argument values each time at
    the least cost Python allows: the values are packed into one reused buffer and libcuda's cuLaunchKernel is
    called through ctypes without per-argument conversion. For a runtime launching a kernel of a few
    microseconds per model step, the binding's own call and ctypes objects per value cost more than that.
    A clustered kernel (cluster other than (1, 1, 1)) goes through the binding's cuLaunchKernelEx instead, with the
    same packed values and a launch config made once per stream: correct, at the binding's cost per call.
    kinds: ptr, i32, i64, f32, or tmap (a TMA tensor map passed by value; its launch value is the 128 encoded
    bytes tensor_map returns)."""

    # kind: (struct format at standard size, alignment). A "tmap" is a CUtensorMap taken by value: the PTX declares
    # it `.param .align 64 .b8 name[128]`, and its value is the 128 bytes tensor_map encodes
    _FORMATS = {"ptr": ("Q", 8), "i32": ("i", 4), "i64": ("q", 8), "f32": ("f", 4),
                "tmap": (f"{TENSOR_MAP_BYTES}s", 64)}

    def __init__(self, kernel: Kernel, grid: tuple[int, int, int], block: tuple[int, int, int], shared: int,
                 kinds: Sequence[str], cluster: tuple[int, int, int] = NO_CLUSTER):
        self.kernel = kernel
        self._geometry = (tuple(grid), tuple(block), shared)
        self._cluster = None if tuple(cluster) == NO_CLUSTER else tuple(cluster)
        self._config: Any = None  # the clustered launch's config, for the stream last launched on
        self.offsets, layout = parameter_layout(kinds, self._FORMATS)
        self._buffer = ctypes.create_string_buffer(max(layout.size, 1) + 64)
        self._start = -ctypes.addressof(self._buffer) % 64  # values from its first 64-byte boundary on, so that
        # each lies at an address of its own alignment, as in a C struct (a tensor map's: 64)
        self._pack = layout.pack_into
        base = ctypes.addressof(self._buffer) + self._start
        self._pointers = (ctypes.c_void_p * max(len(kinds), 1))(*[base + offset for offset in self.offsets])
        self._params = ctypes.c_void_p(ctypes.addressof(self._pointers))
        # Plain ints go to the seven unsigned sizes (all below 2**31); the handle, stream and arrays as pointers.
        self._fixed = (ctypes.c_void_p(int(kernel.function)), *grid, *block, shared)
        self._call = _driver_launch()
        self._stream: int | None = None
        self._arguments: tuple = ()

    def launch(self, values: Sequence[int | float], stream: int) -> None:
        """Not thread-safe: the value buffer and the stream last launched on are shared (the caller serialises)."""
        self._pack(self._buffer, self._start, *values)
        if self._cluster is not None:
            if stream != self._stream or self._config is None:
                self._config = launch_config(*self._geometry, stream, self._cluster)
                self._stream = stream
            check(cu.cuLaunchKernelEx(self._config, self.kernel.function, ctypes.addressof(self._pointers), 0),
                  f"cuLaunchKernelEx({self.kernel.name}, cluster {self._cluster})")
            return
        if stream != self._stream:  # a model launches on one stream: its pointer object is made once, not per call
            self._arguments = (*self._fixed, ctypes.c_void_p(stream), self._params, None)
            self._stream = stream
        err = self._call(*self._arguments)
        if err:
            check(cu.CUresult(err), f"cuLaunchKernel({self.kernel.name})")


def parameter_layout(kinds: Sequence[str], formats: dict[str, tuple[str, int]]) -> tuple[list[int], struct.Struct]:
    """Where each argument lies in a C struct of them in order (each at a multiple of its alignment, the whole
    a multiple of the largest), and a Struct that packs them there with the padding spelled out."""
    offsets: list[int] = []
    parts: list[str] = []
    end, widest = 0, 1
    for kind in kinds:
        code, align = formats[kind]
        at = -(-end // align) * align
        parts.append(f"{at - end}x{code}" if at > end else code)
        offsets.append(at)
        end, widest = at + struct.calcsize("=" + code), max(widest, align)
    size = -(-end // widest) * widest
    return offsets, struct.Struct("=" + "".join(parts) + (f"{size - end}x" if size > end else ""))


@cache
def _driver_launch() -> Any:
    function = ctypes.CDLL("libcuda.so.1").cuLaunchKernel
    function.restype = ctypes.c_int
    return function


class KernelArgs:
    """Kernel parameters as the driver wants them: an array of pointers to each argument's value. A 'tmap' value is
    the bytes of an encoded tensor map (tensor_map), which the kernel takes by value (__grid_constant__)."""

    _CTYPES = {"ptr": ctypes.c_uint64, "i32": ctypes.c_int32, "i64": ctypes.c_int64, "f32": ctypes.c_float}

    def __init__(self, values: list[tuple[str, Any]]):
        self._values: list[Any] = []  # kept alive with the array
        addresses = []
        for kind, value in values:
            if kind == "tmap":
                held = ctypes.create_string_buffer(TENSOR_MAP_BYTES + 64)
                address = -(-ctypes.addressof(held) // 64) * 64  # the map's own alignment
                ctypes.memmove(address, value, TENSOR_MAP_BYTES)
            else:
                held = self._CTYPES[kind](value)
                address = ctypes.addressof(held)
            self._values.append(held)
            addresses.append(address)
        self._array = (ctypes.c_void_p * max(len(addresses), 1))(*addresses)

    @property
    def address(self) -> int:
        return ctypes.addressof(self._array)


_TENSOR_MAP_TYPES = {"bfloat16": "BFLOAT16", "float16": "FLOAT16", "float32": "FLOAT32", "uint8": "UINT8"}
_SWIZZLES = {0: "NONE", 32: "32B", 64: "64B", 128: "128B"}
_L2_PROMOTIONS = {0: "NONE", 64: "L2_64B", 128: "L2_128B", 256: "L2_256B"}


def tensor_map(address: int, spec: Any) -> bytes:
    """The CUtensorMap the driver encodes for a tensor at device `address` as `spec` (ops.base.TensorMapSpec: element
    type, sizes and box innermost first, byte strides, swizzle, L2 promotion) describes it, as the bytes a kernel
    parameter takes. Out-of-bounds elements of a box read as zeros."""
    rank = len(spec.dims)
    data_type = getattr(cu.CUtensorMapDataType, f"CU_TENSOR_MAP_DATA_TYPE_{_TENSOR_MAP_TYPES[spec.dtype]}")
    encoded = check(cu.cuTensorMapEncodeTiled(
        data_type, rank, address, [cu.cuuint64_t(d) for d in spec.dims], [cu.cuuint64_t(s) for s in spec.strides],
        [cu.cuuint32_t(b) for b in spec.box], [cu.cuuint32_t(1)] * rank,
        cu.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE,
        getattr(cu.CUtensorMapSwizzle, f"CU_TENSOR_MAP_SWIZZLE_{_SWIZZLES[spec.swizzle]}"),
        getattr(cu.CUtensorMapL2promotion, f"CU_TENSOR_MAP_L2_PROMOTION_{_L2_PROMOTIONS[spec.l2_promotion]}"),
        cu.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE), f"cuTensorMapEncodeTiled({spec.tensor})")
    return ctypes.string_at(encoded.getPtr(), TENSOR_MAP_BYTES)


class Stream:
    def __init__(self) -> None:
        self.handle = check(cu.cuStreamCreate(cu.CUstream_flags.CU_STREAM_NON_BLOCKING), "cuStreamCreate")

    def synchronize(self) -> None:
        check(cu.cuStreamSynchronize(self.handle), "cuStreamSynchronize")

    def destroy(self) -> None:
        check(cu.cuStreamDestroy(self.handle), "cuStreamDestroy")

    def capture(self, enqueue: Any) -> Graph:
        """Record what `enqueue(stream_handle)` puts on this stream into a replayable graph."""
        check(cu.cuStreamBeginCapture(self.handle, cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL),
               "cuStreamBeginCapture")
        try:
            enqueue(self.handle)
        finally:
            graph = check(cu.cuStreamEndCapture(self.handle), "cuStreamEndCapture")
        return Graph(graph)


class Graph:
    def __init__(self, graph: Any):
        self.graph = graph
        self.exec = check(cu.cuGraphInstantiate(graph, 0), "cuGraphInstantiate")

    def launch(self, stream: Stream) -> None:
        check(cu.cuGraphLaunch(self.exec, stream.handle), "cuGraphLaunch")

    def destroy(self) -> None:
        check(cu.cuGraphExecDestroy(self.exec), "cuGraphExecDestroy")
        check(cu.cuGraphDestroy(self.graph), "cuGraphDestroy")


class EventPair:
    """Device-side timing of what is enqueued between start() and stop()."""

    def __init__(self) -> None:
        self.begin = check(cu.cuEventCreate(0), "cuEventCreate")
        self.end = check(cu.cuEventCreate(0), "cuEventCreate")

    def start(self, stream: Stream) -> None:
        check(cu.cuEventRecord(self.begin, stream.handle), "cuEventRecord")

    def stop(self, stream: Stream) -> None:
        check(cu.cuEventRecord(self.end, stream.handle), "cuEventRecord")

    def elapsed_us(self) -> float:
        check(cu.cuEventSynchronize(self.end), "cuEventSynchronize")
        return float(check(cu.cuEventElapsedTime(self.begin, self.end), "cuEventElapsedTime")) * 1000.0

    def destroy(self) -> None:
        """Idempotent: a second call does nothing."""
        events, self.begin, self.end = (self.begin, self.end), None, None
        for event in events:
            if event is not None:
                check(cu.cuEventDestroy(event), "cuEventDestroy")


class EventSeries:
    """Events recorded in turn on a stream: the device time between each and the next."""

    def __init__(self, count: int) -> None:
        self.events: list[Any] = []
        try:
            for _ in range(count):
                self.events.append(check(cu.cuEventCreate(0), "cuEventCreate"))
        except BaseException:
            self.destroy()
            raise

    def record(self, index: int, stream: Any) -> None:
        check(cu.cuEventRecord(self.events[index], stream), "cuEventRecord")

    def gaps_us(self) -> list[float]:
        check(cu.cuEventSynchronize(self.events[-1]), "cuEventSynchronize")
        return [float(check(cu.cuEventElapsedTime(a, b), "cuEventElapsedTime")) * 1000.0
                for a, b in zip(self.events, self.events[1:])]

    def destroy(self) -> None:
        for event in self.events:
            check(cu.cuEventDestroy(event), "cuEventDestroy")
        self.events = []


def capturing(stream: int) -> bool:
    """Whether `stream` is being captured into a graph (work queued on it is recorded, not run)."""
    status = check(cu.cuStreamIsCapturing(stream), "cuStreamIsCapturing")
    return status != cu.CUstreamCaptureStatus.CU_STREAM_CAPTURE_STATUS_NONE


@contextlib.contextmanager
def relaxed_capture() -> Iterator[None]:
    """This thread may call what a capture in global mode refuses (cuMemAlloc) meanwhile, as torch's allocator
    does: the allocation is not part of any graph."""
    previous = check(cu.cuThreadExchangeStreamCaptureMode(cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED),
                     "cuThreadExchangeStreamCaptureMode")
    try:
        yield
    finally:
        check(cu.cuThreadExchangeStreamCaptureMode(previous), "cuThreadExchangeStreamCaptureMode")


def reset_persisting_l2() -> None:
    """Every line of the L2 held at persisting (evict-last) priority back to normal; done when it returns."""
    check(cu.cuCtxResetPersistingL2Cache(), "cuCtxResetPersistingL2Cache")


def synchronize() -> None:
    check(cu.cuCtxSynchronize(), "cuCtxSynchronize")


@cache
def _init_driver() -> None:
    """cuInit, once per process (a failure is not cached: the next call tries again)."""
    try:
        err, = cu.cuInit(0)
    except RuntimeError as exc:  # no libcuda on this machine
        raise NoGpuError(f"no CUDA driver on this machine ({exc}); running a kernel needs an NVIDIA GPU") from None
    if err != cu.CUresult.CUDA_SUCCESS:
        raise NoGpuError(f"the CUDA driver did not initialize ({err.name}); running a kernel needs an NVIDIA GPU")


def device_count() -> int:
    """GPUs the driver shows (NoGpuError where there is no driver)."""
    _init_driver()
    return int(check(cu.cuDeviceGetCount(), "cuDeviceGetCount"))


@cache
def device_info(ordinal: int = 0) -> DeviceInfo:
    """What device `ordinal` is; touches no context."""
    _init_driver()
    count = check(cu.cuDeviceGetCount(), "cuDeviceGetCount")
    if count <= ordinal:
        raise NoGpuError(f"the CUDA driver sees {count} GPU(s), not device {ordinal}; running a kernel needs an "
                         "NVIDIA GPU")
    device = check(cu.cuDeviceGet(ordinal), "cuDeviceGet")
    attr = cu.CUdevice_attribute

    def get(a: Any) -> int:
        return int(check(cu.cuDeviceGetAttribute(a, device), f"cuDeviceGetAttribute({a.name})"))

    name = check(cu.cuDeviceGetName(256, device), "cuDeviceGetName")
    version = int(check(cu.cuDriverGetVersion(), "cuDriverGetVersion"))
    return DeviceInfo(
        name=name.split(b"\0", 1)[0].decode(),
        cc=(get(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR), get(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)),
        sms=get(attr.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT),
        l2_bytes=get(attr.CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE),
        max_shared_per_block=get(attr.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN),
        driver=f"{version // 1000}.{version % 1000 // 10}",
    )


@cache
def open_device(ordinal: int = 0) -> DeviceInfo:
    """Initialize the driver and make device `ordinal`'s primary context current (shared with torch)."""
    info = device_info(ordinal)
    make_primary_current(ordinal)
    return info


def make_primary_current(ordinal: int) -> None:
    """Make device `ordinal`'s primary context (the one torch and the runtime API use) current in this thread."""
    device = check(cu.cuDeviceGet(ordinal), "cuDeviceGet")
    context = check(cu.cuDevicePrimaryCtxRetain(device), "cuDevicePrimaryCtxRetain")
    # Retained and never released: the primary context then lives as long as the process, as torch's does.
    check(cu.cuCtxSetCurrent(context), "cuCtxSetCurrent")


def current_context() -> int:
    """The calling thread's current context handle, 0 where it has none."""
    _init_driver()
    return int(check(cu.cuCtxGetCurrent(), "cuCtxGetCurrent"))


def current_device() -> int:
    """The device ordinal of the calling thread's current context."""
    return int(check(cu.cuCtxGetDevice(), "cuCtxGetDevice"))


def device_name() -> str:
    return open_device().name
