"""The mage-gen command line: wires the pipeline stages together and prints with rich."""

from __future__ import annotations

import contextlib
import importlib
import os
import re
import signal
import json
import sys
import time
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any, Optional

import typer
from rich.console import Console

import mage_gen
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from mage_gen import dispatch
from mage_gen.census import Census
from mage_gen.compile import DEFAULT_ARCH, check_arch
from mage_gen.emit import check_out_dir, emit, shape_arguments
from mage_gen.errors import MageError, NoGpuError
from mage_gen.ops import OPS, Op, get_op
from mage_gen.ops.base import shape_dict
from mage_gen.space import load_space, preset_names, tally, valid_params
from mage_gen.store import (Winner, check_can_save, current_winners, entry_key, load_winners, pick_winner, save_entry,
                            shape_entries, stored_axes, stored_params, tuned_dirs, tuned_shapes)
from mage_gen.timing import OBJECTIVES, Timing, by_objective
from mage_gen.variants import Variant, build, build_each, check_op_arch

# What only `tune` needs (Optuna, the measuring worker, and through the final round torch and Triton) is
# imported inside it: every other command starts without them.
EXHAUSTIVE_LIMIT, DEFAULT_TPE_TRIALS = 64, 96  # mage_gen.tune's; a test holds the two in step
MANY_VARIANTS = 2000  # a compile of more says how long it may take before it starts
SEEDS = 3  # winners of the nearest tuned shapes a size class's search measures after its own (dispatch.SEED_RULE)

# Plain help: the rich help tags every flag with a type (--json <bool>), as if it took a value.
app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False, rich_markup_mode=None,
                  help="Generate, check and tune GPU kernels written with inline PTX.")
# Tables are wide; where output goes to a file or pipe, do not squeeze them into 80 columns.
out = Console(width=None if sys.stdout.isatty() else 160)
err = Console(stderr=True)

def _print_version(value: bool) -> None:
    if value:
        print(f"mage-gen {mage_gen.__version__}")
        raise typer.Exit()


@app.callback()
def _options(version: bool = typer.Option(False, "--version", callback=_print_version, is_eager=True,
                                          help="print mage-gen's version and exit")) -> None:
    """Generate, check and tune GPU kernels written with inline PTX."""


def _field_help(field: str) -> str:
    """The help of a shape field's option: what each op that has the field says of it, ops that say the same
    together ('layernorm, rmsnorm: row length')."""
    said: dict[str, list[str]] = {}
    for op in OPS.values():
        if field in op.field_help:
            said.setdefault(op.field_help[field], []).append(op.name)
    return "; ".join(f"{', '.join(names)}: {text}" for text, names in said.items())


OpArg = typer.Argument(..., help=f"op family: {', '.join(sorted(OPS))}")
DOpt = typer.Option(None, "--d", help=_field_help("d"))
MOpt = typer.Option(None, "--m", help=_field_help("m"))
NOpt = typer.Option(None, "--n", help=_field_help("n"))
KOpt = typer.Option(None, "--k", help=_field_help("k"))
DTypeOpt = typer.Option(None, "--dtype", help=_field_help("dtype"))
WeightDTypeOpt = typer.Option(None, "--weight-dtype", help=_field_help("weight_dtype"))
PrecisionOpt = typer.Option(None, "--precision", help=_field_help("precision"))
ArchOpt = typer.Option(DEFAULT_ARCH, "--arch", help="GPU architecture to compile for, e.g. sm_90, sm_80")
JsonOpt = typer.Option(False, "--json", help="print machine-readable JSON instead of a table")


def _preset_names() -> str:
    """'layernorm: quick, full; matmul: quick, ...', read from the search spaces (small TOML files)."""
    return "; ".join(f"{name}: {', '.join(preset_names(name))}" for name in sorted(OPS))


_PRESETS = _preset_names()


def _parse_sizes(op: Op, text: str) -> list[int] | str:
    """tune's --m: for an op sized at launch, one or more comma-separated run sizes or 'auto'; for an op whose
    entries are size classes over M (gemm_sm90), one or more M, a shape each; for another op whose M is fixed at
    generation, one number."""
    value = text.strip().lower()
    if value == "auto" and "m" in op.run_dims:
        return "auto"
    several = "m" in op.run_dims or "m" in op.class_dims
    parts = [part.strip() for part in value.split(",")]
    if not all(part.isdigit() for part in parts):
        allowed = ("a whole number, several separated by commas" + (", or auto" if "m" in op.run_dims else "")
                   if several else "a whole number")
        raise MageError(f"m: --m takes {allowed}, got {text!r}")
    if len(parts) > 1 and not several:
        raise MageError(f"m: {op.name} fixes M when it is generated; give one --m")
    return list(dict.fromkeys(int(part) for part in parts))


def _problem(op: Op, config: dict[str, Any] | None = None, **given: Any) -> tuple[Any, dict[str, int]]:
    """The op's generation-time shape and launch-time sizes from the size options given, and the shape's
    other fields (dtype, weight_dtype, residual) from the options or from --config."""
    options = op.shape_options
    dims = {name: given.get(name) for name in op.shape_dims}
    missing = [name for name, value in dims.items() if value is None]
    if missing:
        raise MageError(f"{op.name} needs {', '.join('--' + m for m in missing)}")
    stray = [name for name, value in given.items()
             if value is not None and name not in (*op.shape_dims, *op.run_dims, *options)]
    if stray:
        raise MageError(f"{op.name} takes no {', '.join('--' + s.replace('_', '-') for s in stray)}")
    for name, value in (config or {}).items():
        if name in options and given.get(name) is not None and given[name] != value:
            raise MageError(f"config: --{name.replace('_', '-')} {given[name]} and --config {name}={value} disagree; "
                            "give it once")
    dims.update({name: given[name] for name in options if given.get(name) is not None})
    dims.update({name: value for name, value in (config or {}).items() if name in options})
    shape = op.shape(**dims)
    run = {name: given[name] if given.get(name) is not None else op.run_defaults[name] for name in op.run_dims}
    op.check_run(run)
    return shape, run


def _split_config(op: Op, items: list[str]) -> tuple[dict[str, Any], dict[str, Any]]:
    """--config as (the shape's fields it names, e.g. residual=true; the params)."""
    values = _parse_config(items)
    options = op.shape_options
    return ({k: v for k, v in values.items() if k in options}, {k: v for k, v in values.items() if k not in options})


def _shape_only_config(op: Op, items: list[str]) -> dict[str, Any]:
    """--config of a command that searches the params: only the shape's fields (residual=true) may be set."""
    shape_values, params = _split_config(op, items)
    if params:
        options = op.shape_options
        raise MageError(f"config: here --config sets only {', '.join(options) or 'nothing'} for {op.name}, not "
                        f"{', '.join(sorted(params))}: the search space gives the parameters (--preset)")
    return shape_values


