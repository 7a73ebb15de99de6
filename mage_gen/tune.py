"""The search: Optuna trials mapped to an op's params and back.

Exhaustive when the valid space is small, TPE otherwise. Infeasible suggestions are rejected before the
compiler and do not use up the trial budget; a config already measured (in this run or an earlier one
of the same study) is answered from the study, not measured again; a failed compile or gate is a failed
trial with its reason. Finalists are re-timed interleaved with the peers, and a winner that does not
beat the runner-up by more than their spread is a tie, broken by the other method (hot for a cold objective,
cold for a hot one; under `both`, a tie is one on each method), then for the stored winner, then by fewer
registers, then fewer threads.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import hashlib
import json
import os
import random
import socket
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import optuna
import platformdirs
from optuna.storages._heartbeat import get_heartbeat_thread, is_heartbeat_enabled

from mage_gen import __version__
from mage_gen.backends import Backend
from mage_gen.compile import nvrtc_version
from mage_gen.errors import CompileError, ConfigError, MageError
from mage_gen.ops import Op
from mage_gen.ops.base import shape_dict
from mage_gen.space import Space, rejection, tally, valid_params
from mage_gen.timing import OBJECTIVES, RoundRatio, Timing, by_objective, round_ratio
from mage_gen.variants import Variant, build, prebuild

optuna.logging.set_verbosity(optuna.logging.WARNING)  # the CLI reports progress itself
# fail_stale_trials is marked experimental; it is what study.optimize itself calls to recover dead workers' trials
warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
# measure() keeps the heartbeats itself, as study.optimize does (ask and tell alone would not)
warnings.filterwarnings("ignore", message="Heartbeat of storage is supposed to be used with Study.optimize")

EXHAUSTIVE_LIMIT = 64
DEFAULT_TPE_TRIALS = 96
FINALISTS = 5
# TPE measures a budget of configs; where the unmeasured are at most this many times the budget, it will
# try most of them, and compiling them all in parallel first is cheaper than one at a time.
_PREBUILD_PER_TRIAL = 4
_STALLS_BEFORE_FILL = 3  # proposals in a row that measure nothing before an unmeasured config is enqueued
_DRAIN_POLL_S = 0.5
_CLAIM_SETTLE_S = 0.2  # longer than a trial takes to reach a server storage once asked
WORKER = f"{socket.gethostname()}:{os.getpid()}"  # which process measured a trial
_ASK_LIMIT = 50  # proposals per config of budget: past it the study is broken (waiting trials piling up)


@dataclass(frozen=True)
class Finalist:
    name: str  # kernel name
    params: Any
    registers: int
    threads: int
    hot: Timing
    cold: Timing
    census: dict[str, Any]
    template: str
    template_hash: str
    source_hash: str
    # method -> the samples of each interleaved round of the final round, where the backend keeps them
    rounds: dict[str, list[list[float]]] | None = None

    def timing(self, objective: str) -> Timing:
        return by_objective(self.hot, self.cold, objective)

    def versus(self, other: Finalist, method: str) -> RoundRatio | None:
        """This one's time over the other's by paired rounds, where both were timed in the same rounds."""
        if self.rounds is None or other.rounds is None:
            return None
        return round_ratio(self.rounds[method], other.rounds[method])

    def keeps_up_with(self, other: Finalist, method: str) -> bool:
        """Not told slower than the other on a method (hot or cold): by paired rounds, else by their spreads. The
        finalists are ranked by their pooled medians, which a paired comparison may order the other way."""
        paired = self.versus(other, method)
        if paired is None:
            mine, theirs = self.timing(method), other.timing(method)
            return mine.median_us <= theirs.median_us or mine.ties_with(theirs)
        return paired.verdict != "slower"


@dataclass(frozen=True)
class Outcome:
    """A measured config as the study remembers it: its objective value, or why it failed."""

    trial: int
    value: float | None
    kernel: str
    reason: str

    @classmethod
    def of(cls, t: optuna.trial.FrozenTrial) -> Outcome:
        ok = t.state == optuna.trial.TrialState.COMPLETE
        return cls(trial=t.number, value=t.value if ok else None, kernel=t.user_attrs.get("kernel", "?"),
                   reason="" if ok else t.user_attrs.get("reason", "failed"))


@dataclass(frozen=True)
class TuneResult:
    study: str
    sampler: str
    valid: int
    rejected: int
    measured: int  # configs measured by this run
    reused: int  # configs measured by earlier runs of the study, not measured again
    failed: dict[str, str]  # kernel -> reason, over the whole study
    winner: Finalist
    runner_ups: list[Finalist]
    tie: bool
    tied_with: list[str]
    peers: dict[str, dict[str, Any]]  # name -> {'hot': Timing, 'cold': Timing, 'config': {...}}
    dropped: dict[str, str] = field(default_factory=dict)
    kept_stored: bool = False  # a tie, and the size class's stored winner among the tied, so kept
    # where this process's trials spent their time, seconds per trial (measure.Evaluation.seconds); empty when
    # its backend does not say (a replay)
    trial_seconds: dict[str, float] = field(default_factory=dict)

    def entry(self, op: Op, shape: Any, run: dict[str, int], device: dict[str, Any], objective: str) -> dict[str, Any]:
        """The tuned/ record of this result, provenance included."""
        w = self.winner
        return {
            "shape": shape_dict(shape), "run": run, "dtype": getattr(shape, "dtype", "float32"), "params": op.params_to_dict(w.params),
            "kernel": w.name, "template": w.template, "template_hash": w.template_hash, "source_hash": w.source_hash,
            **self.final_round(op, objective),
            "census": w.census, "gpu": device, "nvrtc": nvrtc_version(), "mage_gen": __version__,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "study": self.study, "search": {"sampler": self.sampler, "valid": self.valid, "rejected": self.rejected,
                                             "measured": self.measured, "reused": self.reused,
                                             "failed": len(self.failed)},
        }


    @property
    def tie_test(self) -> str:
        """How the finalists were told apart: 'paired rounds', or 'spreads' where the backend kept no rounds."""
        return "paired rounds" if all(f.rounds is not None for f in (self.winner, *self.runner_ups)) else "spreads"

    def winner_over_peer(self, peer: str) -> dict[str, RoundRatio]:
        """The winner's time over the peer's by paired rounds, hot and cold; {} where the round kept no rounds."""
        mine, theirs = self.winner.rounds, self.peers[peer].get("rounds")
        if mine is None or theirs is None:
            return {}
        return {m: round_ratio(mine[m], theirs[m]) for m in ("hot", "cold")}

    def final_round(self, op: Op, objective: str) -> dict[str, Any]:
        """The finalists re-timed beside the peers, and what ranked them (kept on the study too)."""
        w = self.winner
        return {
            "objective": objective,
            "timings": {"hot": w.hot.to_dict(), "cold": w.cold.to_dict()},
            "peers": {name: {"hot": p["hot"].to_dict(), "cold": p["cold"].to_dict(), "config": p["config"],
                             **({"winner_over_peer": {m: r.to_dict() for m, r in over.items()}}
                                if (over := self.winner_over_peer(name)) else {})}
                      for name, p in self.peers.items()},
            "tie": self.tie, "tied_with": self.tied_with, "tie_test": self.tie_test,
            "runner_ups": [{"kernel": f.name, "params": op.params_to_dict(f.params), "registers": f.registers,
                            "hot": f.hot.to_dict(), "cold": f.cold.to_dict(),
                            **({"over_winner": {m: f.versus(w, m).to_dict() for m in ("hot", "cold")}}
                               if f.versus(w, "hot") else {})} for f in self.runner_ups],
        }


IN_MEMORY = "memory"  # the storage of a study that lives only as long as the command (a replay's, by default)


def default_storage() -> str:
    folder = Path(platformdirs.user_data_dir("mage-gen"))
    folder.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{folder / 'studies.db'}"


def params_key(op: Op, params: Any) -> str:
    return json.dumps(op.params_to_dict(params), sort_keys=True)


def _open_study(name: str, storage: str, sampler: optuna.samplers.BaseSampler, identity: dict[str, Any]
                ) -> optuna.Study:
    try:
        if isinstance(storage, str) and storage.startswith("sqlite:"):
            storage = optuna.storages.RDBStorage(storage)
        study = optuna.create_study(study_name=name, storage=None if storage == IN_MEMORY else storage,
                                    sampler=sampler, direction="minimize", load_if_exists=True)
    except Exception as exc:  # SQLAlchemy and Optuna raise many kinds for a bad or unreachable URL
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise MageError(f"storage: cannot open Optuna storage {storage!r} ({first_line}); "
                        "give a reachable database URL with --storage") from None
    stored = study.user_attrs.get("identity")
    if stored is None:
        # Adopt only an empty minimising study: another tool's trials or direction would make Optuna fail
        # mid-search (its distributions cannot change) or rank backwards.
        foreign = study.get_trials(deepcopy=False)
        if foreign or study.directions != [optuna.study.StudyDirection.MINIMIZE]:
            raise ConfigError(f"study: study {name!r} was not made by mage-gen tune (no identity, "
                              f"{len(foreign)} trial(s), {', '.join(d.name.lower() for d in study.directions)}); "
                              "choose another --study name")
        study.set_user_attr("identity", identity)
    elif stored != identity:
        raise ConfigError(f"study: study {name!r} belongs to {stored}, not {identity}; "
                          "choose another --study name")
    if isinstance(storage, optuna.storages.RDBStorage) and storage.engine.name == "sqlite":
        _journal_ahead(storage)  # only now: a file holding another's study is left as it was
    return study


def _journal_ahead(storage: optuna.storages.RDBStorage) -> None:
    """A SQLite file's journal written ahead (WAL), synced at checkpoints only, from the next connection on.
    Optuna commits each param of each proposal, a hundred commits a trial, and with SQLite's defaults every one
    waits for the disk: on a 2-core host with a slow disk, 96 instant trials took 46.8 s of bookkeeping, 18.3 s
    so. A finished trial still outlives the process; only a power cut can take the last commits, never the file."""
    import sqlalchemy

    def journal_ahead(connection: Any, _record: Any) -> None:
        connection.execute("PRAGMA journal_mode=WAL")
        connection.execute("PRAGMA synchronous=NORMAL")

    sqlalchemy.event.listen(storage.engine, "connect", journal_ahead)
    storage.engine.dispose()  # the connections opened so far have not heard of it


def space_id(space: Space) -> str:
    """Optuna cannot reopen a study whose categorical choices changed: the space is part of its identity."""
    axes = {axis: list(values) for axis, values in space.axes}
    return hashlib.sha256(json.dumps(axes, sort_keys=True).encode()).hexdigest()[:8]


def tune(op: Op, shape: Any, run: dict[str, int], space: Space, backend: Backend, *, objective: str = "hot",
         trials: int | None = None, storage: Any = None, study_name: str | None = None, seed: int = 0,
         progress: Callable[[str, int, int], None] | None = None,
         helpers: Callable[[optuna.Study], Any] | None = None, incumbent: Any = None,
         unrecorded: Sequence[str] = (), seeds: Sequence[Any] = ()) -> TuneResult:
    """Search, then re-time the finalists beside the peers. storage: a URL or an Optuna storage. helpers: called
    with the opened study, it starts other workers on it (fleet.py) and returns a handle whose wait() is called
    before the final round; their trials count towards the same budget. incumbent: the params of the size
    class's stored winner; where they lie in the space and the study has not measured them, they are measured
    first, so that a search over another preset always has the stored winner among its candidates; in the space or
    not, it is re-timed in the final round. unrecorded: axes
    the stored winner's entry does not name (it was tuned before they existed): the incumbent at each of their other
    values in the space is measured first too, the one new lever tried on the config that won without it. seeds:
    params that won at other shapes (dispatch.SEED_RULE), measured next where the space holds them. Then the
    space's `first` configs (the peers' shapes) that lie in it, each re-timed in the final round too."""
    if objective not in OBJECTIVES:
        raise ConfigError(f"objective: must be one of {', '.join(OBJECTIVES)}, got {objective!r}")
    counted = tally(op, shape, space, backend.arch)
    valid = counted.valid
    if not valid:
        raise ConfigError(f"space: no config of preset {space.preset} is valid for {op.name} {shape_dict(shape)}; "
                          f"first rejection: {counted.first_rejection or 'none'}; a wider preset "
                          "(--preset full) may hold some")
    exhaustive = len(valid) <= EXHAUSTIVE_LIMIT
    budget = min(trials or (len(valid) if exhaustive else DEFAULT_TPE_TRIALS), len(valid))  # configs in all
    identity = {"op": op.name, "shape": shape_dict(shape), "run": run, "objective": objective, "arch": backend.arch,
                "gpu": backend.device["name"], "preset": space.preset, "space": space_id(space)}
    name = study_name or "{op}-{shape}-m{m}-{gpu}-{arch}-{objective}-{preset}-{space}".format(
        op=op.name, shape=op.slug(shape), m="x".join(map(str, run.values())), objective=objective,
        gpu=backend.device["name"].replace(" ", "_"), arch=backend.arch, preset=space.preset, space=identity["space"])
    study = _open_study(name, storage or default_storage(), _sampler(exhaustive, seed), identity)
    study.set_user_attr("budget", budget)  # what a worker joining the study measures towards
    keys = _keys(op, valid)
    from_earlier_runs = len(_finished(study, op, shape, keys))
    first = _first(op, shape, space)
    starting = [*(_beside(incumbent, space, unrecorded) if incumbent is not None else ()), *seeds, *first]
    if from_earlier_runs < budget:
        for params in starting:
            _start_with(study, op, shape, keys, params)
    # Compile in parallel, up front, what the search will measure (all of it when exhaustive; every unmeasured
    # config where TPE will try most of them; else the configs it measures first), each trial then finding its
    # variant in the cache: compiled one at a time by their trials, they would leave the GPU idle meanwhile.
    finished = _finished(study, op, shape, keys)
    unmeasured = [p for k, p in keys.items() if k not in finished]
    left = budget - from_earlier_runs
    if exhaustive:
        ahead = unmeasured[:left]
    elif len(unmeasured) <= _PREBUILD_PER_TRIAL * left:
        ahead = unmeasured
    else:
        enqueued = {params_key(op, p): p for p in starting if params_key(op, p) in keys}
        ahead = [p for k, p in enqueued.items() if k not in finished][:max(left, 0)]
    prebuild(op, shape, ahead, backend.arch, progress=(lambda i, n: progress("compiling", i, n)) if progress else None)
    others = helpers(study) if helpers else None
    try:
        # with other workers, what they claimed is waited for: finished, or failed for a dead worker and retried
        measured = measure(op, shape, space, backend, study, budget, objective, seed, progress,
                           drain=others is not None)
    finally:
        if others is not None:
            others.wait()
    done = _finished(study, op, shape, keys)
    return _finish(op, shape, study, done, valid, counted.rejected, backend, objective, measured, from_earlier_runs,
                   "exhaustive" if exhaustive else "tpe", progress, {params_key(op, p) for p in first}, incumbent)


def _first(op: Op, shape: Any, space: Space) -> list[Any]:
    """The space's `first` configs (the peers' shapes), every axis they do not name at the op's default."""
    return [op.params_from_dict({**op.defaults(shape), **dict(values)}) for values in space.first]


