"""The mage-gen command line: wires the pipeline stages together and prints with rich."""

from __future__ import annotations

import importlib
import json
import sys
from typing import Any, Optional

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from mage_gen.compile import DEFAULT_ARCH, check_arch
from mage_gen.errors import MageError
from mage_gen.ops import Op, get_op
from mage_gen.space import expand, load_space
from mage_gen.variants import Variant, build, build_all

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Generate, check and tune GPU kernels written with inline PTX.")
out = Console()
err = Console(stderr=True)

OpArg = typer.Argument(..., help="op family, e.g. layernorm")
DOpt = typer.Option(None, "--d", help="row length (layernorm)")
MOpt = typer.Option(4096, "--m", help="rows at launch (layernorm), for the launch geometry shown")
ArchOpt = typer.Option(DEFAULT_ARCH, "--arch", help="GPU architecture to compile for, e.g. sm_90, sm_80")
JsonOpt = typer.Option(False, "--json", help="print machine-readable JSON instead of a table")


def _shape(op: Op, **given: Optional[int]) -> Any:
    dims = {name: given.get(name) for name in op.shape_dims}
    missing = [name for name, value in dims.items() if value is None]
    if missing:
        raise MageError(f"{op.name} needs {', '.join('--' + m for m in missing)}")
    return op.shape(**dims)


def _parse_config(items: list[str]) -> dict[str, Any]:
    values: dict[str, Any] = {}
    for item in items:
        for pair in filter(None, item.split(",")):
            key, sep, raw = pair.partition("=")
            if not sep:
                raise MageError(f"config: {pair!r} is not KEY=VALUE (e.g. --config rows_per_block=4)")
            values[key.strip().replace("-", "_")] = int(raw) if raw.strip().lstrip("-").isdigit() else raw.strip()
    return values


def _launch_dict(op: Op, shape: Any, params: Any, run: dict[str, int]) -> dict[str, Any]:
    launch = op.geometry(shape, params, run)
    return {"run": run, "grid": list(launch.grid), "block": list(launch.block),
            "dynamic_shared_bytes": launch.dynamic_shared_bytes,
            "static_shared_bytes": launch.static_shared_bytes}


def _variant_dict(op: Op, shape: Any, variant: Variant, run: dict[str, int]) -> dict[str, Any]:
    return {
        "op": op.name, "shape": vars(shape), "params": vars(variant.params),
        "kernel": variant.source.kernel_name, "arch": variant.compiled.arch,
        "template": variant.source.template, "template_hash": variant.source.template_hash,
        "launch": _launch_dict(op, shape, variant.params, run),
        "census": variant.census.to_dict(),
    }


def _widths(table: dict[str, dict[str, int]], tensor: str) -> str:
    counts: dict[str, int] = {}
    for tag, widths in table.items():
        if tag.split(".")[0] == tensor:
            for width, n in widths.items():
                counts[width] = counts.get(width, 0) + n
    return " ".join(f"{n}×{w}" for w, n in sorted(counts.items())) or "–"


