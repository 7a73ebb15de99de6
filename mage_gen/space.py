"""Search spaces: search/<op>.toml read into the axes of a preset, and expanded into valid params."""

from __future__ import annotations

import itertools
import math
import random
import re
import tomllib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, fields, is_dataclass, replace
from pathlib import Path
from typing import Any

from mage_gen.compile import arch_number
from mage_gen.errors import ConfigError
from mage_gen.ops import Op
from mage_gen.ops.base import WAVES, OpFamily
from mage_gen.resources import data_dir


@dataclass(frozen=True)
class Space:
    op: str
    preset: str
    axes: tuple[tuple[str, tuple[Any, ...]], ...]  # ordered (name, values)
    # configs a study measures first wherever the preset holds them, each as the (axis, value) pairs it names,
    # every other axis at the op's default: the shapes of the peers' kernels, so that no search over a space
    # that holds a peer's shape can miss it
    first: tuple[tuple[tuple[str, Any], ...], ...] = ()
    # the spec gives some axis values per SM ("4/SM", "waves") and no SM count was given: those values are left out
    needs_sms: bool = False

    def narrowed(self, **values: tuple[Any, ...]) -> Space:
        """The same space with some axes given fewer values."""
        return replace(self, axes=tuple((name, tuple(values.get(name, v))) for name, v in self.axes))

    def combinations(self) -> Iterator[dict[str, Any]]:
        names = [name for name, _ in self.axes]
        for values in itertools.product(*(values for _, values in self.axes)):
            yield dict(zip(names, values))


def _spec(op_name: str) -> tuple[Path, dict[str, Any]]:
    path = data_dir("search") / f"{op_name}.toml"
    try:
        return path, tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"space: cannot read {path}: {exc}") from None


def preset_names(op_name: str) -> list[str]:
    return list(_spec(op_name)[1].get("presets", {}))


# An axis value given per SM ("4/SM"): that many times the SM count of the GPU the space is expanded for
_PER_SM = re.compile(r"(\d+)/SM")


def load_space(op: Op, preset: str | None = None, shape: Any = None, sms: int | None = None) -> Space:
    """A preset's axes; with a shape, as the op fits them to it (op.fit_space). sms: the SM count of the GPU the
    space is for, which a value given per SM ("4/SM") is multiplied by; without it such values are left out."""
    path, spec = _spec(op.name)
    presets = spec.get("presets", {})
    preset = preset or default_preset(op, shape)
    if preset not in presets:
        raise ConfigError(f"preset: unknown preset {preset!r} for {op.name}; use one of {', '.join(presets)}")
    axes = dict(spec["axes"])
    for name, values in _narrowed(presets, preset, path.name).items():
        if name not in axes:
            raise ConfigError(f"space: preset {preset} of {path.name} narrows unknown axis {name!r}")
        axes[name] = values
    fitted = {k: _on_device(v, sms) for k, v in axes.items()}
    needs_sms = sms is None and any(isinstance(v, str) and (_PER_SM.fullmatch(v) or v == WAVES)
                                    for vs in axes.values() for v in vs)
    if shape is not None and sms is not None:
        fitted = op.fit_device(shape, fitted, sms)
    fitted = {k: tuple(v for v in values if v != WAVES) for k, values in fitted.items()}  # unresolved: left out
    if shape is not None:
        fitted = op.fit_space(shape, fitted)
    return Space(op=op.name, preset=preset, axes=tuple(fitted.items()), first=_first(path, spec, sms),
                 needs_sms=needs_sms)


def _narrowed(presets: dict[str, Any], preset: str, spec_name: str) -> dict[str, Any]:
    """The axes a preset narrows: those of the preset it names as its `base` (and so on down), then its own."""
    chain = [preset]
    while (base := presets[chain[-1]].get("base")) is not None:
        if base not in presets or base in chain:
            why = "is not a preset" if base not in presets else "leads back to itself"
            raise ConfigError(f"space: the base {base!r} of preset {chain[-1]} in {spec_name} {why}; name another "
                              f"preset of the spec ({', '.join(presets)})")
        chain.append(base)
    narrowed: dict[str, Any] = {}
    for name in reversed(chain):
        narrowed.update({axis: values for axis, values in presets[name].items() if axis != "base"})
    return narrowed