def _seconds_per_trial(study: optuna.Study) -> dict[str, float]:
    """The mean of each part of the trials this process measured (other workers and earlier runs left out)."""
    own = [t.user_attrs["seconds"] for t in study.get_trials(deepcopy=False)
           if t.user_attrs.get("worker") == WORKER and "seconds" in t.user_attrs]
    parts = dict.fromkeys(part for s in own for part in s)  # a trial that failed its gate was not timed
    return {part: sum(s.get(part, 0.0) for s in own) / len(own) for part in parts}


def _start_with(study: optuna.Study, op: Op, shape: Any, keys: dict[str, Any], params: Any) -> None:
    """Enqueue params as the study's next trial unless they are outside the space (keys: its valid configs by
    params key) or measured already."""
    key = params_key(op, params)
    if key not in keys or key in _finished(study, op, shape, keys):
        return
    fixed = json.loads(key)
    if fixed not in _waiting(study):  # left by an interrupted run
        study.enqueue_trial(fixed)


def _beside(incumbent: Any, space: Space, axes: Sequence[str]) -> list[Any]:
    """The incumbent, then the incumbent at each other value the space gives each of these axes."""
    values = dict(space.axes)
    return [incumbent, *(dataclasses.replace(incumbent, **{axis: value}) for axis in axes
                         for value in values.get(axis, ()) if value != getattr(incumbent, axis))]


