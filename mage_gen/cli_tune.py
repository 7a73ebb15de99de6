"""The command line's tuning commands: `tune` (a study per size class on this GPU or several, its winner stored in
tuned/ and emitted), `worker` (a host joining a running tune) and `report` (a tune's study as a page of plots).
Registered on mage_gen.cli's app, whose helpers they share."""

from __future__ import annotations

import os
import time
from functools import partial
from pathlib import Path
from typing import Any, Optional

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from mage_gen import dispatch
from mage_gen.cli import (DOpt, DTypeOpt, KOpt, NOpt, OpArg, PrecisionOpt, WeightDTypeOpt, _PRESETS, _a_tenth_more,
                          _emit_tuned, _gpu_facts, _log, _parse_sizes, _problem, _shape_only_config, _widths, app, err,
                          out)
from mage_gen.compile import check_arch
from mage_gen.emit import check_out_dir, shape_arguments
from mage_gen.errors import MageError, NoGpuError
from mage_gen.ops import Op, get_op
from mage_gen.ops.base import shape_dict
from mage_gen.space import load_space, valid_params
from mage_gen.store import (check_can_save, entry_key, other_gpus_params, save_entry, shape_entries, stored_axes,
                            stored_params, tuned_shapes)
from mage_gen.timing import OBJECTIVES, Timing, by_objective

# What only `tune` needs (Optuna, the measuring worker, and through the final round torch and Triton) is
# imported inside it: every other command starts without them.
EXHAUSTIVE_LIMIT, DEFAULT_TPE_TRIALS = 64, 96  # mage_gen.tune's; a test holds the two in step
SEEDS = 3  # winners of the nearest tuned shapes a size class's search measures after its own (dispatch.SEED_RULE)


def _trial_seconds_line(seconds: dict[str, float]) -> str:
    """'a trial, on average: load 0.01 s, gate 0.31 s (host 0.25 s), timing 0.12 s'; the rest of a trial's share
    of the measuring phase is the tuner's own (proposals, storage) and its worker's round trips."""
    s = {part: seconds.get(part, 0.0) for part in ("load", "gate", "gate_host", "timing")}
    return (f"a trial, on average: load {s['load']:.2f} s, gate {s['gate']:.2f} s (host {s['gate_host']:.2f} s), "
            f"timing {s['timing']:.2f} s")


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


def _starting_points(op: Op, shape: Any, run: dict[str, int], space: Any, gpu_name: str, tuned: Path | None,
                     store: bool) -> tuple[Any, list[str], list[tuple[Any, Any]], list[str]]:
    """What a size class's search measures first: (its stored winner, or with none the winner of the class that
    serves its shape now; the axes a stored winner predates; the winner of the class that would serve the shape
    without its own entry, where a stored winner is first, then this size class's winners on other GPUs, then the
    nearest tuned shapes and their winners (dispatch.SEED_RULE); and the lines that say so)."""
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
    elsewhere = {}  # params -> the GPUs whose winner of this size class they are
    for gpu, params in other_gpus_params(op, shape, run, gpu_name, tuned):
        if params != incumbent and all(params != p for _, p in seeds):
            elsewhere.setdefault(params, []).append(gpu)
    if elsewhere:
        notes.append(f"  {'then' if incumbent is not None else 'first'}, where the preset holds it, this size class's "
                     "winner on " + "; ".join(", ".join(gpus) for gpus in elsewhere.values()))
        seeds += [(shape, params) for params in elsewhere]
    nearest = [(other, params) for other, params in dispatch.neighbours(op, shape, others, SEEDS + 2)
               if params != incumbent and all(params != p for _, p in seeds)][:SEEDS]
    if nearest:
        notes.append(f"  {'then' if incumbent is not None or elsewhere else 'first'}, where the preset holds them, the "
                     "winners of the nearest tuned shapes: " + "; ".join(str(shape_dict(other)) for other, _ in nearest))
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
