"""A tune's study as one HTML page and the PNGs it shows: what the search measured, what mattered, why the
winner won and how far each variant sits from a limit of the hardware.

Everything is read back from the study (each trial keeps its params, census, gate and hot and cold timings;
the study keeps its final round of finalists and peers) and, where there are several size classes, from the
tuned/ entries of the shape. matplotlib draws every figure; Optuna's evaluator ranks the parameters.
"""

from __future__ import annotations

import datetime
import io
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jinja2
import optuna

from mage_gen.errors import ConfigError, MageError
from mage_gen.fleet import shown
from mage_gen.ops.base import Op, shape_dict
from mage_gen.resources import data_dir
from mage_gen.store import gpu_slug, write_atomic
from mage_gen.timing import Timing

FAILED_COLOR, OK_COLOR, WINNER_COLOR = "#c0392b", "#2e86c1", "#e67e22"


@dataclass(frozen=True)
class Measured:
    """One config the study measured (repeats of a proposal and rejected proposals are not configs)."""

    trial: int
    kernel: str
    params: dict[str, Any]
    value: float | None  # the objective; None where the variant failed
    reason: str
    hot: Timing | None
    cold: Timing | None
    census: dict[str, Any]


@dataclass(frozen=True)
class Limit:
    """What a variant's time is set against: its rate (bytes or flops per µs) over a ceiling of the device."""

    what: str  # e.g. 'copy bandwidth'
    unit: str  # of the rate, e.g. 'TB/s'
    work: float  # bytes or flops per launch
    scale: float  # work per µs -> unit
    ceiling: float | None  # in unit; None where nothing is known
    source: str


def _summaries(storage: str) -> list[Any]:
    # Opening a SQLite URL creates the file and Optuna's tables: a report only reads what a tune left
    if storage.startswith("sqlite:///") and not Path(storage.removeprefix("sqlite:///")).is_file():
        raise MageError(f"storage: {shown(storage)} does not exist; give the --storage the tune used")
    try:
        return optuna.get_all_study_summaries(storage=storage, include_best_trial=False)
    except Exception as exc:  # SQLAlchemy and Optuna raise many kinds for a bad or unreachable URL
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise MageError(f"storage: cannot open Optuna storage {shown(storage)!r} ({first_line}); "
                        "give the --storage the tune used") from None


def find_studies(storage: str, op: Op, shape: Any, run: dict[str, int] | None) -> list[str]:
    """Names of the studies in storage that mage-gen tune made for op and shape (and run, where given)."""
    found = []
    for summary in _summaries(storage):
        identity = summary.user_attrs.get("identity") or {}
        if (identity.get("op") == op.name and identity.get("shape") == shape_dict(shape)
                and (run is None or identity.get("run") == run)):
            found.append(summary.study_name)
    return sorted(found)


def study_identity(storage: str, name: str) -> dict[str, Any]:
    """The identity mage-gen tune gave the study; KeyError where the storage has no such study."""
    for summary in _summaries(storage):
        if summary.study_name == name:
            return summary.user_attrs.get("identity") or {}
    raise KeyError(name)


def measured_copy(gpu_name: str, root: Path = Path("bench/results")) -> tuple[float, str] | None:
    """The device copy bandwidth bench/layernorm.py measured on this GPU model (bytes/µs), and where it is
    recorded; None where no such run is at hand."""
    if not gpu_name:
        return None
    path = root / gpu_slug(gpu_name) / "layernorm.json"
    try:
        recorded = json.loads(path.read_text())["copy_bandwidth_bytes_per_us"]["median_us"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return float(recorded), f"{recorded / 1e6:.2f} TB/s, measured by bench/layernorm.py ({path})"


def measured(study: optuna.Study) -> list[Measured]:
    configs = []
    for t in study.get_trials(deepcopy=False):
        if "params_key" not in t.user_attrs:
            continue
        attrs = t.user_attrs
        configs.append(Measured(
            trial=t.number, kernel=attrs.get("kernel", "?"), params=json.loads(attrs["params_key"]),
            value=t.value if t.state == optuna.trial.TrialState.COMPLETE else None,
            reason=attrs.get("reason", "" if t.state == optuna.trial.TrialState.COMPLETE else t.state.name.lower()),
            hot=Timing.from_dict(attrs["hot"]) if "hot" in attrs else None,
            cold=Timing.from_dict(attrs["cold"]) if "cold" in attrs else None,
            census=attrs.get("census", {})))
    return configs


def limit_of(op: Op, shape: Any, run: dict[str, int], copy_bytes_per_us: tuple[float, str] | None) -> Limit:
    if not hasattr(op, "flops"):  # a memory-bound op
        ceiling, source = (copy_bytes_per_us[0] / 1e6, copy_bytes_per_us[1]) if copy_bytes_per_us else (
            None, "no copy bandwidth measured on this GPU (bench/layernorm.py records one)")
        return Limit("copy bandwidth", "TB/s", op.bytes_moved(shape, run), 1e-6, ceiling, source)
    return Limit("fastest peer", "TFLOP/s", op.flops(shape), 1e-6, None, "the peers of the final round")


def _figure(path: Path, draw) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = draw(plt)
    fig.tight_layout()
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=110)
    plt.close(fig)
    write_atomic(path, png.getvalue())
    return path.name