def _waiting(study: optuna.Study) -> list[dict[str, Any]]:
    """The params of the enqueued trials no worker has asked for yet."""
    return [t.system_attrs.get("fixed_params") for t in
            study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.WAITING,))]


def _sampler(exhaustive: bool, seed: int) -> optuna.samplers.BaseSampler:
    return optuna.samplers.RandomSampler(seed=seed) if exhaustive else optuna.samplers.TPESampler(seed=seed)


def _keys(op: Op, valid: list[Any]) -> dict[str, Any]:
    """The valid configs by params key: computed once per search (a full preset holds 10⁴ and more, and the
    search consults them at every proposal)."""
    return {params_key(op, p): p for p in valid}


def _finished(study: optuna.Study, op: Op, shape: Any, keys: dict[str, Any]) -> dict[str, Outcome]:
    """The valid configs (keys, from _keys) the study has measured, from any worker or earlier run: {params key:
    outcome}. A result measured from another kernel text is stale (as is one recorded before the text was
    hashed), and a trial failed for want of a heartbeat (its worker died) measured nothing: those are measured
    again."""
    done: dict[str, Outcome] = {}
    for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.FAIL)):
        key = t.user_attrs.get("params_key")
        if key not in keys or key in done:
            continue
        if t.state == optuna.trial.TrialState.FAIL and "reason" not in t.user_attrs:
            continue
        if t.user_attrs.get("source_hash") == _source_hash(op, shape, keys[key]):
            done[key] = Outcome.of(t)
    return done


