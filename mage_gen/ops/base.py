"""What every op family provides. An op knows nothing of Optuna, NVRTC or the driver."""

from __future__ import annotations

import functools
import importlib
import os
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import MISSING, asdict, dataclass, fields
from typing import Any, Protocol, TypeVar

import numpy as np

from mage_gen.dtypes import DType
from mage_gen.errors import ConfigError
from mage_gen.render import Source


T = TypeVar("T")

# Rows the host's threads take one at a time: about this many elements. A fixed split of the rows, not one by core
# count, so that a seed gives the same values, and a sum the same bits, on any host.
BLOCK_ELEMENTS = 1 << 20
_threads: list[ThreadPoolExecutor] = []


def row_blocks(count: int, length: int) -> list[slice]:
    """`count` rows of `length` elements in blocks of about BLOCK_ELEMENTS."""
    per_block = max(1, BLOCK_ELEMENTS // max(length, 1))
    return [slice(start, min(start + per_block, count)) for start in range(0, count, per_block)]


def on_every_core(work: Callable[..., T], *arguments: Sequence[Any]) -> list[T]:
    """[work(*each) for each in zip(*arguments)], on a thread per core: numpy's generators and ufuncs let go of the
    GIL while they work, so a GEMM's 10⁸-element operand is drawn or compared in a fraction of one core's time."""
    if not _threads:
        _threads.append(ThreadPoolExecutor(os.cpu_count() or 1, thread_name_prefix="rows"))
    return [done.result() for done in [_threads[0].submit(work, *each) for each in zip(*arguments)]]


def fill_rows(rng: np.random.Generator, count: int, length: int,
              fill: Callable[[np.random.Generator, slice], None]) -> None:
    """fill(child, rows) over `count` rows of `length` elements, in blocks of rows each given its own child of rng,
    on every core (a big GEMM's gate drew its inputs on one core for most of a trial)."""
    blocks = row_blocks(count, length)
    on_every_core(fill, rng.spawn(len(blocks)), blocks)


# A float64 product of at least this many multiply-adds goes to the product installed with use_product64 where there
# is one (a second or more on the host's cores at Llama's shapes; measure installs cuBLAS's, through torch)
LARGE_PRODUCT_FLOPS = 1 << 33


@dataclass(frozen=True)
class Stored:
    """A matrix operand of a product64 as a kernel reads it: `values` in `dtype`'s storage (a view, rows of a padded
    buffer or transposed), widened to float64 where the product is taken. A large product's operands then cross to
    the GPU at their own width and are widened there: 70B's gate_up weight (470M elements) widened on the host is
    3.8 GB of float64 made by one core, where a trial's gate took 2.95 s, 2.5 of them on the host."""

    values: np.ndarray
    dtype: DType

    @property
    def shape(self) -> tuple[int, ...]:
        return self.values.shape

    @property
    def T(self) -> "Stored":
        return Stored(self.values.T, self.dtype)

    def float64(self) -> np.ndarray:
        return self.dtype.widen(self.values).astype(np.float64)


Operand = np.ndarray | Stored
_large_products: list[Callable[[Operand, Operand], np.ndarray]] = []


def product64(a: Operand, b: Operand) -> np.ndarray:
    """a @ b in float64 for a (M, K) and b (K, N), each float64 or Stored: the references' matrix products. A large
    one is computed by the product installed with use_product64, if any; the rest, and every one on a host without
    it, by numpy."""
    if _large_products and 2 * a.shape[0] * a.shape[1] * b.shape[1] >= LARGE_PRODUCT_FLOPS:
        return _large_products[-1](a, b)
    return _float64(a) @ _float64(b)


def _float64(operand: Operand) -> np.ndarray:
    return operand.float64() if isinstance(operand, Stored) else operand


def use_product64(product: Callable[[Operand, Operand], np.ndarray]) -> None:
    """Compute large float64 products (product64) with `product` from now on in this process; it takes float64
    arrays and Stored operands."""
    _large_products[:] = [product]


def params_from(params_type: type, op_name: str, values: dict[str, Any], hidden: frozenset[str] = frozenset()) -> Any:
    """An op's frozen Params from a dict (a search space, --config, tuned/), naming unknown keys and refusing
    true/false for a whole-number field (Python would take them as 1 and 0)."""
    defaults = {f.name: f.default for f in fields(params_type)}
    unknown = sorted(set(values) - set(defaults))
    if unknown:
        raise ConfigError(f"params: unknown {op_name} parameter(s) {unknown}; known: {sorted(set(defaults) - hidden)}")
    for name, value in values.items():
        default = defaults[name]
        whole = isinstance(default, int) and not isinstance(default, bool)
        # true/false would pass as 1 and 0, and '128.0' or 'two' would reach a rule about something else
        if whole and (isinstance(value, bool) or not isinstance(value, int)):
            raise ConfigError(f"params: {op_name} {name} is a whole number, got {value!r}")
        if isinstance(default, bool) and not isinstance(value, bool):
            raise ConfigError(f"params: {op_name} {name} is true or false, got {value!r}")
        if isinstance(default, str) and not isinstance(value, str):
            raise ConfigError(f"params: {op_name} {name} is a word (e.g. {default!r}), got {value!r}")
    return params_type(**values)


def public_params_from(params_type: type, op_name: str, values: dict[str, Any], hidden: frozenset[str]) -> Any:
    """params_from for what a user gives (--config): a hidden field (a test-only switch) is as unknown there
    as a misspelt one."""
    if hidden & set(values):
        known = sorted({f.name for f in fields(params_type)} - hidden)
        raise ConfigError(f"params: unknown {op_name} parameter(s) {sorted(hidden & set(values))}; known: {known}")
    return params_from(params_type, op_name, values, hidden)


def params_dict(params: Any, hidden: frozenset[str] = frozenset()) -> dict[str, Any]:
    """Params as a plain dict; a hidden field (a test-only switch) is left out while at its default: it
    belongs to no search space and no stored winner."""
    values = asdict(params)
    for f in fields(params):
        if f.name in hidden and values[f.name] == f.default:
            del values[f.name]
    return values


def shape_dict(shape: Any) -> dict[str, Any]:
    """A shape as plain data, leaving out each optional field at its default: an fp32 layer norm of d = 768 is
    {'d': 768}, as it was before shapes had dtypes, so its studies and entries keep their names."""
    values = asdict(shape)
    for f in fields(shape):
        if f.default is not MISSING and values[f.name] == f.default:
            del values[f.name]
    return values


def register_cap(block_threads: int, blocks: int = 1) -> int:
    """Registers per thread ptxas allows under __launch_bounds__(block, blocks): the 64K register file split
    over the warps of `blocks` blocks, each rounded up to whole groups of 4 warps, in steps of 8, at most 255."""
    warps = -(-block_threads // 32)
    warps = -(-warps // 4) * 4
    return min(255, 65536 // (blocks * warps * 32) // 8 * 8)


@dataclass(frozen=True)
class Launch:
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    dynamic_shared_bytes: int
    static_shared_bytes: int  # what ptxas must report; the census test holds the template to it
    # CTAs per thread-block cluster along x, y, z: set at launch alone (cuLaunchKernelEx's cluster dimension
    # attribute), never compiled in with __cluster_dims__; the grid is a multiple of it. (1, 1, 1): no cluster.
    cluster: tuple[int, int, int] = (1, 1, 1)

    @property
    def threads(self) -> int:
        return self.block[0] * self.block[1] * self.block[2]

    @property
    def clustered(self) -> bool:
        return self.cluster != (1, 1, 1)


@dataclass(frozen=True)
class LazyFunction:
    """A function named by its module and name, imported at its first use: an op names its peers this way, as they
    need torch and Triton, which importing the ops must not. `bound` fixes some of its keyword arguments."""

    module: str
    name: str
    bound: tuple[tuple[str, Any], ...] = ()

    def resolve(self) -> Callable[..., Any]:
        function = getattr(importlib.import_module(self.module), self.name)
        return functools.partial(function, **dict(self.bound)) if self.bound else function


# A search-space value the op works out from the shape and the GPU's SM count (OpFamily.fit_device): gemm_sm90's bn
# "waves", the N tiles that spread the tiles over the SMs in the fewest, fullest waves
WAVES = "waves"


class OpFamily:
    """What an op declares beyond its kernels, for the code that serves every op (the peers, the runtime, the torch
    ops, the store), at the values most ops take: that code asks the op, never a table of op names."""

    name: str
    # the builder of mage_gen.peers that makes what this op's kernels are timed against, called as
    # (shape, inputs, eps, inductor, tensor_of, output_of) -> {family: [peer, ...] or why it is missing}; None: none
    peer_builder: LazyFunction | None = None
    # the builder of mage_gen.device_cases that draws the gate's cases on the GPU, called as (shape, run, seed,
    # device) -> (inputs, float64 reference), torch tensors laid out as make_inputs and reference give them; None:
    # drawn on the host (measure.GateCases), as every op whose cases a trial draws in a small share of its time is
    device_case: LazyFunction | None = None
    # where nothing is tuned for a shape, the params the runtime tries, in order, each over op.defaults(shape): the
    # first the op accepts runs
    default_candidates: tuple[Mapping[str, Any], ...] = ({},)
    # the function of mage_gen.torch that launches this op, as its errors name it; None: mage_gen.torch has none
    torch_name: str | None = None
    # the function of mage_gen.runtime that launches it from raw device pointers; None: the runtime has none
    runtime_name: str | None = None
    # what each of the shape's fields (sizes at generation and at launch, and options) means for this op, as the
    # command line's help gives it
    field_help: Mapping[str, str] = {}
    # the rules a (shape, params) must keep, in the order they are checked: validate reports the first one broken
    rules: tuple[Rule, ...] = ()
    # sizes fixed at generation over which stored entries are size classes: a shape with no entry of its own runs
    # the params of the entry dispatch.CLASS_RULE picks, compiled for its own sizes; (): every shape is its own
    class_dims: tuple[str, ...] = ()
    # shape fields that change only what the kernel does with its sums (gemm_sm90: gate): where no entry matches a
    # shape in them, an entry that differs there serves it too (dispatch.CLASS_RULE), its main loop being the same
    epilogue_fields: tuple[str, ...] = ()

    def validate(self, shape: Any, params: Any) -> None:
        check_rules(self.rules, shape, params)

    def fit_device(self, shape: Any, axes: dict[str, tuple], sms: int) -> dict[str, tuple]:
        """A preset's axes with the values that depend on the GPU's SM count worked out for this shape (WAVES, where
        the op knows it); the space leaves out any it does not resolve."""
        return axes

    def peers(self, shape: Any, inputs: dict[str, np.ndarray], eps: float, inductor: bool,
              tensor_of: Callable[[str, DType], Any], output_of: Callable[..., Any]) -> dict[str, Any]:
        """This op's peers by family, each family a list of candidates or the reason it has none; {} without a
        peer_builder."""
        if self.peer_builder is None:
            return {}
        return self.peer_builder.resolve()(shape, inputs, eps, inductor, tensor_of, output_of)

    def params_from_format_2(self, params: dict[str, Any], shape: dict[str, Any]) -> dict[str, Any]:
        """Params as a tuned/ file of format 2 stored them, as today's Params take them: most ops' are unchanged."""
        return params


class TiledProduct(OpFamily):
    """The launch of a matrix product whose sizes are all fixed at generation: a block per bm×bn tile of C
    (params bm, bn, threads; the op gives shared_bytes), no run size, no scalars."""

    name: str
    min_arch: int

    def min_arch_of(self, shape: Any, params: Any = None) -> int:
        """A product's sizes and params ask nothing of the arch beyond what its templates do."""
        return self.min_arch

    def shared_bytes(self, shape: Any, p: Any) -> int:
        raise NotImplementedError

    def geometry(self, shape: Any, p: Any, run: dict[str, int]) -> Launch:
        return Launch(grid=(-(-shape.n // p.bn), -(-shape.m // p.bm), 1), block=(p.threads, 1, 1),
                      dynamic_shared_bytes=self.shared_bytes(shape, p), static_shared_bytes=0)

    def launch_formula(self, shape: Any, p: Any) -> dict[str, Any]:
        launch = self.geometry(shape, p, {})
        return {"grid": list(launch.grid), "block": list(launch.block), "cluster": list(launch.cluster),
                "dynamic_shared_bytes": launch.dynamic_shared_bytes}

    def check_run(self, run: dict[str, int]) -> None:
        if run:
            raise ConfigError(f"run: {self.name} takes every size at generation (--m --n --k), not {sorted(run)}")

    def scalars(self, shape: Any, run: dict[str, int]) -> dict[str, int | float]:
        return {}


@dataclass(frozen=True)
class Rule:
    """One validation rule as data: `holds(*subject)` is true where the subject (a shape, or a shape and params)
    keeps it; otherwise the error is `name: message(*subject)`."""

    name: str
    holds: Callable[..., bool]
    message: Callable[..., str]


def check_rules(rules: tuple[Rule, ...], *subject: Any) -> None:
    """Raises ConfigError naming the first rule the subject breaks."""
    for rule in rules:
        if not rule.holds(*subject):
            raise ConfigError(f"{rule.name}: {rule.message(*subject)}")


@dataclass(frozen=True)
class TensorMapSpec:
    """A TMA tensor map a kernel takes, as data: the tensor argument whose memory it maps, its element type
    (torch's name), its sizes in elements (innermost first), the byte stride of each dimension but the innermost,
    the box one copy moves (elements, innermost first), the shared-memory swizzle (bytes: 0, 32, 64 or 128) and
    how far L2 promotes a fetch (bytes: 0, 64, 128 or 256). gpu.tensor_map encodes it; an emitted header builds
    the same with cuTensorMapEncodeTiled."""

    tensor: str
    dtype: str
    dims: tuple[int, ...]
    strides: tuple[int, ...]
    box: tuple[int, ...]
    swizzle: int
    l2_promotion: int

    def to_dict(self) -> dict[str, Any]:
        return {key: list(value) if isinstance(value, tuple) else value for key, value in asdict(self).items()}


def tensor_maps(op: Any, shape: Any, params: Any) -> dict[str, TensorMapSpec]:
    """The TMA tensor maps an op's kernel takes after its pointers, by parameter name; most ops take none."""
    maps = getattr(op, "tensor_maps", None)
    return maps(shape, params) if maps is not None else {}


@dataclass(frozen=True)
class Arg:
    """One kernel parameter, in launch order. kind: 'out' | 'in' (buffers of `dtype` elements), 'i32', 'f32', or
    a buffer the kernel needs beside its tensors, of `elements` 32-bit words: 'scratch' (anything on entry: the
    kernel writes before it reads; a gate fills it with NaN) or 'zeroed' (all zero on entry, and left all zero by
    the kernel, which a gate checks after the launch)."""

    name: str
    kind: str
    dtype: str = "float32"  # of a buffer's elements (torch's name; 'uint32' for a zeroed buffer of counters)
    elements: int = 0  # of a scratch or zeroed buffer


WORKING_KINDS = ("scratch", "zeroed")  # buffers an op's launch needs beside its tensors


def launch_args(op: Any, shape: Any, params: Any) -> tuple[Arg, ...]:
    """The kernel's parameters for these params: op.args(shape), and where the params need working buffers (a
    split-K workspace and its counters), those after the tensors (op.launch_args)."""
    extra = getattr(op, "launch_args", None)
    return extra(shape, params) if extra is not None else op.args(shape)


class Op(Protocol):
    name: str
    peer_builder: LazyFunction | None  # OpFamily's declarations
    device_case: LazyFunction | None
    default_candidates: tuple[Mapping[str, Any], ...]
    torch_name: str | None
    runtime_name: str | None
    field_help: Mapping[str, str]
    tolerance: float  # largest accepted ‖out − ref‖ / ‖ref‖ of an fp32 output
    params_type: type
    shape_dims: tuple[str, ...]  # what the kernel is generated for, e.g. ('d',)
    run_dims: tuple[str, ...]  # sizes given at launch, e.g. ('m',)
    run_defaults: dict[str, int]  # for the CLI, where a launch size is not given
    shape_options: tuple[str, ...]  # the shape's fields beside its sizes (a norm's dtype), set by name
    min_arch: int  # oldest sm_XY its templates build for, as XY (matmul's cp.async needs 80)

    def shape(self, **dims: Any) -> Any: ...
    # min_arch, or newer where the shape (16-bit rows) or the params (an sm_90 instruction) need more
    def min_arch_of(self, shape: Any, params: Any = None) -> int: ...
    def args(self, shape: Any) -> tuple[Arg, ...]: ...  # the kernel's parameters, pointers first
    def output_dtypes(self, shape: Any) -> dict[str, DType]: ...
    def tolerance_of(self, shape: Any, output: str, dtype: DType) -> float: ...  # the gate's bound
    def validate(self, shape: Any, params: Any) -> None: ...
    def source(self, shape: Any, params: Any) -> Source: ...
    def geometry(self, shape: Any, params: Any, run: dict[str, int]) -> Launch: ...
    def make_inputs(self, shape: Any, run: dict[str, int], rng: np.random.Generator) -> dict[str, np.ndarray]: ...
    def output_shapes(self, shape: Any, run: dict[str, int]) -> dict[str, tuple[int, ...]]: ...
    def scalars(self, shape: Any, run: dict[str, int]) -> dict[str, int | float]: ...
    def reference(self, shape: Any, inputs: dict[str, np.ndarray], scalars: dict[str, int | float]) -> dict[str, np.ndarray]: ...
    def gate_runs(self, shape: Any, run: dict[str, int], params: Any) -> list[dict[str, int]]: ...
    def params_from_dict(self, values: dict[str, Any]) -> Any: ...
    def params_from_user(self, values: dict[str, Any]) -> Any: ...  # refuses test-only fields
    def defaults(self, shape: Any) -> dict[str, Any]: ...  # default fields that depend on the shape
    def fit_space(self, shape: Any, axes: dict[str, tuple]) -> dict[str, tuple]: ...  # a preset for this shape
    def params_to_dict(self, params: Any) -> dict[str, Any]: ...
    def check_run(self, run: dict[str, int]) -> None: ...
    def launch_formula(self, shape: Any, params: Any) -> dict[str, Any]: ...
    def slug(self, shape: Any) -> str: ...
    def shape_key(self, shape: Any) -> str: ...
    def kernel_name(self, shape: Any, params: Any) -> str: ...
    def bytes_moved(self, shape: Any, run: dict[str, int]) -> int: ...
    # What code calling the emitted kernel must guarantee, as plain JSON data: per pointer argument its dtype,
    # shape, layout and the alignment the generated loads and stores assume; aliasing; each scalar's range.
    def contract(self, shape: Any, params: Any) -> dict[str, Any]: ...
    def peers(self, shape: Any, inputs: dict[str, np.ndarray], eps: float, inductor: bool,
              tensor_of: Callable[[str, DType], Any], output_of: Callable[..., Any]) -> dict[str, Any]: ...
    def params_from_format_2(self, params: dict[str, Any], shape: dict[str, Any]) -> dict[str, Any]: ...