def _parse_config(items: list[str]) -> dict[str, Any]:
    values: dict[str, Any] = {}
    for item in items:
        for pair in filter(None, item.split(",")):
            key, sep, raw = pair.partition("=")
            if not sep:
                raise MageError(f"config: {pair!r} is not KEY=VALUE (e.g. --config rows_per_block=4)")
            key, value = key.strip().replace("-", "_"), _config_value(raw.strip())
            if key in values:
                raise MageError(f"config: {key} is given twice ({values[key]} and {value}); give it once")
            values[key] = value
    return values


def _config_value(raw: str) -> int | bool | str:
    """A --config value as the params field expects it: a whole number, true/false (matmul's split), or text.
    A whole number may carry a zero fraction (128.0), as the size options take it (--d 768.0)."""
    if raw.lstrip("-").isdigit():
        return int(raw)
    if re.fullmatch(r"-?\d+\.0*", raw):
        return int(raw.split(".")[0])
    if raw.lower() in ("true", "false"):
        return raw.lower() == "true"
    return raw


def _launch_dict(op: Op, shape: Any, params: Any, run: dict[str, int]) -> dict[str, Any]:
    launch = op.geometry(shape, params, run)
    return {"run": run, "grid": list(launch.grid), "block": list(launch.block), "cluster": list(launch.cluster),
            "dynamic_shared_bytes": launch.dynamic_shared_bytes,
            "static_shared_bytes": launch.static_shared_bytes}


def _variant_dict(op: Op, shape: Any, variant: Variant, run: dict[str, int]) -> dict[str, Any]:
    return {
        "op": op.name, "shape": shape_dict(shape), "params": op.params_to_dict(variant.params),
        "kernel": variant.source.kernel_name, "arch": variant.compiled.arch,
        "template": variant.source.template, "template_hash": variant.source.template_hash,
        "source_hash": variant.source.source_hash,
        "launch": _launch_dict(op, shape, variant.params, run),
        "census": variant.census.to_dict(),
    }


def _loads_summary(op: Op, shape: Any, c: Census) -> str:
    """Global loads of the op's first input that has any (layer norm's rows x, not a weight vector),
    e.g. 'x 2×v4'."""
    loaded = {tag.split(".")[0] for tag in c.global_loads}
    tensor = next((a.name for a in op.args(shape) if a.kind == "in" and a.name in loaded), None)
    return f"{tensor} {_widths(c.global_loads, tensor)}" if tensor else "–"


def _cp_async_summary(c: Census) -> str:
    return " ".join(f"{n}×{b}B" for b, n in c.cp_async.items()) or "–"


def _passes_summary(c: Census) -> str:
    return " ".join(f"{t}:{len(p)}" for t, p in c.load_passes.items() if t != "?") or "–"


# inspect's rows of the Hopper instructions the census counts, by the first word of their keys
_HOPPER_ROWS = {"wgmma": "wgmma", "tma": "TMA copies", "mbarrier": "mbarrier", "bulk.commit_group": "bulk groups",
                "bulk.wait_group": "bulk groups", "fence.proxy.async": "fences", "fence.mbarrier_init": "fences",
                "setmaxnreg.inc": "setmaxnreg", "setmaxnreg.dec": "setmaxnreg", "cluster": "cluster", "mapa": "cluster",
                "stmatrix": "stmatrix", "prefetch.tensormap": "tensor maps", "trap": "watchdog traps",
                # ordering across CTAs (split K): its atomics and gpu-scope fences
                "atom": "atomics", "red": "atomics", "fence": "fences", "membar": "fences"}


def _hopper_rows(c: Census) -> list[tuple[str, str]]:
    rows: dict[str, list[str]] = {}
    for key, count in c.hopper.items():
        label = next(row for prefix, row in _HOPPER_ROWS.items() if key.startswith(prefix))
        rows.setdefault(label, []).append(f"{key}: {count}")
    return [(label, ", ".join(items)) for label, items in rows.items()]


def _widths(table: dict[str, dict[str, int]], tensor: str) -> str:
    counts: dict[str, int] = {}
    for tag, widths in table.items():
        if tag.split(".")[0] == tensor:
            for width, n in widths.items():
                counts[width] = counts.get(width, 0) + n
    return " ".join(f"{n}×{w}" for w, n in sorted(counts.items())) or "–"


@app.command()
def inspect(
    op_name: str = OpArg, d: Optional[int] = DOpt, m: Optional[int] = MOpt, n: Optional[int] = NOpt,
    k: Optional[int] = KOpt,
    template: Optional[str] = typer.Option(None, help="template (layernorm: row, multirow, wide)"),
    threads: Optional[int] = typer.Option(None, help="threads per row"),
    vector: Optional[int] = typer.Option(None, help="bytes per global access of a row: 4, 8 or 16"),
    config: list[str] = typer.Option([], help="other parameters as KEY=VALUE[,KEY=VALUE] (residual=true: the "
                                              "fused residual form of a norm)"),
    dtype: Optional[str] = DTypeOpt, weight_dtype: Optional[str] = WeightDTypeOpt,
    precision: Optional[str] = PrecisionOpt,
    arch: str = ArchOpt, as_json: bool = JsonOpt,
    show_source: bool = typer.Option(False, "--source", help="also print the generated CUDA source"),
) -> None:
    """Render, compile and count one variant: registers, shared memory, loads, stores, barriers."""
    op = get_op(op_name)
    shape_config, values = _split_config(op, config)
    shape, run = _problem(op, shape_config, d=d, m=m, n=n, k=k, dtype=dtype, weight_dtype=weight_dtype,
                          precision=precision)
    check_op_arch(op, arch, shape)
    flags = {k: v for k, v in dict(template=template, threads=threads, vector=vector).items() if v is not None}
    both = sorted(key for key in flags if key in values and values[key] != flags[key])
    if both:
        raise MageError(f"config: --{both[0]} {flags[both[0]]} and --config {both[0]}={values[both[0]]} disagree; "
                        "give it once")
    params = op.params_from_user({**op.defaults(shape), **values, **flags})
    variant = build(op, shape, params, arch)
    if as_json:
        doc = _variant_dict(op, shape, variant, run)
        if show_source:
            doc["source"] = variant.source.text
        print(json.dumps(doc, indent=2))
        return
    if show_source:
        out.print(variant.source.text, markup=False, highlight=False)
    c, launch = variant.census, op.geometry(shape, params, run)
    table = Table(title=f"{variant.source.kernel_name} ({arch})", show_header=False)
    table.add_column(style="bold")
    table.add_column()
    rows = [
        ("grid × block", f"{launch.grid[0]}×{launch.grid[1]}×{launch.grid[2]} × {launch.threads} threads"
                         + (f" ({', '.join(f'{k}={v}' for k, v in run.items())})" if run else "")
                         + (f", clusters of {'×'.join(map(str, launch.cluster))}" if launch.clustered else "")),
        ("registers / shared", f"{c.registers} / {c.shared_bytes} B static + {launch.dynamic_shared_bytes} B dynamic"),
        ("stack / spills", f"{c.stack_bytes} B / {c.spill_bytes} B"),
    ]
    rows += [(f"loads of {t}", _widths(c.global_loads, t)) for t in sorted({k.split('.')[0] for k in c.global_loads})]
    rows += [(f"stores of {t}", _widths(c.global_stores, t)) for t in sorted({k.split('.')[0] for k in c.global_stores})]
    rows += [
        *((f"passes over {t}", str(len(p))) for t, p in c.load_passes.items() if t != "?"),
        ("barriers (bar.sync)", str(c.bar_sync)),
        ("shuffles", str(c.shfl_sync)),
        ("shared ld / st", f"{c.shared_loads} / {c.shared_stores}"),
        ("cp.async (bytes: n)", ", ".join(f"{b}: {n}" for b, n in c.cp_async.items()) or "–"),
        ("wait_group (N: n)", ", ".join(f"{w}: {n}" for w, n in c.wait_groups.items()) or "–"),
        ("rsqrt.approx", str(c.rsqrt_approx)),
    ]
    if c.half_widen or c.half_narrow:
        rows.append(("16-bit cvt (widen / narrow)", f"{c.half_widen} / {c.half_narrow}"))
    if c.mma or c.ldmatrix or c.tf32_round:
        rows += [("mma.sync (shape.type: n)", ", ".join(f"{k}: {n}" for k, n in c.mma.items()) or "–"),
                 ("ldmatrix (x: n)", ", ".join(f"{k}: {n}" for k, n in c.ldmatrix.items()) or "–"),
                 ("cvt.rna.tf32", str(c.tf32_round))]
    rows += _hopper_rows(c)
    for key, value in rows:
        table.add_row(key, value)
    out.print(table)


