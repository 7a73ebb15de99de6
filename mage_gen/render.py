"""Render a variant's template into CUDA C++ source. Pure: the same op, shape and params give the same text."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from typing import Any

import jinja2
import jinja2.meta

from mage_gen.errors import ConfigError
from mage_gen.resources import data_dir


@dataclass(frozen=True)
class Source:
    text: str
    kernel_name: str
    template: str
    template_hash: str  # of every template file the render read
    params: Any

    @property
    def source_hash(self) -> str:
        """Of the kernel's text: a winner is stale when the text its params render to has changed, whatever
        changed it (a template, or the op module that fills it in), and only then."""
        return hashlib.sha256(self.text.encode()).hexdigest()[:16]


# ---- helpers the PTX vocabulary calls; they keep string logic out of the templates ----

# a load's state space and cache operator, as they follow `ld`; volatile: issued where it is written, never hoisted
# out of its loop or merged with another load of the address (it takes no cache policy)
_LOAD_HINTS = {"": ".global", "nc": ".global.nc", "nc_na": ".global.nc.L1::no_allocate", "cg": ".global.cg",
               "cs": ".global.cs", "volatile": ".volatile.global",
               # L1 eviction priorities (sm_70): a line read again soon, a line's last read
               "nc_l1_last": ".global.nc.L1::evict_last", "nc_l1_first": ".global.nc.L1::evict_first"}
_STORE_HINTS = {"": "", "cs": ".cs", "cg": ".cg"}


def _vec(regs: Sequence[str]) -> str:
    return {1: "", 2: ".v2", 4: ".v4"}[_width(regs)]


def _width(regs: Sequence[str]) -> int:
    if isinstance(regs, str) or len(regs) not in (1, 2, 4):
        raise jinja2.TemplateRuntimeError(f"a PTX vector holds 1, 2 or 4 registers, got {regs!r}")
    return len(regs)


def _operands(regs: Sequence[str], start: int = 0) -> str:
    names = [f"%{start + i}" for i in range(_width(regs))]
    return names[0] if len(names) == 1 else "{" + ", ".join(names) + "}"


# The inline-asm constraint of a register of each PTX type a memory instruction moves: a float, or 32 bits
# holding two bf16/f16 halves.
_CONSTRAINTS = {"f32": "f", "b32": "r"}


def _constraint(kind: str) -> str:
    if kind not in _CONSTRAINTS:
        raise jinja2.TemplateRuntimeError(f"a memory instruction moves {sorted(_CONSTRAINTS)} registers, got {kind!r}")
    return _CONSTRAINTS[kind]


def _outputs(regs: Sequence[str], kind: str = "f32") -> str:
    return ", ".join(f'"={_constraint(kind)}"({r})' for r in regs)


def _inputs(regs: Sequence[str], kind: str = "f32") -> str:
    return ", ".join(f'"{_constraint(kind)}"({r})' for r in regs)


def _braced(count: int, start: int = 0) -> str:
    """{%start, ..., %start+count-1}: a register list that PTX wants in braces whatever its length (mma,
    ldmatrix)."""
    return "{" + ", ".join(f"%{start + i}" for i in range(count)) + "}"


def _inouts(regs: Sequence[str], kind: str = "f32") -> str:
    return ", ".join(f'"+{_constraint(kind)}"({r})' for r in regs)


_MMA_SHAPES = {"bf16": "m16n8k16", "f16": "m16n8k16", "tf32": "m16n8k8"}


def _mma_shape(dtype: str) -> str:
    if dtype not in _MMA_SHAPES:
        raise jinja2.TemplateRuntimeError(f"mma inputs are one of {sorted(_MMA_SHAPES)}, got {dtype!r}")
    return _MMA_SHAPES[dtype]


_WGMMA_K = {"bf16": 16, "f16": 16, "e4m3": 32}  # K of one wgmma: 32 bytes of each input's rows


def _wgmma_shape(accumulators: int, dtype: str) -> str:
    """m64nNk16 (16-bit inputs) or m64nNk32 (fp8) of a wgmma whose thread holds `accumulators` floats (N/2): N a
    multiple of 8 up to 256."""
    n = 2 * accumulators
    if dtype not in _WGMMA_K or n % 8 or not 8 <= n <= 256:
        raise jinja2.TemplateRuntimeError(f"wgmma m64nNk takes {sorted(_WGMMA_K)} inputs and N a multiple of 8 in "
                                          f"8..256 (4..128 accumulators a thread), got {dtype!r} and {accumulators}")
    return f"m64n{n}k{_WGMMA_K[dtype]}"


def _ptx_tag(tag: str) -> str:
    return f" // tensor={tag}" if tag else ""


def _cache_policy_operand(regs: Sequence[str], policy: str | None) -> str:
    """The policy operand of a load of `regs` under an L2 cache policy: after the destinations and the address."""
    return "" if policy is None else f", %{len(regs) + 1}"


def _cache_policy_input(policy: str | None) -> str:
    return "" if policy is None else f', "l"({policy})'


def _hint(table: dict[str, str], hint: str) -> str:
    if hint not in table:
        raise jinja2.TemplateRuntimeError(f"unknown cache hint {hint!r}; known: {sorted(table)}")
    return table[hint]


# A load hint may name how much L2 fetches from DRAM on a miss, after an @: 'nc@256' is the read-only path with
# .L2::256B. The qualifier follows .L2::cache_hint in PTX, so the macros place it apart from the hint's others.
L2_FETCH_BYTES = (64, 128, 256)


def _split_load_hint(hint: str) -> tuple[str, int]:
    base, at, size = hint.partition("@")
    if not at:
        return hint, 0
    if not size.isdigit() or int(size) not in L2_FETCH_BYTES:
        raise jinja2.TemplateRuntimeError(f"L2 fetch size of load hint {hint!r} must be one of {L2_FETCH_BYTES}")
    if base == "volatile":
        raise jinja2.TemplateRuntimeError(f"load hint {hint!r}: a volatile load takes no L2 fetch size")
    return base, int(size)


def _load_hint(hint: str) -> str:
    return _hint(_LOAD_HINTS, _split_load_hint(hint)[0])


def _load_fetch(hint: str) -> str:
    size = _split_load_hint(hint)[1]
    return f".L2::{size}B" if size else ""


def _cp_level(level: str, nbytes: int) -> str:
    if nbytes not in (4, 8, 16):
        raise jinja2.TemplateRuntimeError(f"cp.async copies 4, 8 or 16 bytes, got {nbytes}")
    if level == "cg" and nbytes != 16:
        raise jinja2.TemplateRuntimeError("cp.async.cg copies 16 bytes only; use level 'ca'")
    if level not in ("ca", "cg"):
        raise jinja2.TemplateRuntimeError(f"cp.async level is 'ca' or 'cg', got {level!r}")
    return level


def _butterfly(width: int) -> list[int]:
    if width not in (1, 2, 4, 8, 16, 32):
        raise jinja2.TemplateRuntimeError(f"a shuffle group is a power of two up to 32 lanes, got {width}")
    return [width >> i for i in range(1, width.bit_length())]


def _regs(array: str, count: int, start: int = 0) -> list[str]:
    return [f"{array}[{i}]" for i in range(start, start + count)]


HALF_TYPES = ("bf16", "f16")


def _half_type(dtype: str) -> str:
    if dtype not in HALF_TYPES:
        raise jinja2.TemplateRuntimeError(f"a packed half is one of {HALF_TYPES}, got {dtype!r}")
    return dtype


def _fail(message: str) -> None:
    raise jinja2.TemplateRuntimeError(message)


@cache
def environment() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(data_dir("templates")),
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
        autoescape=False,
    )
    env.globals.update(
        vec=_vec,
        operands=_operands,
        outputs=_outputs,
        inputs=_inputs,
        ptx_tag=_ptx_tag,
        braced=_braced,
        inouts=_inouts,
        mma_shape=_mma_shape,
        wgmma_shape=_wgmma_shape,
        cache_policy_operand=_cache_policy_operand,
        cache_policy_input=_cache_policy_input,
        ld_hint=_load_hint,
        ld_fetch=_load_fetch,
        st_hint=lambda h: _hint(_STORE_HINTS, h),
        cp_level=_cp_level,
        butterfly=_butterfly,
        regs=_regs,
        half_type=_half_type,
        fail=_fail,
    )
    return env


@cache
def template_hash(name: str) -> str:
    """sha256 over the template and everything it imports or includes, in a fixed order."""
    env = environment()
    seen: dict[str, str] = {}
    pending = [name]
    while pending:
        current = pending.pop()
        if current in seen:
            continue
        text, _, _ = env.loader.get_source(env, current)
        seen[current] = text
        pending.extend(t for t in jinja2.meta.find_referenced_templates(env.parse(text)) if t)
    digest = hashlib.sha256()
    for key in sorted(seen):
        digest.update(key.encode() + b"\0" + seen[key].encode() + b"\0")
    return digest.hexdigest()[:16]


def render(template: str, context: dict[str, Any], kernel_name: str, params: Any) -> Source:
    try:
        text = environment().get_template(template).render(kernel_name=kernel_name, **context)
    except jinja2.TemplateRuntimeError as exc:
        raise ConfigError(f"template {template}: {exc}") from None
    return Source(text=text, kernel_name=kernel_name, template=template,
                  template_hash=template_hash(template), params=params)