@functools.lru_cache(maxsize=4096)
def _source_hash(op: Op, shape: Any, params: Any) -> str:  # rendered only for configs a trial touches
    return op.source(shape, params).source_hash


def measure(op: Op, shape: Any, space: Space, backend: Backend, study: optuna.Study, budget: int, objective: str,
            seed: int, progress: Callable[[str, int, int], None] | None = None, drain: bool = False) -> int:
    """Ask, claim, measure and tell until the study holds `budget` measured configs, counting those other
    workers hold; returns how many this worker measured. Safe for many workers on one study: a config is
    measured by the worker whose trial claimed it first (the lowest trial number among the running ones).
    drain: once the rest is claimed, wait for those claims to finish (or fail, their worker dead, and be
    retried) instead of returning."""
    valid = valid_params(op, shape, space, backend.arch)
    valid_keys = _keys(op, valid)
    exhaustive = len(valid) <= EXHAUSTIVE_LIMIT
    # An axis of one value is no choice: asked of the study, it would cost each proposal a storage write and the
    # sampler a model, however many are rejected (half a tune's host time went to proposals). Trials carry it
    # in their params key, not their Optuna params.
    distributions = {axis: optuna.distributions.CategoricalDistribution(values) for axis, values in space.axes
                     if len(values) > 1}
    settled = {axis: values[0] for axis, values in space.axes if len(values) == 1}
    fill = random.Random(seed)
    measured = stalls = asks = 0
    if not _shared(study):
        # A storage without heartbeats serves one worker, this one: a trial still running was left by a run that was
        # killed, after it claimed a config or between its proposal and its claim. Left running, it would hold that
        # config, or a share of the budget, for ever (fail_stale_trials needs heartbeats); failed, it measured nothing.
        for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,)):
            study.tell(t.number, state=optuna.trial.TrialState.FAIL)
    while True:
        optuna.storages.fail_stale_trials(study)  # a dead worker's trial: failed, its config enqueued again
        done = _finished(study, op, shape, valid_keys)
        running = _claims(study)
        if len(done) >= budget:
            break
        if len(done) + len(set(running.values()) - set(done)) >= budget:
            if not drain:
                break
            time.sleep(_DRAIN_POLL_S)
            continue
        asks += 1
        if asks > _ASK_LIMIT * budget:
            raise MageError(f"tune: study {study.study_name} made {asks} proposals without reaching {budget} configs; "
                            "start a new one with --study NAME")
        if (exhaustive or stalls >= _STALLS_BEFORE_FILL) and not _waiting(study):
            # In order when exhaustive; when TPE keeps proposing measured or rejected configs, an unmeasured one.
            # A trial already enqueued (the stored winner) is asked first: nothing more is enqueued until it is.
            remaining = [k for k in valid_keys if k not in done and k not in running.values()]
            if remaining:
                study.enqueue_trial(json.loads(remaining[0] if exhaustive else fill.choice(remaining)))
            stalls = 0
        trial = study.ask(distributions)
        params = op.params_from_dict({**settled, **trial.params})
        key = params_key(op, params)
        if key not in valid_keys:
            try:
                op.validate(shape, params)
                reason = "not in the preset's valid set"
            except ConfigError as exc:
                reason = str(exc)
            trial.set_user_attr("rejected", reason)
            study.tell(trial, state=optuna.trial.TrialState.PRUNED)
            stalls += 1
            continue
        if key in done:
            earlier = done[key]
            trial.set_user_attr("repeat_of", earlier.trial)
            if earlier.value is None:
                study.tell(trial, state=optuna.trial.TrialState.FAIL)
            else:
                study.tell(trial, earlier.value)
            stalls += 1
            continue
        trial.set_user_attr("claim", key)
        why = _yields(study, trial, key, budget, op, shape, valid_keys)
        if why is None and _shared(study):
            # A trial asked just before this one may reach the storage a moment later: look again once it has.
            time.sleep(_CLAIM_SETTLE_S)
            why = _yields(study, trial, key, budget, op, shape, valid_keys)
        if why is not None:
            trial.set_user_attr("yielded", why)
            study.tell(trial, state=optuna.trial.TrialState.PRUNED)
            stalls += not why.startswith("the budget")
            continue
        trial.set_user_attr("params_key", key)
        trial.set_user_attr("source_hash", _source_hash(op, shape, params))
        trial.set_user_attr("worker", WORKER)
        # As study.optimize does (ask and tell do not): where the storage keeps heartbeats, a worker that dies
        # leaves a trial fail_stale_trials marks failed after the grace period.
        with get_heartbeat_thread(trial._trial_id, study._storage):
            value, kernel, reason = _measure(op, shape, params, backend, trial, objective)
        if value is None:
            study.tell(trial, state=optuna.trial.TrialState.FAIL)
        else:
            study.tell(trial, value)
        measured += 1
        stalls = 0
        if progress:
            progress("trials", len(done) + 1, budget)
    return measured


