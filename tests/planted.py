"""Planted layer-norm bugs and faults, made by editing a clean variant's generated source (for the tests
of the gate and of the worker only): each edit must apply exactly once, so a template change that moves
the code fails loudly."""

import dataclasses
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from mage_gen.census import take_census
from mage_gen.compile import compile_source
from mage_gen.ops import get_op
from mage_gen.variants import Variant, build

OP = get_op("layernorm")
# d = 768 with 128 threads of 4-float vectors: 4 warps per row (two barriers) and a half-used last slot
SHAPE = OP.shape(d=768)
PARAMS = OP.params_type(template="row", threads=128, vector=16)
_BARRIER = 'asm volatile("bar.sync 0;" ::: "memory");'
_STORE_GUARD = re.compile(r"if \(1 \* 128 \+ lane < r\.nvec\) \{(?=\n\s*const int col)")
BUGS = {
    # the second reduction reads the shared partial sums before every warp has written them
    "missing_barrier": lambda text: _nth(text, _BARRIER, 2, ""),
    # the half-used slot stores one vector past the end of the row
    "tail_off_by_one": lambda text: _once(text, _STORE_GUARD, "if (1 * 128 + lane <= r.nvec) {"),
    # the row's last vector is never stored
    "last_element_never_written": lambda text: _once(text, _STORE_GUARD, "if (1 * 128 + lane < r.nvec - 1) {"),
}


def _nth(text: str, needle: str, n: int, replacement: str) -> str:
    parts = text.split(needle)
    assert len(parts) == 3, f"expected {n} of {needle!r}, found {len(parts) - 1}"
    return needle.join(parts[:n]) + replacement + needle.join(parts[n:])


def _once(text: str, pattern: re.Pattern, replacement: str | Callable[[re.Match], str]) -> str:
    changed, count = pattern.subn(replacement, text)
    assert count == 1, f"the planted edit matched {count} times"
    return changed


def variant(arch: str, bug: str | None = None) -> Variant:
    clean = build(OP, SHAPE, PARAMS, arch)
    if bug is None:
        return clean
    return _edited(clean, BUGS[bug], arch)


def _edited(clean: Variant, edit: Callable[[str], str], arch: str) -> Variant:
    """The clean variant with its source edited, compiled again and counted."""
    source = dataclasses.replace(clean.source, text=edit(clean.source.text))
    compiled = compile_source(source, arch)
    return dataclasses.replace(clean, source=source, compiled=compiled, census=take_census(compiled))


# ---- planted faults: kernels that do not merely compute wrong, but break the launch or the context ----

# Where the kernel body begins: a fault planted here runs before anything else the kernel does.
_KERNEL_ENTRY = re.compile(r'extern "C" __global__ void [^{]*\{\n')
_LAUNCH_BOUNDS = re.compile(r"__launch_bounds__\(\d+, 1\)\s*")
# 1024 threads a block (8 rows of 128): the register file's 65536 then leave each thread 64 registers
MANY_THREADS = OP.params_type(template="multirow", threads=128, vector=16, rows_per_block=8)
REGISTER_FILE = 65536  # 32-bit registers one block may use, on every GPU since sm_50
HELD_VALUES = 160  # floats the register hog keeps live at once

_STORE_FAR_AWAY = """\
    if (blockIdx.x == 0 && threadIdx.x == 0) {  // planted: one store 256 GB past the end of y
        asm volatile("st.global.f32 [%0], %1;" :: "l"(y + ((size_t)1 << 36)), "f"(0.f) : "memory");
    }
"""
_SPIN_FOREVER = """\
    {  // planted: every thread spins on a shared flag that stays 1, so the kernel never finishes
        __shared__ int spin_flag;
        volatile int* flag = &spin_flag;
        *flag = 1;
        while (*flag == 1) { }
    }
"""
_HOLD_MANY_VALUES = f"""\
    {{  // planted: {HELD_VALUES} values live at once, used only by a store no launch takes (M is never < 0)
        float held[{HELD_VALUES}];
#pragma unroll
        for (int i = 0; i < {HELD_VALUES}; ++i)  // volatile, in order: none may be loaded late, where it is used
            asm volatile("ld.volatile.global.f32 %0, [%1];" : "=f"(held[i]) : "l"(w + i) : "memory");
        float folded = 0.f;
#pragma unroll
        for (int i = {HELD_VALUES - 1}; i >= 0; --i) folded = fmaf(folded, 1.0001f, held[i]);
        if (M < 0) y[threadIdx.x] = folded;
    }}
"""
_HOARD_SHARED = """\
    {  // planted: 228 KB of static shared memory, more than any block may have (227 KB on sm_90)
        __shared__ float hoard[58368];
        volatile float* slot = hoard;
        slot[threadIdx.x] = 0.f;
    }
"""


@dataclass(frozen=True)
class Fault:
    """A planted fault: the clean variant it starts from, and the edit of that variant's source."""

    params: Any
    edit: Callable[[str], str]
    refused_at_compile: bool = False  # ptxas rejects it: no cubin, so nothing reaches the GPU


FAULTS = {
    # an illegal address: the launch fails and the CUDA context is unusable after it
    "out_of_bounds_write": Fault(PARAMS, lambda text: _at_entry(text, _STORE_FAR_AWAY)),
    # the kernel never returns: only the worker's timeout ends the trial
    "endless_loop": Fault(PARAMS, lambda text: _at_entry(text, _SPIN_FOREVER)),
    # registers × 1024 threads over the register file: the launch is refused (out of resources)
    "too_many_registers": Fault(MANY_THREADS, lambda text: _at_entry(_without_launch_bounds(text),
                                                                      _HOLD_MANY_VALUES)),
    # static shared memory is capped at 48 KB when compiling, and a layer norm asks for no dynamic shared
    # memory, so ptxas refuses this before any launch could
    "too_much_shared_memory": Fault(PARAMS, lambda text: _at_entry(text, _HOARD_SHARED), refused_at_compile=True),
}
LAUNCHED = sorted(name for name, fault in FAULTS.items() if not fault.refused_at_compile)
REFUSED_AT_COMPILE = sorted(name for name, fault in FAULTS.items() if fault.refused_at_compile)


def _at_entry(text: str, code: str) -> str:
    return _once(text, _KERNEL_ENTRY, lambda found: found.group(0) + code)


def _without_launch_bounds(text: str) -> str:
    """Without __launch_bounds__, ptxas may give each thread up to 255 registers, whatever the block size."""
    return _once(text, _LAUNCH_BOUNDS, "")


def fault_variant(arch: str, fault: str) -> Variant:
    """The clean variant of FAULTS[fault] with the fault planted; CompileError where ptxas refuses it."""
    planted = FAULTS[fault]
    return _edited(build(OP, SHAPE, planted.params, arch), planted.edit, arch)