def _figure_of(objective: str) -> str:
    return "geometric mean of the hot and cold medians" if objective == "both" else f"{objective} median"


def _progress(configs: list[Measured], objective: str):
    def draw(plt):
        fig, ax = plt.subplots(figsize=(7.5, 3.6))
        ok = [c for c in configs if c.value is not None]
        ax.scatter([c.trial for c in ok], [c.value for c in ok], s=14, color=OK_COLOR, label="measured")
        best, line = float("inf"), []
        for c in sorted(configs, key=lambda c: c.trial):
            if c.value is not None:
                best = min(best, c.value)
            line.append((c.trial, best if best < float("inf") else None))
        ax.step([t for t, b in line if b is not None], [b for t, b in line if b is not None], where="post",
                color=WINNER_COLOR, label="best so far")
        failed = [c for c in configs if c.value is None]
        if failed:
            top = max((c.value for c in ok), default=1.0)
            ax.scatter([c.trial for c in failed], [top] * len(failed), marker="x", color=FAILED_COLOR,
                       label="failed (see the table)")
        ax.set_xlabel("trial")
        ax.set_ylabel(f"{_figure_of(objective)}, µs")
        ax.legend(loc="upper right", fontsize=8)
        return fig
    return draw


def _hot_cold(configs: list[Measured], winner: str):
    def draw(plt):
        fig, ax = plt.subplots(figsize=(4.6, 4.2))
        timed = [c for c in configs if c.hot and c.cold]
        ax.scatter([c.hot.median_us for c in timed], [c.cold.median_us for c in timed], s=14, color=OK_COLOR)
        for c in timed:
            if c.kernel == winner:
                ax.scatter([c.hot.median_us], [c.cold.median_us], s=60, color=WINNER_COLOR, label="winner")
        ax.set_xlabel("hot median, µs (L2-warm, graph replay)")
        ax.set_ylabel("cold median, µs (L2 flushed)")
        ax.legend(fontsize=8)
        return fig
    return draw