def _yields(study: optuna.Study, trial: optuna.Trial, key: str, budget: int, op: Op, shape: Any,
            keys: dict[str, Any]) -> str | None:
    """Why this trial must leave its config to another, or None. Running trials count in the order they were
    asked (an enqueued trial's number is older than its asking), which every worker reads alike from the
    storage: the first to ask for a config measures it, and trials asked before this one take the budget
    first; one not yet claiming counts as if it will (this one asks again if that was wrong)."""
    running = {(t.datetime_start, t.number): t.user_attrs.get("claim")
               for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,))}
    mine = next(order for order in running if order[1] == trial.number)
    holder = min((order for order, k in running.items() if k == key), default=mine)
    if holder < mine:
        return f"claimed by trial {holder[1]}"
    ahead = {k if k is not None else f"#{order[1]}" for order, k in running.items() if order < mine}
    finished = _finished(study, op, shape, keys)
    if key in finished:
        return "measured by another worker since it was asked"
    if len(finished) + len(ahead - set(finished)) >= budget:
        return "the budget is taken by trials asked before it"
    return None


def _shared(study: optuna.Study) -> bool:
    """Whether other workers may be asking this study: a server storage, which keeps heartbeats."""
    return is_heartbeat_enabled(study._storage)


def _claims(study: optuna.Study) -> dict[int, str]:
    """The configs running trials have claimed: {trial number: params key}."""
    return {t.number: t.user_attrs["claim"] for t in study.get_trials(deepcopy=False,
                                                                      states=(optuna.trial.TrialState.RUNNING,))
            if "claim" in t.user_attrs}


