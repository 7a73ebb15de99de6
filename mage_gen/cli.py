"""The mage-gen command line: wires the pipeline stages together and prints with rich. The tuning commands
(tune, worker, report) are mage_gen/cli_tune.py's, registered on the same app."""

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
from pathlib import Path
from typing import Any, Optional

import typer
from rich.console import Console

import mage_gen
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from mage_gen import dispatch
from mage_gen.census import Census
from mage_gen.compile import DEFAULT_ARCH
from mage_gen.emit import emit
from mage_gen.errors import MageError, NoGpuError
from mage_gen.ops import OPS, Op, get_op
from mage_gen.ops.base import shape_dict
from mage_gen.space import load_space, preset_names, tally
from mage_gen.store import (Winner, current_winners, load_winners, pick_winner, shape_entries, tuned_dirs,
                            tuned_shapes)
from mage_gen.variants import Variant, build, build_each, check_op_arch

MANY_VARIANTS = 2000  # a compile of more says how long it may take before it starts

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


def _gpu_facts() -> dict[str, Any]:
    """This machine's GPU as tuned/ records it (name, cc, SMs, L2, driver); NoGpuError where there is none."""
    from mage_gen import gpu

    return gpu.open_device().to_dict()


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


# the tuning commands (tune, worker, report), registered on `app` after the commands above
from mage_gen import cli_tune  # noqa: E402, F401


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
        # past rich: an interrupt raised in err.print after its line was written, before rich cleared its buffer,
        # leaves the line there, and err's next print would write it again
        sys.stderr.write("mage-gen: interrupted\n")
        sys.exit(130)
    sys.exit(code if isinstance(code, int) else 0)