def default_preset(op: Op, shape: Any = None) -> str:
    """The preset a shape gets when none is named: the first of the spec's default_by_size whose up_to bounds hold
    the shape (each a size of it at most), else default_preset, else full."""
    path, spec = _spec(op.name)
    presets = spec.get("presets", {})
    for rule in spec.get("default_by_size", []):
        bounds = rule.get("up_to")
        if rule.get("preset") not in presets or not isinstance(bounds, dict) or not bounds \
                or any(size not in op.shape_dims or not isinstance(at_most, int) for size, at_most in bounds.items()):
            raise ConfigError(f"space: each default_by_size of {path.name} takes a preset of the spec and up_to, "
                              f"sizes of {', '.join(op.shape_dims)} at most a whole number each; got {rule}")
        if shape is not None and all(getattr(shape, size) <= at_most for size, at_most in bounds.items()):
            return rule["preset"]
    return spec.get("default_preset") or "full"


def _on_device(values: list[Any], sms: int | None) -> tuple[Any, ...]:
    per_sm = [(v, _PER_SM.fullmatch(v) if isinstance(v, str) else None) for v in values]
    return tuple(int(m[1]) * sms if m else v for v, m in per_sm if not m or sms is not None)


def _first(path: Path, spec: dict[str, Any], sms: int | None) -> tuple[tuple[tuple[str, Any], ...], ...]:
    """[first] of the spec: lists of axis values, every combination of them one config; [[first]], several such
    tables (one peer's shape each), their configs in the order written. A value given per SM is sized for sms, and
    without it the configs that name one are left out, as the axes leave such values out."""
    tables = spec.get("first", {})
    configs: list[tuple[tuple[str, Any], ...]] = []
    for table in tables if isinstance(tables, list) else [tables]:
        unknown = sorted(set(table) - set(spec["axes"]))
        if unknown:
            raise ConfigError(f"space: [first] of {path.name} names unknown axes {', '.join(unknown)}")
        lists = [(name, values) for name, values in table.items()]
        if any(not isinstance(values, list) or not values for _, values in lists):
            raise ConfigError(f"space: each axis of [first] in {path.name} takes a non-empty list of values")
        names = [name for name, _ in lists]
        lists = [(name, _on_device(values, sms)) for name, values in lists]
        configs += [tuple(zip(names, values)) for values in itertools.product(*(v for _, v in lists))]
    return tuple(dict.fromkeys(configs))


def expand(op: Op, shape: Any, space: Space, arch: str | None = None) -> tuple[list[Any], list[tuple[Any, str]]]:
    """Every combination of the space for this shape, split into valid params and (params, rule broken); with
    arch, a config whose instructions that arch lacks (l2_ahead's sm_90 prefetch) is rejected too."""
    kept, counted = _expand(op, shape, space, arch, keep_rejected=True)
    return counted.valid, kept


@dataclass(frozen=True)
class Tally:
    """A space expanded as a command needs it: the valid params, how many combinations were rejected and the first
    one's reason (expand's rejected[0]), without making the rejected params: a full preset rejects 10⁷."""

    valid: list[Any]
    rejected: int
    first_rejection: str | None


def tally(op: Op, shape: Any, space: Space, arch: str | None = None) -> Tally:
    return _expand(op, shape, space, arch, keep_rejected=False)[1]


def valid_params(op: Op, shape: Any, space: Space, arch: str | None = None) -> list[Any]:
    """expand's valid params alone, without making the rejected ones."""
    return tally(op, shape, space, arch).valid


class _Rejections:
    """The rejected combinations in order: kept as (params, reason) where asked, counted, and the first reason."""

    def __init__(self, keep: bool):
        self.kept: list[tuple[Any, str]] | None = [] if keep else None
        self.count = 0
        self.first: str | None = None

    def add(self, params: Any, reason: str) -> None:
        self.add_many(1, reason, lambda: [params])

    def add_many(self, count: int, reason: str, params: Callable[[], Iterable[Any]]) -> None:
        """count combinations all rejected for one reason; params() makes them, only where they are kept."""
        self.count += count
        self.first = self.first if self.first is not None else reason
        if self.kept is not None:
            self.kept.extend((p, reason) for p in params())