@app.command()
def inspect(
    op_name: str = OpArg, d: Optional[int] = DOpt, m: int = MOpt,
    template: Optional[str] = typer.Option(None, help="template (layernorm: row, multirow, wide)"),
    threads: Optional[int] = typer.Option(None, help="threads per row"),
    vector: Optional[int] = typer.Option(None, help="floats per global access: 1, 2 or 4"),
    config: list[str] = typer.Option([], help="other parameters as KEY=VALUE[,KEY=VALUE]"),
    arch: str = ArchOpt, as_json: bool = JsonOpt,
    show_source: bool = typer.Option(False, "--source", help="also print the generated CUDA source"),
) -> None:
    """Render, compile and count one variant: registers, shared memory, loads, stores, barriers."""
    op = get_op(op_name)
    shape = _shape(op, d=d)
    check_arch(arch)
    values = _parse_config(config)
    values.update({k: v for k, v in dict(template=template, threads=threads, vector=vector).items()
                   if v is not None})
    params = op.params_from_dict(values)
    run = {"m": m}
    op.check_run(run)
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
        ("grid × block", f"{launch.grid[0]}×{launch.grid[1]}×{launch.grid[2]} × {launch.threads} threads (m={m})"),
        ("registers / shared", f"{c.registers} / {c.shared_bytes} B static + {launch.dynamic_shared_bytes} B dynamic"),
        ("stack / spills", f"{c.stack_bytes} B / {c.spill_bytes} B"),
    ]
    rows += [(f"loads of {t}", _widths(c.global_loads, t)) for t in sorted({k.split('.')[0] for k in c.global_loads})]
    rows += [(f"stores of {t}", _widths(c.global_stores, t)) for t in sorted({k.split('.')[0] for k in c.global_stores})]
    rows += [
        ("passes over x", str(c.passes_over("x"))),
        ("barriers (bar.sync)", str(c.bar_sync)),
        ("shuffles", str(c.shfl_sync)),
        ("shared ld / st", f"{c.shared_loads} / {c.shared_stores}"),
        ("cp.async (bytes: n)", ", ".join(f"{b}: {n}" for b, n in c.cp_async.items()) or "–"),
        ("rsqrt.approx", str(c.rsqrt_approx)),
    ]
    for key, value in rows:
        table.add_row(key, value)
    out.print(table)


@app.command()
def variants(
    op_name: str = OpArg, d: Optional[int] = DOpt, m: int = MOpt,
    preset: Optional[str] = typer.Option(None, help="search-space preset from search/<op>.toml (quick, full)"),
    arch: str = ArchOpt, as_json: bool = JsonOpt,
) -> None:
    """Compile every valid variant of a preset and list each with its census."""
    op = get_op(op_name)
    shape = _shape(op, d=d)
    check_arch(arch)
    space = load_space(op, preset)
    valid, rejected = expand(op, shape, space)
    with Progress(TextColumn("compiling"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=err, transient=True, disable=not err.is_terminal) as progress:
        task = progress.add_task("compile", total=len(valid))
        built = build_all(op, shape, valid, arch, progress=lambda: progress.advance(task))
    run = {"m": m}
    if as_json:
        print(json.dumps({"op": op.name, "shape": vars(shape), "preset": space.preset, "arch": arch,
                          "rejected": len(rejected),
                          "variants": [_variant_dict(op, shape, v, run) for v in built]}, indent=2))
        return
    table = Table(title=f"{op.name} {vars(shape)}: {len(built)} valid variants of preset {space.preset} "
                        f"({len(rejected)} combinations rejected), {arch}")
    for column in ("params", "regs", "smem B", "spill B", "x loads", "passes", "bar.sync", "shfl"):
        table.add_column(column, justify="left" if column == "params" else "right")
    for v in built:
        c = v.census
        table.add_row(v.params.label(), str(c.registers), str(c.shared_bytes), str(c.spill_bytes),
                      _widths(c.global_loads, "x"), str(c.passes_over("x")), str(c.bar_sync), str(c.shfl_sync))
    out.print(table)


def _click_exceptions(name: str) -> tuple[type[BaseException], ...]:
    """Typer raises click's exceptions, from click itself or from the copy newer Typers carry."""
    found = []
    for module in ("click.exceptions", "typer._click.exceptions"):
        try:
            found.append(getattr(importlib.import_module(module), name))
        except (ImportError, AttributeError):
            pass
    return tuple(found)


def main() -> None:
    """Entry point: every error a user can cause is one line on stderr and exit code 2."""
    usage_errors, aborts = _click_exceptions("UsageError"), _click_exceptions("Abort")
    try:
        code = app(standalone_mode=False)
    except MageError as exc:
        err.print(f"mage-gen: error: {exc}", markup=False, highlight=False, soft_wrap=True)
        sys.exit(2)
    except usage_errors as exc:
        err.print(f"mage-gen: error: {exc.format_message()}", markup=False, highlight=False, soft_wrap=True)
        sys.exit(2)
    except (KeyboardInterrupt, *aborts):
        err.print("mage-gen: interrupted", markup=False)
        sys.exit(130)
    sys.exit(code if isinstance(code, int) else 0)