def _measure(op: Op, shape: Any, params: Any, backend: Backend, trial: optuna.Trial, objective: str
             ) -> tuple[float | None, str, str]:
    """(objective value or None, kernel name, why it failed); everything learned goes on the trial."""
    kernel = op.kernel_name(shape, params)
    trial.set_user_attr("kernel", kernel)
    try:
        variant = build(op, shape, params, backend.arch)
    except (CompileError, ConfigError) as exc:
        reason = f"compile: {str(exc).splitlines()[0]}"
        trial.set_user_attr("reason", reason)
        return None, kernel, reason
    trial.set_user_attr("census", variant.census.to_dict())
    evaluation = backend.evaluate(variant)
    if evaluation.seconds:
        trial.set_user_attr("seconds", {part: round(s, 4) for part, s in evaluation.seconds.items()})
    trial.set_user_attr("gate", evaluation.gate.to_dict())
    if not evaluation.gate.passed:
        reason = f"gate: {evaluation.gate.reason}"
        trial.set_user_attr("reason", reason)
        return None, kernel, reason
    trial.set_user_attr("hot", evaluation.hot.to_dict())
    trial.set_user_attr("cold", evaluation.cold.to_dict())
    return by_objective(evaluation.hot, evaluation.cold, objective).median_us, kernel, ""