@app.command()
def variants(
    op_name: str = OpArg, d: Optional[int] = DOpt, m: Optional[int] = MOpt, n: Optional[int] = NOpt,
    k: Optional[int] = KOpt,
    preset: Optional[str] = typer.Option(None, help=f"search-space preset of search/<op>.toml ({_PRESETS})"),
    dtype: Optional[str] = DTypeOpt, weight_dtype: Optional[str] = WeightDTypeOpt,
    precision: Optional[str] = PrecisionOpt,
    config: list[str] = typer.Option([], help="the shape's other fields, e.g. residual=true"),
    arch: str = ArchOpt, as_json: bool = JsonOpt,
    sms: Optional[int] = typer.Option(None, "--sms", min=1, help="SMs of the GPU a grid given per SM in the space "
                                      "(grid_cap \"4/SM\") is sized for (default: this machine's GPU; without "
                                      "one, those configs are left out)"),
    limit: Optional[int] = typer.Option(None, "--limit", min=1, help="at most this many of the valid variants, spread "
                                        "evenly over the preset"),
) -> None:
    """Compile every valid variant of a preset (or --limit of them) and list each with its census."""
    op = get_op(op_name)
    shape, run = _problem(op, _shape_only_config(op, config), d=d, m=m, n=n, k=k, dtype=dtype,
                          weight_dtype=weight_dtype, precision=precision)
    check_op_arch(op, arch, shape)
    left_out = ""
    space = load_space(op, preset, shape, sms=sms)
    if space.needs_sms:
        try:
            space = load_space(op, preset, shape, sms=int(_gpu_facts()["sms"]))
        except NoGpuError:
            left_out = "; configs whose grid is given per SM left out (no GPU here: give --sms)"
    counted = tally(op, shape, space, arch)
    valid = counted.valid
    if not valid and left_out and not counted.first_rejection:  # every config's grid was given per SM
        raise MageError(f"sms: every config of preset {space.preset} gives its grid per SM, and there is no GPU here; "
                        "give the GPU's SM count, e.g. --sms 132")
    if not valid:
        raise MageError(f"space: no config of preset {space.preset} is valid for {op.name} {shape_dict(shape)}; first "
                        f"rejection: {counted.first_rejection or 'none'}; try a wider --preset ({_PRESETS})")
    valid_count = len(valid)
    if limit is not None and limit < len(valid):
        valid = valid[::-(-len(valid) // limit)][:limit]
    if valid_count > MANY_VARIANTS:  # said before the work starts: a full preset is hours on a small machine
        cores = os.cpu_count() or 1
        _log(f"{valid_count} valid variants: at about a second of one core each, {valid_count / cores / 60:.0f} min on "
             f"this machine's {cores} cores (cached ones are read back at once); "
             + ("--limit N compiles N of them" if len(valid) == valid_count else f"--limit: compiling {len(valid)}"))
    started, cached, rows = time.monotonic(), 0, []
    if as_json:  # written as the variants come, none of them held
        print(json.dumps({"op": op.name, "shape": shape_dict(shape), "preset": space.preset, "arch": arch,
                          "rejected": counted.rejected, "variants": []}, indent=2)[:-4] + "[")
    with _compiling(len(valid), f"{op.name} {shape_dict(shape)} preset {space.preset} for {arch}") as advance:
        for i, v in enumerate(build_each(op, shape, valid, arch, progress=advance)):
            cached += v.compiled.from_cache
            if as_json:
                text = json.dumps(_variant_dict(op, shape, v, run), indent=2)
                print(("" if i == 0 else ",\n") + "\n".join("    " + line for line in text.splitlines()), end="")
                continue
            c = v.census
            smem = c.shared_bytes + op.geometry(shape, v.params, run).dynamic_shared_bytes
            rows.append((v.params.label(), str(c.registers), str(smem), str(c.spill_bytes),
                         _loads_summary(op, shape, c), _cp_async_summary(c), _passes_summary(c), str(c.bar_sync),
                         str(c.shfl_sync)))
    limited = f" (--limit {limit} of {valid_count} valid)" if len(valid) < valid_count else ""
    err.print(f"{len(valid)} variants{limited} in {time.monotonic() - started:.0f} s: {len(valid) - cached} compiled, "
              f"{cached} read from the compile cache{left_out}", markup=False, highlight=False, soft_wrap=True)
    if as_json:
        print("\n  ]\n}")
        return
    table = Table(title=f"{op.name} {shape_dict(shape)}: {len(valid)} valid variants of preset {space.preset}{limited} "
                        f"({counted.rejected} combinations rejected), {arch}")
    for column in ("params", "regs", "smem B", "spill B", "global loads", "cp.async", "passes", "bar.sync", "shfl"):
        table.add_column(column, justify="left" if column == "params" else "right")
    for row in rows:
        table.add_row(*row)
    out.print(table)


@contextlib.contextmanager
def _compiling(total: int, what: str) -> Iterator[Callable[[], None]]:
    """Progress of a parallel compile: a bar on a terminal; elsewhere (a CI log, a pipe) a plan line, a line
    at every tenth and a closing count, so that minutes of compiling are never silent."""
    started = time.monotonic()
    if err.is_terminal:
        with Progress(TextColumn("compiling"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                      console=err, transient=True) as progress:
            task = progress.add_task("compile", total=total)
            yield lambda: progress.advance(task)
        return
    err.print(f"compiling {total} variants of {what} on {os.cpu_count() or 1} processes (cached ones are read "
              "back, not compiled)", markup=False, highlight=False, soft_wrap=True)
    done = 0

    def advance() -> None:
        nonlocal done
        done += 1
        if _a_tenth_more(done, total):
            _log(f"  {done}/{total} in {time.monotonic() - started:.0f} s")

    yield advance


def _a_tenth_more(done: int, total: int) -> bool:
    """Whether `done` of `total` is the last, or the first past another tenth: where a log gets a line."""
    return done == total or total > 0 and done * 10 // total > (done - 1) * 10 // total


def _log(line: str) -> None:
    err.print(line, markup=False, highlight=False, soft_wrap=True)


def _this_gpu() -> str:
    try:
        from mage_gen.gpu import device_name

        return device_name()
    except (ImportError, MageError):
        raise MageError("no GPU reachable to pick this GPU's tuned/ entry: pass --gpu NAME "
                        "(e.g. --gpu 'NVIDIA H200') or --config KEY=VALUE,...") from None


@app.command("emit")
def emit_command(
    op_name: str = OpArg, d: Optional[int] = DOpt, m: Optional[int] = MOpt, n: Optional[int] = NOpt,
    k: Optional[int] = KOpt,
    out_dir: Path = typer.Option(Path("kernels"), "-o", "--out", help="folder for the emitted files"),
    arch: str = ArchOpt,
    config: list[str] = typer.Option([], help="emit these parameters (KEY=VALUE[,KEY=VALUE]) instead of "
                                              "this GPU's tuned winner"),
    gpu: Optional[str] = typer.Option(None, "--gpu", envvar="MAGE_GEN_GPU",
                                      help="the GPU whose tuned/ winner to emit (default: this machine's)"),
    force: bool = typer.Option(False, "--force", help="replace files in --out that hold another kernel"),
    dtype: Optional[str] = DTypeOpt, weight_dtype: Optional[str] = WeightDTypeOpt,
    precision: Optional[str] = PrecisionOpt,
) -> None:
    """Write a kernel as standalone .cu, .ptx, .cubin, .launch.json and .h: the tuned winner of each size
    class (of the one that serves --m, where given), or --config."""
    op = get_op(op_name)
    shape_config, values = _split_config(op, config)
    shape, run = _problem(op, shape_config, d=d, m=m, n=n, k=k, dtype=dtype, weight_dtype=weight_dtype,
                          precision=precision)
    check_op_arch(op, arch, shape)
    if values:
        paths = emit(op, shape, op.params_from_user({**op.defaults(shape), **values}), arch, out_dir,
                     None, replace=force)
    else:
        paths = _emit_tuned(op, shape, gpu or _this_gpu(), arch, out_dir, run if m is not None else None, force)
    for path in paths:
        print(path)


def _stem(op: Op, shape: Any, winner: Winner) -> str:
    """Files of a size class are named after it: layernorm_d768_m4096."""
    sizes = "".join(f"_{k}{v}" for k, v in (winner.run or {}).items())
    return f"{op.name}_{op.slug(shape)}{sizes}"


def _size_classes(op: Op, shape: Any, winners: list[Winner]) -> dict[str, Any] | None:
    if not op.run_dims:
        return None
    l2 = int(winners[0].entry["gpu"]["l2_bytes"])
    return {"rule": dispatch.RULE, "l2_bytes": l2, "classes": [
        {**(w.run or {}), "regime": dispatch.regime(op, shape, w.run or {}, l2), "stem": _stem(op, shape, w),
         "kernel": w.entry["kernel"], "objective": w.entry["objective"]} for w in winners]}


def _trial_seconds_line(seconds: dict[str, float]) -> str:
    """'a trial, on average: load 0.01 s, gate 0.31 s (host 0.25 s), timing 0.12 s'; the rest of a trial's share
    of the measuring phase is the tuner's own (proposals, storage) and its worker's round trips."""
    s = {part: seconds.get(part, 0.0) for part in ("load", "gate", "gate_host", "timing")}
    return (f"a trial, on average: load {s['load']:.2f} s, gate {s['gate']:.2f} s (host {s['gate_host']:.2f} s), "
            f"timing {s['timing']:.2f} s")


def _emit_tuned(op: Op, shape: Any, gpu_name: str, arch: str, out_dir: Path, run: dict[str, int] | None,
                replace: bool, directory: Path | None = None, skip_stale: bool = False) -> list[Path]:
    """Every size class's winner (only the one that serves `run`, where given). A fixed-size op with no entry
    for this shape takes the params of the nearest tuned shape they are valid for, else its default config,
    and says so. With skip_stale (after a tune, whose own class is current), a stale class is left out with a
    line that says how to retune it, where it would otherwise refuse the whole shape."""
    if directory is None:  # the first folder with an entry for the shape: ./tuned or $MAGE_GEN_TUNED, then the shipped
        directory = next((d for d in tuned_dirs() if shape_entries(op, shape, gpu_name, d)), None)
    if not op.run_dims and not shape_entries(op, shape, gpu_name, directory):
        return _emit_untuned(op, shape, gpu_name, arch, out_dir, replace)
    if skip_stale:
        winners, refused = current_winners(op, shape, gpu_name, directory)
        for exc in refused:
            err.print(f"not emitted: {exc}", markup=False, highlight=False, soft_wrap=True)
    else:
        winners = load_winners(op, shape, gpu_name, directory)
    for w in winners:  # a winner is a kernel timed on its GPU: built for another arch, it is a kernel never timed
        tuned_for = "sm_" + str(w.entry["gpu"]["cc"]).replace(".", "")
        if arch.rstrip("a") != tuned_for:
            raise MageError(f"arch: the {op.name} winners in {w.path} were tuned on {gpu_name} ({tuned_for}); built for "
                            f"{arch} they would be kernels nobody timed there; leave --arch out (or give {tuned_for}), "
                            "or choose params with --config")
    classes = _size_classes(op, shape, winners)
    if run is not None and op.run_dims:
        winners = [pick_winner(op, shape, winners, run)]
    paths: list[Path] = []
    for w in winners:
        paths += emit(op, shape, w.params, arch, out_dir, w.entry, stem=_stem(op, shape, w), size_classes=classes,
                      replace=replace)
    return paths


def _emit_untuned(op: Op, shape: Any, gpu_name: str, arch: str, out_dir: Path, replace: bool) -> list[Path]:
    tuned = tuned_shapes(op, gpu_name)
    served = dispatch.choose_class(op, shape, tuned)  # what the runtime runs at this shape, where the op has classes
    nearest = served or dispatch.nearest_shape(op, shape, tuned)
    if nearest is not None:
        other, params = nearest
        whose = ("the size class the runtime runs here, tuned at" if served else "the nearest tuned shape")
        err.print(f"mage-gen: no tuned {op.name} entry for {shape_dict(shape)} on {gpu_name}; emitting the params of "
                  f"{whose} {shape_dict(other)} (untimed at this shape; tune it for a measured winner)",
                  markup=False, highlight=False, soft_wrap=True)
    else:
        params = op.params_from_dict(op.defaults(shape))
        op.validate(shape, params)
        err.print(f"mage-gen: no tuned {op.name} entry near {shape_dict(shape)} on {gpu_name}; emitting the default "
                  "config (untimed; tune it for a measured winner)", markup=False, highlight=False, soft_wrap=True)
    return emit(op, shape, params, arch, out_dir, None, replace=replace)


def _print_result(op: Op, result: Any, objective: str, note: str = "") -> None:
    table = Table(title=f"{op.name}: winner and runner-ups ({objective} objective), then peers, µs per launch")
    peers = list(result.peers)
    for column in ("", "kernel", "hot median", "± spread", "cold median", "regs", *(f"vs {p}" for p in peers)):
        table.add_column(column, justify="left" if column in ("", "kernel") else "right")

    def ratio(f: Timing, peer: str) -> str:
        p = result.peers[peer]
        return f"{f.median_us / by_objective(p['hot'], p['cold'], objective).median_us:.3f}×"

    for label, f in [(f"winner by {objective}" + (" (tie)" if result.tie else ""), result.winner),
                     *(("", r) for r in result.runner_ups)]:
        t = f.timing(objective)
        table.add_row(label, f.name, f"{f.hot.median_us:.2f}", f"{t.spread_us:.2f}", f"{f.cold.median_us:.2f}",
                      str(f.registers), *(ratio(t, p) for p in peers))
    for name, p in result.peers.items():
        config = " ".join(f"{k}={v}" for k, v in p["config"].items() if k in ("num_warps", "fn", "BLOCK_M", "BLOCK_N",
                                                                             "BLOCK_K", "num_stages"))
        table.add_row("peer", f"{name} {config}", f"{p['hot'].median_us:.2f}",
                      f"{by_objective(p['hot'], p['cold'], objective).spread_us:.2f}",
                      f"{p['cold'].median_us:.2f}", "", *("" for _ in peers))
    out.print(table)
    for peer in peers:
        if over := result.winner_over_peer(peer):
            out.print(f"winner's time over {peer}'s by paired rounds: " + ", ".join(
                f"{m} {r.median:.3f} [{r.low:.3f}, {r.high:.3f}] {r.verdict}" for m, r in over.items()), markup=False)
    if note:
        out.print(note, markup=False)
    c = result.winner.census
    out.print(f"winner census: {c['registers']} registers, {c['shared_bytes']} B shared, {c['spill_bytes']} B spills"
              + "".join(f", {tensor} loads {_widths(c['global_loads'], tensor)} in {c['passes'][tensor]} pass(es)"
                        for tensor in c["passes"] if tensor != "?")
              + (f", cp.async {' '.join(f'{n}×{b}B' for b, n in c['cp_async'].items())}" if c["cp_async"] else "")
              + f", {c['bar_sync']} bar.sync, {c['shfl_sync']} shfl")
    out.print(f"study {result.study} ({result.sampler}): {result.valid} valid configs, {result.measured} measured now, "
              f"{result.reused} from earlier runs, {len(result.failed)} failed")
    for name, why in list(result.failed.items())[:5]:
        out.print(f"  failed {name}: {why}", markup=False)
    if result.tie:
        kept = ("" if objective == "both" else
                f"the fastest {'cold' if objective == 'hot' else 'hot'} (or tied with it), then ")
        within = "hot and cold" if objective == "both" else objective
        rule = kept + ("the winner the search started from" if result.kept_stored else
                       "the one with fewer registers, then fewer threads")
        out.print(f"tie: {result.winner.name} and {', '.join(result.tied_with)}: none told slower than the fastest "
                  f"by {result.tie_test}, {within}; kept {rule}")
    for name, why in result.dropped.items():
        out.print(f"  not compared: {name}: {why}", markup=False)


@app.command("tune")
def tune_command(
    op_name: str = OpArg, d: Optional[int] = DOpt,
    m: Optional[str] = typer.Option(None, "--m", help="matmul: M. gemm_sm90: M, or several (16,128,2048), a size "
                                                      "class each, tuned in turn. layernorm: the rows to tune at, "
                                                      "one size class each: 4096, 4096,65536, or auto (one M whose "
                                                      "x and y fit the GPU's L2, one that does not; default 4096)"),
    n: Optional[int] = NOpt, k: Optional[int] = KOpt,
    preset: Optional[str] = typer.Option(None, help=f"search-space preset of search/<op>.toml ({_PRESETS})"),
    trials: Optional[int] = typer.Option(None, min=1, help="configs each study measures in all, earlier runs "
                                                           f"included (default: all when ≤ {EXHAUSTIVE_LIMIT}, "
                                                           f"else {DEFAULT_TPE_TRIALS})"),
    objective: str = typer.Option("hot", help="hot (L2-warm, graph replay), cold (L2 flushed) or both (the "
                                              "geometric mean of the two)"),
    storage: Optional[str] = typer.Option(None, help="Optuna storage URL (default: SQLite in the user data folder)"),
    study: Optional[str] = typer.Option(None, help="study name (default: from op, shape, M, GPU, arch, objective)"),
    arch: Optional[str] = typer.Option(None, "--arch", help="default: the GPU's own"),
    out_dir: Path = typer.Option(Path("kernels"), "-o", "--out", help="folder for the emitted winners"),
    seed: int = typer.Option(0, help="seed of the sampler and the random inputs"),
    replay: Optional[Path] = typer.Option(None, help="answer from a recording of bench/probes/layernorm_trials.py "
                                                      "instead of the GPU (for testing): the study is kept in "
                                                      "memory unless --storage is given, and the winner is "
                                                      "stored and emitted only with --tuned"),
    tuned: Optional[Path] = typer.Option(None, "--tuned", help="folder of the tuned/ files that take the winners "
                                                               "(default: $MAGE_GEN_TUNED, else ./tuned)"),
    gpus: Optional[str] = typer.Option(None, "--gpus", help="measure on these GPUs at once, one worker each: 0,1 "
                                                            "or all (needs a server --storage, e.g. "
                                                            "postgresql://USER@HOST/DB); the finalists are "
                                                            "re-timed on the first"),
    dtype: Optional[str] = DTypeOpt, weight_dtype: Optional[str] = WeightDTypeOpt,
    precision: Optional[str] = PrecisionOpt,
    config: list[str] = typer.Option([], help="the shape's other fields, e.g. residual=true"),
) -> None:
    """Search the space on this GPU (or several), one study per size class: gate every variant, time the ones
    that pass, store each winner in tuned/ and emit them."""
    from mage_gen.backends import ReplayBackend

    op = get_op(op_name)
    sizes = _parse_sizes(op, m) if m is not None else None
    # an op whose entries are classes over M (gemm_sm90) takes a shape for each M given
    problems = [_problem(op, _shape_only_config(op, config), d=d, m=size, n=n, k=k, dtype=dtype,
                         weight_dtype=weight_dtype, precision=precision)
                for size in (sizes if sizes and "m" in op.shape_dims else [None])]
    shapes = [each for each, _ in problems]
    shape, default_run = problems[0]
    if objective not in OBJECTIVES:
        raise MageError(f"objective: use {', '.join(OBJECTIVES)}, got {objective!r}")
    if study and isinstance(sizes, list) and len(sizes) > 1:
        raise MageError("study: one --study name cannot hold several size classes; leave --study out")
    from mage_gen import fleet

    chosen_gpus = fleet.gpu_list(gpus) if gpus else None
    if chosen_gpus and len(chosen_gpus) > 1 and not (storage and fleet.is_server(storage)):
        raise MageError(f"storage: {len(chosen_gpus)} workers cannot share "
                        f"{storage or 'the default SQLite storage'}: SQLite is not safe for concurrent writers; "
                        "give --storage postgresql://USER@HOST/DB")
    load_space(op, preset, shape)  # a bad --preset is its own one-line error before any GPU is looked for
    replayed = ReplayBackend(replay) if replay else None  # a bad --replay file is its own one-line error
    try:
        device = replayed.device if replayed else _gpu_facts()
    except NoGpuError as exc:  # said at once: compiling a preset here first could take hours, for nothing timed
        raise NoGpuError(f"{exc}; tuning times kernels. `mage-gen variants {op.name} {shape_arguments(shape, every_field=False)}"
                         f"{' --preset ' + preset if preset else ''}` compiles and counts them here") from None
    spaces = {each: load_space(op, preset, each, sms=int(device["sms"])) for each in shapes}
    target = "sm_" + str(device["cc"]).replace(".", "")
    if arch and check_arch(arch) != target:
        raise MageError(f"arch: the GPU here is {target}; kernels for {arch} cannot be timed on it")
    if sizes == "auto":
        runs = dispatch.auto_runs(op, shape, int(device["l2_bytes"]))
    elif sizes and "m" in op.run_dims:
        runs = [{"m": size} for size in sizes]
        for run in runs:
            op.check_run(run)
    else:
        runs = [default_run]
    if replayed is not None and any(replayed.recording.get("run", run) != run for run in runs):
        raise MageError(f"replay: the recording was made at {replayed.recording.get('run')}, not at every one of "
                        f"{runs}; give --m to match it")
    # A replay's figures are a recording's, not this machine's: they reach a study, tuned/ or --out only
    # where a path says so, never the defaults a real tune would read and resume.
    store = tuned is not None or replayed is None
    if replayed is not None:
        from mage_gen.tune import IN_MEMORY

        storage = storage or IN_MEMORY
    # Where the winners go is checked before the search, so that nothing is measured in vain.
    if store:
        check_can_save(op.name, device["name"], tuned)
        check_out_dir(out_dir)
    # each class in turn, so that each later one's search measures the winners stored before it (SEED_RULE)
    for each in shapes:
        for run in runs:
            if len(runs) > 1:
                err.print(f"tuning {op.name} {shape_dict(each)} at {run} "
                          f"({dispatch.regime(op, each, run, int(device['l2_bytes']))} size class)",
                          markup=False, highlight=False)
            elif len(shapes) > 1:
                err.print(f"tuning {op.name} {shape_dict(each)}", markup=False, highlight=False)
            named = study or (_replay_study_name(op, each, spaces[each], replayed) if replayed is not None else None)
            _tune_size_class(op, each, run, spaces[each], replayed, seed, objective=objective, trials=trials,
                             storage=storage, study=named, tuned=tuned, store=store, gpus=chosen_gpus)
    if not store:
        out.print("replay: the winner is not stored or emitted; give --tuned DIR (and -o) to keep it, marked as a "
                  "replay")
        return
    # A tune's job is the new winner: it replaces what an earlier tune emitted into --out.
    for each in shapes:
        for path in _emit_tuned(op, each, device["name"], target, out_dir, None, replace=True, directory=tuned,
                                skip_stale=True):
            print(path)


@app.command("worker")
def worker_command(
    storage: str = typer.Option(..., help="the study's Optuna storage: a server database, e.g. "
                                          "postgresql://USER@HOST/DB"),
    study: str = typer.Option(..., help="the study to join (mage-gen tune prints its name)"),
    gpus: Optional[str] = typer.Option(None, "--gpus", help="one worker per GPU: 0,1 or all (default: GPU 0)"),
    seed: int = typer.Option(0, help="seed of the sampler and the random inputs"),
    replay: Optional[Path] = typer.Option(None, help="answer from a recording of bench/probes/layernorm_trials.py "
                                                      "instead of the GPU (for testing)"),
) -> None:
    """Join a running tune from this host: measure the study's configs until its budget is spent. The tune
    that made the study re-times the finalists and stores the winner; a worker never writes tuned/."""
    from mage_gen import fleet

    chosen = fleet.gpu_list(gpus) if gpus else None
    if chosen and len(chosen) > 1:
        trouble = fleet.start_workers(storage, study, chosen, seed, ["--replay", str(replay)] if replay else []).wait()
        for line in trouble:
            err.print(f"mage-gen: {line}", markup=False)
        if len(trouble) == len(chosen):
            raise MageError("worker: every worker failed; see their messages above")
        return
    if chosen:
        os.environ["CUDA_VISIBLE_DEVICES"] = str(chosen[0])  # the trial worker, spawned below, sees only it
    _join(storage, study, seed, replay)


def _join(storage: str, study_name: str, seed: int, replay: Path | None) -> None:
    import optuna

    from mage_gen import fleet
    from mage_gen.backends import ReplayBackend
    from mage_gen.tune import _finished, _keys, measure, space_id
    from mage_gen.worker import IsolatedBackend, gpu_backend

    handle = fleet.open_storage(storage, workers=1, joining=True)  # a worker shares its study: SQLite is refused
    try:
        study = optuna.load_study(study_name=study_name, storage=handle)
    except KeyError:
        raise MageError(f"worker: {fleet.shown(storage)} holds no study {study_name!r}; start it with mage-gen tune "
                        "--storage (it prints the study's name)") from None
    identity, budget = study.user_attrs.get("identity"), study.user_attrs.get("budget")
    if not identity or not budget:
        raise MageError(f"worker: study {study_name!r} was not started by mage-gen tune (no identity or budget); "
                        "join one that was")
    op = get_op(identity["op"])
    shape, run = op.shape(**identity["shape"]), identity["run"]
    backend = ReplayBackend(replay) if replay else IsolatedBackend(partial(gpu_backend, op.name, shape, run, seed))
    try:
        here = (backend.device["name"], backend.arch)
        if here != (identity["gpu"], identity["arch"]):
            raise MageError(f"worker: study {study_name!r} is for {identity['gpu']} ({identity['arch']}), this is "
                            f"{here[0]} ({here[1]}); another GPU model tunes a study of its own")
        space = load_space(op, identity["preset"], shape, sms=int(backend.device["sms"]))
        if space_id(space) != identity["space"]:
            raise MageError(f"worker: preset {identity['preset']} of this mage-gen is not the space study "
                            f"{study_name!r} searches; run the version that started it")
        measured = measure(op, shape, space, backend, study, int(budget), identity["objective"], seed)
    finally:
        backend.close()
    held = len(_finished(study, op, shape, _keys(op, valid_params(op, shape, space, identity["arch"]))))
    out.print(f"measured {measured} configs of study {study_name}; it holds {held} of its {budget}")


def _objective_note(op: Op, shape: Any, run: dict[str, int], objective: str, l2_bytes: int) -> str:
    """Where a hot ranking measures the L2 rather than the memory a model's call reads, say so."""
    if objective != "hot" or not op.run_dims or dispatch.regime(op, shape, run, l2_bytes) != "l2":
        return ""
    return (f"ranked hot: graph replays with the inputs warm in L2, and at {run} all the bytes fit the GPU's "
            f"{l2_bytes >> 20} MB L2, so this measures the L2; a model's call that reads them from memory is the "
            "cold column (tune with --objective cold or both to rank by it)")


def _replay_study_name(op: Op, shape: Any, space: Any, replayed: Any) -> str:
    """Never a name a tune on a GPU would open: it says replay and which recording."""
    return f"replay-{op.name}-{op.slug(shape)}-{space.preset}-{Path(replayed.path).stem}"


@app.command("report")
def report_command(
    op_name: str = OpArg, d: Optional[int] = DOpt,
    m: Optional[int] = typer.Option(None, "--m", help="matmul: M. layernorm: the size class (the M it was tuned "
                                                      "at); default: the shape's only study"),
    n: Optional[int] = NOpt, k: Optional[int] = KOpt,
    dtype: Optional[str] = DTypeOpt, weight_dtype: Optional[str] = WeightDTypeOpt,
    precision: Optional[str] = PrecisionOpt,
    config: list[str] = typer.Option([], help="the shape's other fields, e.g. residual=true"),
    storage: Optional[str] = typer.Option(None, help="Optuna storage URL of the tune (default: SQLite in the "
                                                     "user data folder)"),
    study: Optional[str] = typer.Option(None, help="study name, where the storage holds several for the shape"),
    out_dir: Path = typer.Option(Path("report"), "-o", "--out", help="folder for index.html and its PNGs"),
) -> None:
    """One HTML page with plots of a tune's study: the search, what mattered, why the winner won, how far each
    variant is from the hardware's limit."""
    try:
        from mage_gen import report
    except ImportError as exc:
        raise MageError(f"report: {exc.name} is not installed; pip install 'mage-gen[report]'") from None
    from mage_gen import fleet
    from mage_gen.tune import default_storage

    op = get_op(op_name)
    shape, _ = _problem(op, _shape_only_config(op, config), d=d, m=m if "m" in op.shape_dims else None, n=n, k=k,
                        dtype=dtype, weight_dtype=weight_dtype, precision=precision)
    run = {"m": m} if m is not None and "m" in op.run_dims else None
    storage = storage or default_storage()
    names = [study] if study else report.find_studies(storage, op, shape, run)
    if not names:
        raise MageError(f"report: {fleet.shown(storage)} holds no study of {op.name} {shape_dict(shape)}"
                        f"{' at ' + str(run) if run else ''}; tune it first, or give the --storage it used")
    if len(names) > 1:
        raise MageError(f"report: {len(names)} studies of {op.name} {shape_dict(shape)} in {fleet.shown(storage)}: "
                        f"{', '.join(names)}; choose one with --study")
    check_out_dir(out_dir, "the report")
    try:
        identity = report.study_identity(storage, names[0])
    except KeyError:
        raise MageError(f"report: {fleet.shown(storage)} holds no study {names[0]!r}; leave --study out to find the "
                        "shape's")
    gpu_name = identity.get("gpu", "")
    classes = shape_entries(op, shape, gpu_name) if gpu_name else {}
    page = report.write_report(op, shape, storage, names[0], out_dir, classes, report.measured_copy(gpu_name))
    print(page)


def _gpu_facts() -> dict[str, Any]:
    """This machine's GPU as tuned/ records it (name, cc, SMs, L2, driver); NoGpuError where there is none."""
    from mage_gen import gpu

    return gpu.open_device().to_dict()


def _starting_points(op: Op, shape: Any, run: dict[str, int], space: Any, gpu_name: str, tuned: Path | None,
                     store: bool) -> tuple[Any, list[str], list[tuple[Any, Any]], list[str]]:
    """What a size class's search measures first: (its stored winner, or with none the winner of the class that
    serves its shape now; the axes a stored winner predates; the winner of the class that would serve the shape
    without its own entry, where a stored winner is first, then the nearest tuned shapes and their winners
    (dispatch.SEED_RULE); and the lines that say so)."""
    if not store:
        return None, [], [], []
    incumbent = stored_params(op, shape, run, gpu_name, tuned)
    others = tuned_shapes(op, gpu_name, tuned)
    # what the runtime runs at this shape without this class's own entry (dispatch.CLASS_RULE)
    served = dispatch.choose_class(op, shape, {other: p for other, p in others.items() if other != shape})
    notes, unrecorded, seeds = [], [], []
    if incumbent is not None:
        notes.append(f"  the stored winner {op.kernel_name(shape, incumbent)} is measured first where the preset holds "
                     "it, and re-timed in the final round")
        named = stored_axes(op, shape, run, gpu_name, tuned)
        unrecorded = [axis for axis, values in space.axes if axis not in named and len(values) > 1]
        if unrecorded:
            notes.append(f"  it was tuned before {', '.join(unrecorded)} existed: it is also measured first at each "
                         f"value of {'it' if len(unrecorded) == 1 else 'them'}")
        if served is not None and served[1] != incumbent:
            seeds.append(served)
            notes.append("  then, where the preset holds it, the winner of the size class that would serve this "
                         f"shape without its own entry, {shape_dict(served[0])}")
    elif served is not None:
        # A new class is stored only where it beats what the runtime runs at its shape without it: a short search
        # must not leave the shape slower than before it was tuned.
        incumbent = served[1]
        notes.append(f"  the winner of the size class that serves this shape now, {shape_dict(served[0])}, is measured "
                     "first where the preset holds it, and re-timed in the final round")
    nearest = [(other, params) for other, params in dispatch.neighbours(op, shape, others, SEEDS + 2)
               if params != incumbent and all(params != p for _, p in seeds)][:SEEDS]
    if nearest:
        notes.append(f"  {'then' if incumbent is not None else 'first'}, where the preset holds them, the winners of "
                     "the nearest tuned shapes: " + "; ".join(str(shape_dict(other)) for other, _ in nearest))
    return incumbent, unrecorded, seeds + nearest, notes


def _tune_size_class(op: Op, shape: Any, run: dict[str, int], space: Any, replayed: Any, seed: int,
                     tuned: Path | None, store: bool, gpus: list[int] | None, **search: Any) -> None:
    """One study at one run size, its winner stored in tuned/ under its size class."""
    from mage_gen.tune import tune as tune_search
    from mage_gen.worker import IsolatedBackend, gpu_backend

    from mage_gen import fleet

    if gpus:  # this process measures on the first GPU (its trial worker inherits the pinning), workers on the rest
        os.environ["CUDA_VISIBLE_DEVICES"] = str(gpus[0])
    # On the GPU every trial runs in a worker process: a variant that crashes or hangs fails alone.
    backend = replayed or IsolatedBackend(partial(gpu_backend, op.name, shape, run, seed))
    storage = fleet.open_storage(search["storage"], len(gpus or [0])) if search["storage"] else None
    incumbent, unrecorded, seeds, notes = _starting_points(op, shape, run, space, backend.device["name"], tuned, store)
    started: list[Any] = []

    def helpers(study: Any) -> Any:
        extra = ["--replay", str(replayed.path)] if replayed is not None else []
        started.append(fleet.start_workers(search["storage"], study.study_name, gpus[1:], seed, extra))
        return started[-1]
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=err, transient=True, disable=not err.is_terminal) as progress:
        trial_task = progress.add_task("compiling", total=None)
        stages = {"compiling": "compiling", "trials": "measuring", "final": "re-timing finalists"}
        began = {"compiling": time.monotonic()}  # when each stage was first reported

        def report(stage: str, done: int, total: int) -> None:
            for note in notes:  # once the study is open: a study that cannot be has only its one-line error
                _log(note)
            notes.clear()
            began.setdefault(stage, time.monotonic())
            progress.update(trial_task, description=stages[stage], completed=done, total=total)
            if not err.is_terminal and _a_tenth_more(done, total):  # a log or a pipe: a line at every tenth
                _log(f"  {stages[stage]} {done}/{total} in {time.monotonic() - began[stage]:.0f} s")

        try:
            result = tune_search(op, shape, run, space, backend, seed=seed, progress=report,
                                 study_name=search["study"], objective=search["objective"],
                                 trials=search["trials"], storage=storage,
                                 helpers=helpers if gpus and len(gpus) > 1 else None, incumbent=incumbent,
                                 unrecorded=unrecorded, seeds=[params for _, params in seeds])
        finally:
            backend.close()
    for workers in started:
        for trouble in workers.wait():  # already ended: a dead worker's trials were failed and measured again
            err.print(f"mage-gen: {trouble}; its trials were measured by the others", markup=False)
    entry = result.entry(op, shape, run, backend.device, search["objective"])
    entry["size_class"] = dispatch.record(op, shape, run, int(backend.device["l2_bytes"]))
    if replayed is not None:
        entry["replay"] = str(replayed.path)
    _print_result(op, result, search["objective"], _objective_note(op, shape, run, search["objective"],
                                                                   int(backend.device["l2_bytes"])))
    marks = [*began.items(), ("end", time.monotonic())]
    out.print("phases: " + ", ".join(f"{stages[stage]} {later - at:.1f} s"
                                     for (stage, at), (_, later) in zip(marks, marks[1:])))
    if result.trial_seconds:
        out.print(_trial_seconds_line(result.trial_seconds))
    if store:
        stored = save_entry(op.name, backend.device["name"], entry_key(op, shape, run), entry, tuned)
        out.print(f"stored {stored}")


def _click_exceptions(name: str) -> tuple[type[BaseException], ...]:
    """Typer raises click's exceptions, from click itself or from the copy newer Typers carry."""
    found = []
    for module in ("click.exceptions", "typer._click.exceptions"):
        try:
            found.append(getattr(importlib.import_module(module), name))
        except (ImportError, AttributeError):
            pass
    return tuple(found)


_TYPER_INTERRUPTED = 130


def _terminated(signum: int, frame: Any) -> None:
    """SIGTERM (timeout, kill, a scheduler) as Ctrl-C: passed on as a SIGINT to this process, so that it meets the
    same handling (held while compile workers start, then a clean stop with the workers ended)."""
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:  # a background job's Ctrl-C is ignored; a TERM is not
        raise KeyboardInterrupt
    os.kill(os.getpid(), signal.SIGINT)


def main() -> None:
    """Entry point: every error a user can cause is one line on stderr and exit code 2."""
    usage_errors, aborts = _click_exceptions("UsageError"), _click_exceptions("Abort")
    signal.signal(signal.SIGTERM, _terminated)
    try:
        code = app(standalone_mode=False)
        if code == _TYPER_INTERRUPTED:  # Typer answers Ctrl-C inside a command with this code, and says nothing
            raise KeyboardInterrupt
    except MageError as exc:
        err.print(f"mage-gen: error: {exc}", markup=False, highlight=False, soft_wrap=True)
        sys.exit(2)
    except usage_errors as exc:
        if type(exc).__name__ == "NoArgsIsHelpError":  # plain `mage-gen`: the usage is the answer, not an error
            err.print(exc.format_message(), markup=False, highlight=False, soft_wrap=True)
        else:
            err.print(f"mage-gen: error: {exc.format_message()}", markup=False, highlight=False, soft_wrap=True)
        sys.exit(2)
    except (KeyboardInterrupt, *aborts):
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # one answer to an interrupt; another must not cut it short
        err.print("mage-gen: interrupted", markup=False)
        sys.exit(130)
    sys.exit(code if isinstance(code, int) else 0)
