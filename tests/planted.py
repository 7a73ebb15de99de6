"""Planted layer-norm bugs, made by editing a clean variant's generated source (for the tests of the
gate only): each edit must apply exactly once, so a template change that moves the code fails loudly."""

import dataclasses
import re

from mage_gen.census import take_census
from mage_gen.compile import compile_source
from mage_gen.ops import get_op
from mage_gen.variants import Variant, build

OP = get_op("layernorm")
# d = 768 with 128 threads of 4-float vectors: 4 warps per row (two barriers) and a half-used last slot
SHAPE = OP.shape(d=768)
PARAMS = OP.params_type(template="row", threads=128, vector=4)
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


def _once(text: str, pattern: re.Pattern, replacement: str) -> str:
    changed, count = pattern.subn(replacement, text)
    assert count == 1, f"the planted edit matched {count} times"
    return changed


def variant(arch: str, bug: str | None = None) -> Variant:
    clean = build(OP, SHAPE, PARAMS, arch)
    if bug is None:
        return clean
    source = dataclasses.replace(clean.source, text=BUGS[bug](clean.source.text))
    compiled = compile_source(source, arch)
    return dataclasses.replace(clean, source=source, compiled=compiled, census=take_census(compiled))