def _finish(op, shape, study, done, valid, rejected, backend, objective, measured, reused, sampler, progress,
            first, incumbent=None):
    completed = sorted((k for k, o in done.items() if o.value is not None), key=lambda k: done[k].value)
    failed = {o.kernel: o.reason for o in done.values() if o.value is None}
    if not completed:
        raise MageError(f"tune: every measured variant failed; first failure: {next(iter(failed.values()), '?')}")
    # The fastest by the study's one measurement each, and the peers' shapes (the space's `first`) wherever the
    # study ranked them: one timing of each cannot tell configs within a percent or two apart, and the final
    # round, beside the peers, is where a peer's own shape is to be beaten or kept (bench/NOTES.md, norms §16).
    chosen = completed[:FINALISTS] + [k for k in completed[FINALISTS:] if k in first]
    finalists: list[Variant] = [build(op, shape, op.params_from_dict(json.loads(k)), backend.arch) for k in chosen]
    # The stored winner too, however the study ranked it, or whether it could (outside the preset, it was never
    # measured): a retune replaces it only by beating it beside the peers, never because another preset lacks it.
    if (incumbent is not None and params_key(op, incumbent) not in chosen
            and rejection(op, shape, incumbent, backend.arch) is None):
        finalists.append(build(op, shape, incumbent, backend.arch))
    timings, peer_configs, dropped = backend.final(
        finalists, progress=(lambda done, total: progress("final", done, total)) if progress else None)
    ranked = [
        Finalist(name=v.source.kernel_name, params=v.params, registers=v.census.registers,
                 threads=op.geometry(shape, v.params, {k: 1 for k in op.run_dims}).threads,
                 hot=timings[v.source.kernel_name]["hot"], cold=timings[v.source.kernel_name]["cold"],
                 census=v.census.to_dict(), template=v.source.template, template_hash=v.source.template_hash,
                 source_hash=v.source.source_hash, rounds=timings[v.source.kernel_name].get("rounds"))
        for v in finalists if v.source.kernel_name in timings
    ]
    if not ranked:
        raise MageError(f"tune: every finalist failed its second gate: {dropped}")
    ranked.sort(key=lambda f: f.timing(objective).median_us)
    fastest = ranked[0]
    if objective == "both":
        # a tie on both methods at once: a kernel several percent slower on one of them must not pass for a tie
        # because the other's spread is wide
        tied = [f for f in ranked if f.keeps_up_with(fastest, "hot") and f.keeps_up_with(fastest, "cold")]
        tied_on_both = tied
    else:
        tied = [f for f in ranked if f.keeps_up_with(fastest, objective)]
        # Tied on the objective, a kernel the other method times faster is the better one to keep: a size class
        # tuned hot is also launched cold.
        other = "cold" if objective == "hot" else "hot"
        best_other = min(tied, key=lambda f: f.timing(other).median_us)
        tied_on_both = [f for f in tied if f.keeps_up_with(best_other, other)]
    # Within a tie on both, the stored winner where it is among them (a retune replaces it only by beating it:
    # otherwise each retune's draw of the spread could swap a size class's kernel for a tie), else the frugal one.
    stored_key = params_key(op, incumbent) if incumbent is not None else None
    stored = [f for f in tied_on_both if params_key(op, f.params) == stored_key]
    winner = stored[0] if stored else min(tied_on_both,
                                          key=lambda f: (f.registers, f.threads, f.timing(objective).median_us))
    peers = {name: {**timings[name], "config": peer_configs.get(name, {})} for name in peer_configs}
    result = TuneResult(
        study=study.study_name, sampler=sampler, valid=len(valid), rejected=rejected, measured=measured,
        reused=reused, failed=failed, winner=winner, runner_ups=[f for f in ranked if f is not winner],
        tie=len(tied) > 1, tied_with=[f.name for f in tied if f is not winner],
        kept_stored=bool(stored) and len(tied) > 1, peers=peers, dropped=dropped,
        trial_seconds=_seconds_per_trial(study))
    # the report reads the final round from the study, whichever tuned/ entry it led to
    study.set_user_attr("final_round", {"winner": winner.name, "winner_params": op.params_to_dict(winner.params),
                                        "winner_registers": winner.registers, **result.final_round(op, objective)})
    return result