def _expand(op: Op, shape: Any, space: Space, arch: str | None,
            keep_rejected: bool) -> tuple[list[tuple[Any, str]] | None, Tally]:
    """(the rejected (params, reason) where kept, else None; the tally)."""
    make = _checked_maker(op, space)
    rejected = _Rejections(keep_rejected)
    # validate is the op's rule table, over a dataclass
    if getattr(op.validate, "__func__", None) is OpFamily.validate and is_dataclass(op.params_type) and space.axes:
        valid = _expand_by_rules(op, shape, space, arch, rejected)
    else:
        valid = []
        for values in space.combinations():
            params = make(values)
            if (reason := rejection(op, shape, params, arch)) is None:
                valid.append(params)
            else:
                rejected.add(params, reason)
    return rejected.kept, Tally(valid, rejected.count, rejected.first)


def rejection(op: Op, shape: Any, params: Any, arch: str | None = None) -> str | None:
    """The rule these params break for this shape (and, with arch, the instruction that arch lacks), or None."""
    try:
        op.validate(shape, params)
    except ConfigError as exc:
        return str(exc)
    return _arch_rejection(op, shape, params, arch)


def _arch_rejection(op: Op, shape: Any, params: Any, arch: str | None) -> str | None:
    if arch and (needed := op.min_arch_of(shape, params)) > arch_number(arch):
        return f"arch: {op.kernel_name(shape, params)} needs sm_{needed}, not {arch}"
    return None


# the most combinations of the last axes held as dicts at once, for a sub-product rejected (or accepted) whole
_TAILS_HELD = 4096
# a sub-product of at most this many combinations whose rules are not yet decided is checked config by config
_CHECKED_ONE_BY_ONE = 64


class _Unassigned(BaseException):
    """A rule read a field that a partial config has not been given yet (BaseException: no rule's own `except
    Exception` may take it for an answer)."""


_UNDECIDED = object()


def _partial_type(params_type: type) -> type:
    """A subclass of the op's Params whose instances may hold only some fields: reading a missing one raises
    _Unassigned, so a rule that reads none of them gives the answer it gives for every completion."""
    names = frozenset(f.name for f in fields(params_type))

    def __getattribute__(self: Any, name: str) -> Any:
        if name in names:
            given = object.__getattribute__(self, "__dict__")
            if name not in given:
                raise _Unassigned(name)
            return given[name]
        return object.__getattribute__(self, name)

    return type(f"Partial{params_type.__name__}", (params_type,), {"__getattribute__": __getattribute__})


def _decided(function: Callable[..., Any], shape: Any, partial: Any) -> Any:
    """function(shape, partial), or _UNDECIDED where it reads a field not given (or fails: the full config then
    meets the same rule through op.validate, which raises as it always did)."""
    try:
        return function(shape, partial)
    except (_Unassigned, Exception):
        return _UNDECIDED