def _by_parameter(configs: list[Measured], axes: list[str], objective: str):
    def draw(plt):
        cols = min(3, len(axes))
        rows = -(-len(axes) // cols)
        fig, grid = plt.subplots(rows, cols, figsize=(3.2 * cols, 2.6 * rows), squeeze=False)
        ok = [c for c in configs if c.value is not None]
        for i, axis in enumerate(axes):
            ax = grid[i // cols][i % cols]
            values = sorted({c.params[axis] for c in configs if axis in c.params},
                            key=lambda v: (isinstance(v, str), v))  # numbers in order, then words
            for j, value in enumerate(values):
                ys = [c.value for c in ok if c.params.get(axis) == value]
                ax.scatter([j + 0.08 * ((k % 5) - 2) for k in range(len(ys))], ys, s=9, color=OK_COLOR)
            ax.set_xticks(range(len(values)), [str(v) for v in values], fontsize=7)
            ax.set_title(axis, fontsize=9)
        for i in range(len(axes), rows * cols):
            grid[i // cols][i % cols].axis("off")
        grid[0][0].set_ylabel(f"{_figure_of(objective)}, µs")
        return fig
    return draw


def census_columns(configs: list[Measured]) -> dict[str, list[float]]:
    """Per measured config, the census figures the seed's hand-made table held: registers, global loads of each
    width, passes over the inputs, barriers."""
    def loads(census: dict[str, Any], width: str) -> int:
        return sum(widths.get(width, 0) for widths in census.get("global_loads", {}).values())

    columns = {"registers": lambda c: c.get("registers", 0),
               "loads v4": lambda c: loads(c, "v4"), "loads v2": lambda c: loads(c, "v2"),
               "loads scalar": lambda c: loads(c, "scalar"),
               "passes": lambda c: max((max(p) for p in c.get("load_passes", {}).values() if p), default=0),
               "bar.sync": lambda c: c.get("bar_sync", 0)}
    return {name: [float(get(m.census)) for m in configs] for name, get in columns.items()}


def _census(configs: list[Measured], objective: str):
    def draw(plt):
        ok = [c for c in configs if c.value is not None]
        columns = census_columns(ok)
        fig, grid = plt.subplots(2, 3, figsize=(9.6, 5.2), squeeze=False)
        for i, (name, xs) in enumerate(columns.items()):
            ax = grid[i // 3][i % 3]
            ax.scatter(xs, [c.value for c in ok], s=9, color=OK_COLOR)
            ax.set_title(name, fontsize=9)
        grid[0][0].set_ylabel(f"{_figure_of(objective)}, µs")
        grid[1][0].set_ylabel(f"{_figure_of(objective)}, µs")
        return fig
    return draw


def _limit(configs: list[Measured], limit: Limit, peers: dict[str, Any]):
    def draw(plt):
        timed = sorted((c for c in configs if c.hot and c.cold), key=lambda c: c.hot.median_us)
        fig, ax = plt.subplots(figsize=(7.5, 3.6))
        for method, color in (("hot", OK_COLOR), ("cold", "#7d3c98")):
            rates = [limit.work / getattr(c, method).median_us * limit.scale for c in timed]
            ax.plot(range(len(timed)), rates, ".", color=color, label=f"{method}")
        if limit.ceiling:
            ax.axhline(limit.ceiling, color="black", lw=1, label=f"{limit.what} ({limit.ceiling:.2f} {limit.unit})")
        for name, peer in peers.items():
            ax.axhline(limit.work / peer["hot"]["median_us"] * limit.scale, ls="--", lw=0.8, color="grey")
            ax.annotate(f"{name} hot", (0, limit.work / peer["hot"]["median_us"] * limit.scale), fontsize=7)
        ax.set_xlabel("variant, fastest hot first")
        ax.set_ylabel(limit.unit)
        ax.legend(fontsize=8)
        return fig
    return draw


def _importance(study: optuna.Study, axes: list[str]) -> tuple[dict[str, float], str]:
    complete = [t for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))]
    if len(complete) < 2 or not axes:
        return {}, "too few completed trials to rank the parameters"
    try:
        return optuna.importance.get_param_importances(study, params=axes), ""
    except (RuntimeError, ValueError) as exc:
        return {}, f"Optuna could not rank the parameters: {exc}"


def _importance_figure(importances: dict[str, float]):
    def draw(plt):
        fig, ax = plt.subplots(figsize=(5.5, 0.35 * len(importances) + 1.2))
        names = list(importances)[::-1]
        ax.barh(names, [importances[n] for n in names], color=OK_COLOR)
        ax.set_xlabel("importance (Optuna, fANOVA)")
        return fig
    return draw


def write_report(op: Op, shape: Any, storage: str, study_name: str, out_dir: Path,
                 size_classes: dict[str, dict[str, Any]], copy_bytes_per_us: tuple[float, str] | None) -> Path:
    """The page (out_dir/index.html) and its PNGs; returns the page's path."""
    study = optuna.load_study(study_name=study_name, storage=storage)
    identity = study.user_attrs.get("identity") or {}
    objective, run = identity.get("objective", "hot"), identity.get("run", {})
    configs = measured(study)
    if not configs:
        raise ConfigError(f"report: study {study_name!r} has measured nothing yet; run the tune first")
    final = study.user_attrs.get("final_round") or {}
    winner = final.get("winner") or min((c for c in configs if c.value is not None), key=lambda c: c.value,
                                        default=configs[0]).kernel
    axes = [a for a in sorted({k for c in configs for k in c.params}) if len({str(c.params.get(a)) for c in configs}) > 1]
    limit = limit_of(op, shape, run, copy_bytes_per_us)
    importances, importance_note = _importance(study, axes)
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise MageError(f"report: cannot create {out_dir}: {exc.strerror or exc}; give a writable -o") from None
    figures = {
        "progress": _figure(out_dir / "progress.png", _progress(configs, objective)),
        "hot_cold": _figure(out_dir / "hot_cold.png", _hot_cold(configs, winner)),
        "parameters": _figure(out_dir / "parameters.png", _by_parameter(configs, axes or ["template"], objective)),
        "census": _figure(out_dir / "census.png", _census(configs, objective)),
        "limit": _figure(out_dir / "limit.png", _limit(configs, limit, final.get("peers", {}))),
    }
    if importances:
        figures["importance"] = _figure(out_dir / "importance.png", _importance_figure(importances))
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(data_dir("templates")), undefined=jinja2.StrictUndefined,
                             autoescape=True, trim_blocks=True, lstrip_blocks=True)
    page = env.get_template("report/page.html.j2").render(
        op=op.name, shape=json.dumps(shape_dict(shape)), run=json.dumps(run), identity=identity, study=study_name,
        storage=storage, objective=objective, ranked_by=_figure_of(objective), figures=figures, importances=importances,
        importance_note=importance_note, configs=configs, failed=[c for c in configs if c.value is None],
        final=final, winner=winner, limit=limit, size_classes=size_classes,
        made=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
    path = out_dir / "index.html"
    write_atomic(path, page.encode())
    return path