def _expand_by_rules(op: Op, shape: Any, space: Space, arch: str | None, rejected: _Rejections) -> list[Any]:
    """expand for an op whose validate is its rule table (OpFamily.validate), with the same lists in the same order.
    The axes are assigned one at a time, in the order space.combinations() varies them, and each rule is asked of the
    partial config once its answer no longer depends on the axes still open: where the first rule broken, and its
    message, are decided by the axes given so far, every combination of the rest is rejected with that message
    without checking each (a full preset of 10⁷ combinations is mostly such sub-products: the full layernorm preset
    at d = 768 took 138 s checked config by config, about 70 s so, most of it making the 1.4·10⁷ Params)."""
    names = [name for name, _ in space.axes]
    axes = [values for _, values in space.axes]
    params_type = op.params_type  # as _checked_maker makes them, every axis value having passed its checks
    partial_type = _partial_type(params_type)

    def partial_of(given: dict[str, Any]) -> Any:
        partial = object.__new__(partial_type)
        partial.__dict__.update(given)
        return partial

    # A rule that holds for each value of one axis whatever the others are (most check that a value is one the
    # op knows) holds for every combination: it can break none, so it is left out rather than left to block the
    # rules after it until its axis is given.
    def holds_everywhere(rule: Any) -> bool:
        return any(all(_decided(rule.holds, shape, partial_of({name: value})) is True for value in values)
                   for name, values in space.axes)

    rules = [rule for rule in op.rules if not holds_everywhere(rule)]
    valid: list[Any] = []

    def file(params: Any, reason: str | None) -> None:
        if reason is None:
            valid.append(params)
        else:
            rejected.add(params, reason)

    # the combinations of the axes from each depth on, as dicts, where there are few enough to hold
    behind = [math.prod(len(values) for values in axes[depth:]) for depth in range(len(axes) + 1)]
    tails: dict[int, list[dict[str, Any]]] = {}

    def every(depth: int, given: dict[str, Any]) -> Iterator[Any]:
        if behind[depth] > _TAILS_HELD:
            for value in axes[depth]:
                yield from every(depth + 1, {**given, names[depth]: value})
            return
        if depth not in tails:
            tails[depth] = [dict(zip(names[depth:], values)) for values in itertools.product(*axes[depth:])]
        for rest in tails[depth]:
            yield params_type(**given, **rest)

    def walk(depth: int, given: dict[str, Any], holding: int, broken: int | None) -> None:
        # rules[:holding] hold for every completion of `given`; broken: the first rule every completion breaks
        partial = partial_of(given)
        if broken is None:
            while holding < len(rules):
                holds = _decided(rules[holding].holds, shape, partial)
                if holds is _UNDECIDED:
                    break
                if not holds:
                    broken = holding
                    break
                holding += 1
        if broken is not None:
            message = _decided(rules[broken].message, shape, partial)
            if message is not _UNDECIDED:
                rejected.add_many(behind[depth], f"{rules[broken].name}: {message}", lambda: every(depth, given))
                return
        elif holding == len(rules):
            for params in every(depth, given):
                file(params, _arch_rejection(op, shape, params, arch))
            return
        if behind[depth] > _CHECKED_ONE_BY_ONE:
            for value in axes[depth]:
                walk(depth + 1, {**given, names[depth]: value}, holding, broken)
            return
        # few configs left: each is made and the rules not yet decided are asked of it, as validate asks them, which
        # costs less than partial configs on the way to it
        for params in every(depth, given):
            broken_here = rules[broken] if broken is not None else next(
                (rule for rule in rules[holding:] if not rule.holds(shape, params)), None)
            file(params, _arch_rejection(op, shape, params, arch) if broken_here is None
                 else f"{broken_here.name}: {broken_here.message(shape, params)}")

    walk(0, {}, 0, None)
    return valid


def _checked_maker(op: Op, space: Space) -> Callable[[dict[str, Any]], Any]:
    """op.params_type(**values) for the space's combinations, once every axis value has passed op.params_from_dict:
    its checks are of one field at a time, so a value that passes beside one combination passes beside all, and a
    full space (10⁶ combinations) is not checked field by field 10⁶ times."""
    first = next(space.combinations(), None)
    if first is None:
        return op.params_from_dict
    for name, values in space.axes:
        for value in values:
            op.params_from_dict({**first, name: value})
    return lambda values: op.params_type(**values)


def draw(op: Op, shape: Any, space: Space, rng: random.Random, attempts: int = 50_000) -> Any | None:
    """One valid params of the space, each equally likely, or None if `attempts` combinations drawn at random were
    all invalid: a full space has 10⁵ combinations and more, too many to expand for every example a test draws."""
    names = [name for name, _ in space.axes]
    sizes = [len(values) for _, values in space.axes]
    total = math.prod(sizes)
    for _ in range(attempts):
        index, values = rng.randrange(total), {}
        for name, (_, axis) in zip(names, space.axes):
            index, at = divmod(index, len(axis))
            values[name] = axis[at]
        params = op.params_from_dict(values)
        try:
            op.validate(shape, params)
        except ConfigError:
            continue
        return params
    return None
