"""The tuner's logic on the CPU: ReplayBackend answers every measurement from timings recorded on an H200
by bench/probes/layernorm_trials.py, so the sampler, dedupe, resume, failures and the tie rule run as they
would on the GPU. Variants are still really compiled (into the session's private cache): registers
and template hashes are real.

The searches run over the quick preset as far as the recording holds it (a recording made before an
axis was added holds only that axis's default) and over small corners of it. Where a test needs content
the recording lacks (a tie, a failed gate), it writes a modified copy of the recording into its tmp_path
and says so.
"""

import dataclasses
import collections
import json
import sqlite3
from pathlib import Path

import numpy as np
import optuna
import pytest

from mage_gen import variants as variants_module
from mage_gen.backends import ReplayBackend
from mage_gen.errors import CompileError, ConfigError, MageError
from mage_gen.ops.layernorm import LayerNorm
from mage_gen.space import Space, expand
from mage_gen.store import entry_key, load_entry, load_winner, save_entry
from mage_gen.timing import Timing, by_objective
from mage_gen.tune import EXHAUSTIVE_LIMIT, FINALISTS, params_key, tune
from mage_gen.variants import build_all
from replayed import H200, OP, QUICK, RUN, SHAPE, by_kernel, hot_median, sqlite  # tests/replayed.py


# ---- search spaces: the quick preset, as far as the recording holds it ----

@pytest.fixture(scope="session")
def recorded(recording_doc) -> Space:
    """The quick preset narrowed to the axis values the recording holds (a recording made before an axis
    existed holds only that axis's default), so that ReplayBackend can answer every config in it."""
    held = [OP.params_to_dict(OP.params_from_dict(r["params"])) for r in recording_doc["variants"]]
    axes = tuple((axis, tuple(v for v in values if any(h[axis] == v for h in held))) for axis, values in QUICK.axes)
    return Space(op=OP.name, preset="quick-as-recorded", axes=axes)


def corner(space: Space, name: str, **axes) -> Space:
    """A corner of space: the axes given narrowed to those values, every other axis to its first value."""
    narrowed = []
    for axis, values in space.axes:
        keep = axes.pop(axis, values[:1])
        assert set(keep) <= set(values), f"{axis}={keep} leaves {space.preset}"
        narrowed.append((axis, tuple(keep)))
    assert not axes, f"unknown axes {axes}"
    return Space(op=OP.name, preset=name, axes=tuple(narrowed))


@pytest.fixture(scope="session")
def small(recorded) -> Space:
    """Small enough to search exhaustively, with combinations the op rejects (multirow with one row, ...)."""
    return corner(recorded, "small", template=("row", "multirow", "wide"), threads=(64, 128, 192),
                  vector=(8, 16), rows_per_block=(1, 2))


@pytest.fixture(scope="session")
def wide(recorded) -> Space:
    """Six wide variants: the v2 and v4 ones differ in registers, and within each the thread count differs."""
    return corner(recorded, "wide", template=("wide",), threads=(32, 64, 128), vector=(8, 16))


def write_derived(tmp_path: Path, doc: dict) -> Path:
    path = tmp_path / "derived_recording.json"
    path.write_text(json.dumps(doc))
    return path


def timed(record: dict, median: float, spread: float) -> None:
    """Make a recorded variant pass its gate with these hot timings (cold: twice as slow)."""
    record["gate"] = {"passed": True, "reason": "", "worst_error": 1e-7, "errors": {}}
    for method, scale in (("hot", 1.0), ("cold", 2.0)):
        record[method] = Timing(method=method, samples=20, median_us=median * scale, spread_us=spread * scale,
                                min_us=(median - spread) * scale).to_dict()


def kernels(params_list) -> list[str]:
    return [OP.kernel_name(SHAPE, p) for p in params_list]


class Recorder(ReplayBackend):
    """ReplayBackend that also notes which variants the tuner sent to the final round."""

    def __init__(self, path: Path):
        super().__init__(path)
        self.finalists: list[str] = []

    def final(self, variants, progress=None):
        self.finalists = [v.source.kernel_name for v in variants]
        return super().final(variants, progress)


def run_tune(backend, space: Space, storage_dir: Path, **options):
    return tune(OP, SHAPE, RUN, space, backend, storage=sqlite(storage_dir), **options)


def test_recording_is_of_an_h200_and_answers_every_test_space(recording_doc, recorded, small, wide):
    doc = recording_doc
    assert doc["gpu"]["name"] == H200 and doc["gpu"]["cc"] == "9.0"
    held = by_kernel(doc)
    for space in (recorded, small, wide):
        valid, _ = expand(OP, SHAPE, space)
        assert valid and set(kernels(valid)) <= set(held), space.preset
    assert len(expand(OP, SHAPE, recorded)[0]) > EXHAUSTIVE_LIMIT  # TPE has something to search
    for k, r in held.items():
        assert bool(r["hot"]) == bool(r["cold"]) == r["gate"]["passed"], k  # a failed variant is never timed
    assert any(r["gate"]["passed"] for r in held.values())


def test_a_config_the_recording_lacks_is_a_failed_trial_not_a_guess(recording_path, recorded, tmp_path):
    # one_pass statistics were added to the space after the recording was made: ReplayBackend has no figure
    space = corner(QUICK, "with-unrecorded", threads=(64, 128), vector=(8,), stats=("two_pass", "one_pass"))
    valid, _ = expand(OP, SHAPE, space)
    unrecorded = [k for k in kernels(valid) if k.endswith("_onepass")]
    assert unrecorded and len(valid) <= EXHAUSTIVE_LIMIT
    result = run_tune(Recorder(recording_path), space, tmp_path, study_name="gaps")
    for kernel in unrecorded:
        assert result.failed[kernel].startswith("gate: replay: the recording has no measurement")
    assert not result.winner.name.endswith("_onepass")


# ---- the sampler ----

@pytest.fixture(scope="module")
def small_run(recording_path, small, tmp_path_factory):
    """One exhaustive search of small, shared by the tests that only read its result."""
    folder = tmp_path_factory.mktemp("small")
    backend = Recorder(recording_path)
    return backend, run_tune(backend, small, folder, study_name="small"), folder


@pytest.fixture(scope="module")
def tpe_run(recording_path, recorded, tmp_path_factory):
    """One TPE search of the recorded quick preset with a budget of 10, shared likewise."""
    folder = tmp_path_factory.mktemp("tpe")
    backend = Recorder(recording_path)
    return backend, run_tune(backend, recorded, folder, study_name="tpe", trials=10), folder


def test_small_space_is_exhaustive_each_valid_config_measured_once(small_run, small):
    backend, result, _ = small_run
    valid, rejected = expand(OP, SHAPE, small)
    assert 0 < len(valid) <= EXHAUSTIVE_LIMIT and rejected
    assert result.sampler == "exhaustive"
    assert collections.Counter(backend.evaluated) == collections.Counter(kernels(valid))
    assert (result.valid, result.rejected, result.measured, result.reused) == (len(valid), len(rejected),
                                                                               len(valid), 0)


def test_tpe_measures_at_most_the_budget_never_a_kernel_twice(tpe_run, recorded):
    backend, result, _ = tpe_run
    valid, _ = expand(OP, SHAPE, recorded)
    assert len(valid) > EXHAUSTIVE_LIMIT and result.sampler == "tpe" and result.valid == len(valid)
    assert len(backend.evaluated) <= 10
    assert len(set(backend.evaluated)) == len(backend.evaluated), collections.Counter(backend.evaluated)
    assert result.measured == len(backend.evaluated) == 10  # plenty was left to find: the budget is spent


def test_a_search_keys_its_valid_configs_once_not_at_every_proposal(recording_path, recorded, tmp_path,
                                                                    monkeypatch):
    # a full preset holds 10⁴ and more valid configs: keying them all again at each of a search's proposals cost
    # seconds a trial (the study ran past its two minutes before measuring a tenth of its budget)
    from mage_gen import tune as tune_module

    calls = collections.Counter()
    keyed = tune_module.params_key

    def counting(op, params):
        calls["params_key"] += 1
        return keyed(op, params)

    monkeypatch.setattr(tune_module, "params_key", counting)
    valid, _ = expand(OP, SHAPE, recorded)
    result = run_tune(Recorder(recording_path), recorded, tmp_path, study_name="keyed", trials=10)
    assert result.measured == 10
    # the search's keys and the worker loop's, once each, and a key for each proposal: not one set per proposal
    assert calls["params_key"] < 3 * len(valid), (calls, len(valid))


def test_infeasible_configs_never_reach_the_backend(tpe_run, recorded):
    backend, result, folder = tpe_run
    valid, _ = expand(OP, SHAPE, recorded)
    assert set(backend.evaluated) <= set(kernels(valid))
    # TPE did propose infeasible configs (most combinations of the quick axes are): each was rejected
    # with the op's rule and told to Optuna as pruned, without reaching the backend.
    study = optuna.load_study(study_name="tpe", storage=sqlite(folder))
    pruned = study.get_trials(states=(optuna.trial.TrialState.PRUNED,))
    assert pruned, "TPE proposed no infeasible config: this test checks nothing"
    settled = {axis: values[0] for axis, values in recorded.axes if len(values) == 1}
    for t in pruned:
        params = OP.params_from_dict({**settled, **t.params})
        with pytest.raises(ConfigError) as rule:
            OP.validate(SHAPE, params)
        assert t.user_attrs["rejected"] == str(rule.value)
        assert OP.kernel_name(SHAPE, params) not in backend.evaluated


def test_an_axis_of_one_value_is_not_asked_of_the_study(tpe_run, recorded):
    # each asked axis is a storage write and a sampler model per proposal, rejected or repeated ones too: asked,
    # the settled axes were half the writes of a quick-preset study
    _, result, folder = tpe_run
    settled = {axis: values[0] for axis, values in recorded.axes if len(values) == 1}
    chosen = {axis for axis, values in recorded.axes if len(values) > 1}
    assert settled and chosen, "the recorded space has no settled axis: this test checks nothing"
    study = optuna.load_study(study_name="tpe", storage=sqlite(folder))
    trials = study.get_trials(deepcopy=False)
    assert trials and all(set(t.params) == chosen for t in trials)
    measured = [t for t in trials if "params_key" in t.user_attrs]
    assert len(measured) == result.measured
    for t in measured:  # the key, what dedupe and the store read, holds every axis at its settled value
        assert json.loads(t.user_attrs["params_key"]).items() >= settled.items()
        assert {k: v for k, v in json.loads(t.user_attrs["params_key"]).items() if k in t.params} == t.params


def test_tpe_with_a_budget_of_the_whole_space_measures_all_of_it(recording_path, recorded, tmp_path):
    # Late in a search TPE mostly proposes measured configs; the tuner then enqueues unmeasured ones. A space
    # just past the exhaustive limit: TPE's cost grows with the square of the trials.
    space = Space(op=OP.name, preset="no-wide", axes=tuple(
        (axis, tuple(v for v in values if v != "wide")) for axis, values in recorded.axes))
    valid, _ = expand(OP, SHAPE, space)
    assert EXHAUSTIVE_LIMIT < len(valid) < len(expand(OP, SHAPE, recorded)[0])
    backend = Recorder(recording_path)
    result = run_tune(backend, space, tmp_path, study_name="all", trials=len(valid))
    assert result.sampler == "tpe" and result.measured == len(valid)
    assert collections.Counter(backend.evaluated) == collections.Counter(kernels(valid))


# ---- dedupe and resume ----

def test_rerun_with_the_budget_met_measures_nothing(recording_path, recorded, tmp_path):
    first = Recorder(recording_path)
    before = run_tune(first, recorded, tmp_path, study_name="resume", trials=6)
    again = Recorder(recording_path)
    after = run_tune(again, recorded, tmp_path, study_name="resume", trials=6)
    assert len(first.evaluated) == 6
    assert again.evaluated == [] and after.measured == 0
    # the answer comes from the stored trials: same winner, same finalists
    assert after.winner.name == before.winner.name
    assert again.finalists == first.finalists


def test_rerun_with_a_bigger_budget_measures_only_new_configs(recording_path, recording, recorded, tmp_path):
    first = Recorder(recording_path)
    run_tune(first, recorded, tmp_path, study_name="resume", trials=6)
    second = Recorder(recording_path)
    result = run_tune(second, recorded, tmp_path, study_name="resume", trials=14)
    assert len(first.evaluated) == 6 and len(second.evaluated) == 8 == result.measured
    assert not set(first.evaluated) & set(second.evaluated)
    assert len(set(second.evaluated)) == len(second.evaluated)
    # The finalists are the fastest of both runs together: the first run's results are used, not lost.
    measured = [k for k in first.evaluated + second.evaluated if hot_median(recording, k) is not None]
    finalists = set(second.finalists)
    assert len(finalists) == min(FINALISTS, len(measured))
    slowest_finalist = max(hot_median(recording, k) for k in finalists)
    assert all(hot_median(recording, k) >= slowest_finalist for k in measured if k not in finalists)


def test_exhaustive_rerun_measures_the_rest(recording_path, small, tmp_path):
    valid, _ = expand(OP, SHAPE, small)
    first = Recorder(recording_path)
    run_tune(first, small, tmp_path, study_name="resume", trials=4)
    second = Recorder(recording_path)
    result = run_tune(second, small, tmp_path, study_name="resume")
    assert len(first.evaluated) == 4
    assert collections.Counter(first.evaluated + second.evaluated) == collections.Counter(kernels(valid))
    assert result.measured == len(valid) - 4


@pytest.mark.parametrize("claimed", [False, True])
def test_a_trial_a_killed_run_left_running_does_not_hold_the_rerun(recording_path, recorded, tmp_path, claimed):
    # A run killed between asking for a proposal and claiming its config (or after claiming it) leaves a trial
    # running. SQLite keeps no heartbeats, so nothing ever fails it: unclaimed, it counted against the budget of
    # every later proposal, each of which then gave way to it until the study gave up; claimed, its config was
    # never measured.
    first = Recorder(recording_path)
    run_tune(first, recorded, tmp_path, study_name="killed", trials=6)
    study = optuna.load_study(study_name="killed", storage=sqlite(tmp_path))
    left = study.ask()
    unmeasured = [p for p in expand(OP, SHAPE, recorded)[0] if OP.kernel_name(SHAPE, p) not in first.evaluated]
    if claimed:
        left.set_user_attr("claim", params_key(OP, unmeasured[0]))
    second = Recorder(recording_path)
    result = run_tune(second, recorded, tmp_path, study_name="killed", trials=7)
    assert result.measured == 1 == len(second.evaluated)
    assert study.trials[left.number].state == optuna.trial.TrialState.FAIL


# ---- a retune starts from the stored winner ----

def unreached_by_a_plain_search(recording_path, recording, recorded, tmp_path) -> list:
    """The recorded configs a 6-trial search of `recorded` leaves unmeasured: only what is enqueued brings them in."""
    plain = Recorder(recording_path)
    (tmp_path / "plain").mkdir()
    run_tune(plain, recorded, tmp_path / "plain", study_name="plain", trials=6)
    return [p for p in expand(OP, SHAPE, recorded)[0] if OP.kernel_name(SHAPE, p) not in plain.evaluated
            and hot_median(recording, OP.kernel_name(SHAPE, p)) is not None]


def test_the_stored_winner_is_measured_first_where_the_search_would_not_reach_it(recording_path, recording,
                                                                                 recorded, tmp_path):
    unreached = unreached_by_a_plain_search(recording_path, recording, recorded, tmp_path)
    stored = min(unreached, key=lambda p: hot_median(recording, OP.kernel_name(SHAPE, p)))
    backend = Recorder(recording_path)
    (tmp_path / "seeded").mkdir()
    run_tune(backend, recorded, tmp_path / "seeded", study_name="seeded", trials=6, incumbent=stored)
    name = OP.kernel_name(SHAPE, stored)
    assert backend.evaluated[0] == name
    assert len(backend.evaluated) == len(set(backend.evaluated)) == 6  # within the budget, never twice
    assert name in backend.finalists


def test_the_winners_of_nearby_shapes_are_measured_after_the_stored_winner_where_the_space_holds_them(
        recording_path, recording, recorded, tmp_path):
    stored, *seeds = unreached_by_a_plain_search(recording_path, recording, recorded, tmp_path)[:3]
    valid, _ = expand(OP, SHAPE, recorded)
    outside = next(p for p in expand(OP, SHAPE, QUICK)[0] if p not in valid)
    backend = Recorder(recording_path)
    (tmp_path / "seeds").mkdir()
    run_tune(backend, recorded, tmp_path / "seeds", study_name="seeds", trials=6, incumbent=stored,
             seeds=[outside, *seeds, stored])
    assert backend.evaluated[:3] == kernels([stored, *seeds])
    assert OP.kernel_name(SHAPE, outside) not in backend.evaluated
    assert len(backend.evaluated) == len(set(backend.evaluated)) == 6


def test_a_search_compiles_the_configs_it_measures_first_up_front(recording_path, recording, recorded, tmp_path,
                                                                   monkeypatch):
    # TPE over more configs than it will try: what it compiles ahead is the stored winner and the seeds in the space
    stored, *seeds = unreached_by_a_plain_search(recording_path, recording, recorded, tmp_path)[:3]
    outside = next(p for p in expand(OP, SHAPE, QUICK)[0] if p not in expand(OP, SHAPE, recorded)[0])
    compiled = []
    monkeypatch.setattr("mage_gen.tune.prebuild", lambda op, shape, params, arch, progress=None: compiled.extend(params))
    (tmp_path / "ahead").mkdir()
    run_tune(Recorder(recording_path), recorded, tmp_path / "ahead", study_name="ahead", trials=6, incumbent=stored,
             seeds=[outside, *seeds])
    assert kernels(compiled) == kernels([stored, *seeds])


def test_a_sqlite_study_is_journaled_ahead_once_it_is_known_to_be_ours(recording_path, small, tmp_path):
    run_tune(Recorder(recording_path), small, tmp_path, study_name="wal", trials=2)
    with sqlite3.connect(tmp_path / "studies.db") as db:
        assert db.execute("PRAGMA journal_mode").fetchone() == ("wal",)


def test_a_stored_winner_from_before_an_axis_is_measured_first_at_each_of_its_values(recording_path, recorded,
                                                                                   tmp_path):
    valid, _ = expand(OP, SHAPE, recorded)
    hints = dict(recorded.axes)["hint"]
    assert len(hints) > 1
    stored = next(p for p in valid if all(dataclasses.replace(p, hint=h) in valid for h in hints))
    backend = Recorder(recording_path)
    run_tune(backend, recorded, tmp_path, study_name="new-axis", trials=6, incumbent=stored, unrecorded=["hint"])
    beside = [stored] + [dataclasses.replace(stored, hint=h) for h in hints if h != stored.hint]
    assert backend.evaluated[:len(beside)] == kernels(beside)
    assert len(backend.evaluated) == len(set(backend.evaluated)) == 6


def test_a_stored_winner_measured_already_or_outside_the_space_is_not_measured_for_it(recording_path, recorded,
                                                                                      small, tmp_path):
    first = Recorder(recording_path)
    run_tune(first, recorded, tmp_path, study_name="resume", trials=4)
    measured = next(p for p in expand(OP, SHAPE, recorded)[0] if OP.kernel_name(SHAPE, p) == first.evaluated[-1])
    again = Recorder(recording_path)
    run_tune(again, recorded, tmp_path, study_name="resume", trials=6, incumbent=measured)
    assert len(again.evaluated) == 2 and not set(again.evaluated) & set(first.evaluated)
    # small is searched exhaustively, in order: a config outside it does not jump the queue or join it
    valid, _ = expand(OP, SHAPE, small)
    outside = next(p for p in expand(OP, SHAPE, recorded)[0] if p not in valid)
    exhaustive = Recorder(recording_path)
    run_tune(exhaustive, small, tmp_path, study_name="small", trials=3, incumbent=outside)
    assert exhaustive.evaluated == kernels(valid)[:3]
    assert OP.kernel_name(SHAPE, outside) in exhaustive.finalists  # but it is re-timed beside the finalists


def test_a_stored_winner_outside_the_preset_stays_the_winner_where_the_final_round_finds_it_faster(
        recording, recorded, small, tmp_path):
    valid, _ = expand(OP, SHAPE, small)
    inside = [hot_median(recording, k) for k in kernels(valid) if hot_median(recording, k) is not None]
    outside = next(p for p in expand(OP, SHAPE, recorded)[0] if p not in valid)
    for median, wins in ((0.9 * min(inside), True), (1.5 * max(inside), False)):
        timed(by_kernel(recording)[OP.kernel_name(SHAPE, outside)], median, 0.01)
        path = write_derived(tmp_path, recording)
        result = run_tune(Recorder(path), small, tmp_path, study_name=f"small-{wins}", incumbent=outside)
        assert (result.winner.params == outside) is wins
        assert result.winner.params in ([outside] if wins else valid)


def test_a_stored_winner_tied_with_others_in_the_final_round_stays_the_winner(recording, small, tmp_path):
    # A retune replaces the stored winner only by beating it: within a tie, the frugal rule would otherwise swap
    # a size class's kernel for another on the draw of the spread.
    valid, _ = expand(OP, SHAPE, small)
    held = by_kernel(recording)
    fastest, second = sorted((p for p in valid if hot_median(recording, OP.kernel_name(SHAPE, p)) is not None),
                             key=lambda p: hot_median(recording, OP.kernel_name(SHAPE, p)))[:2]
    for method in ("hot", "cold"):
        held[OP.kernel_name(SHAPE, second)][method] = dict(held[OP.kernel_name(SHAPE, fastest)][method])
    path = write_derived(tmp_path, recording)
    frugal = run_tune(Recorder(path), small, tmp_path, study_name="no-stored").winner.params
    stored = second if frugal == fastest else fastest
    result = run_tune(Recorder(path), small, tmp_path, study_name="stored", incumbent=stored)
    assert result.tie and result.kept_stored and result.winner.params == stored != frugal


def test_a_space_s_first_configs_are_measured_after_the_stored_winner_where_the_space_holds_them(
        recording_path, recording, recorded, tmp_path):
    stored, *peer_shaped = unreached_by_a_plain_search(recording_path, recording, recorded, tmp_path)[:3]
    valid, _ = expand(OP, SHAPE, recorded)
    outside = next(p for p in expand(OP, SHAPE, QUICK)[0] if p not in valid)
    # as [first] names them: only the fields that differ from the defaults
    defaults = OP.params_to_dict(OP.params_from_dict({}))
    first = tuple(tuple((k, v) for k, v in OP.params_to_dict(p).items() if v != defaults[k])
                  for p in (*peer_shaped, outside))
    backend = Recorder(recording_path)
    (tmp_path / "first").mkdir()
    run_tune(backend, dataclasses.replace(recorded, first=first), tmp_path / "first", study_name="first", trials=6,
             incumbent=stored)
    assert backend.evaluated[:3] == kernels([stored, *peer_shaped])
    assert OP.kernel_name(SHAPE, outside) not in backend.evaluated
    assert len(backend.evaluated) == len(set(backend.evaluated)) == 6


def test_a_space_s_first_configs_join_the_final_round_wherever_the_study_ranked_them(recording_path, recording,
                                                                                     recorded, tmp_path):
    valid, _ = expand(OP, SHAPE, recorded)
    timed_valid = [p for p in valid if hot_median(recording, OP.kernel_name(SHAPE, p)) is not None]
    slowest = max(timed_valid, key=lambda p: hot_median(recording, OP.kernel_name(SHAPE, p)))
    defaults = OP.params_to_dict(OP.params_from_dict({}))
    first = (tuple((k, v) for k, v in OP.params_to_dict(slowest).items() if v != defaults[k]),)
    backend = Recorder(recording_path)
    result = run_tune(backend, dataclasses.replace(recorded, first=first), tmp_path, study_name="first-final",
                      trials=FINALISTS + 3)
    measured = [k for k in backend.evaluated if hot_median(recording, k) is not None]
    fastest = sorted(measured, key=lambda k: hot_median(recording, k))[:FINALISTS]
    name = OP.kernel_name(SHAPE, slowest)
    assert name in measured and name not in fastest  # the study ranked it last ...
    assert sorted(backend.finalists) == sorted([*fastest, name])  # ... and the final round still re-timed it
    assert result.winner.name != name


def test_an_exhaustive_search_measures_the_stored_winner_first_then_the_rest_once_each(recording_path, small,
                                                                                      tmp_path):
    valid, _ = expand(OP, SHAPE, small)
    stored = valid[len(valid) // 2]
    backend = Recorder(recording_path)
    run_tune(backend, small, tmp_path, study_name="small", incumbent=stored)
    assert backend.evaluated == [OP.kernel_name(SHAPE, stored)] + [k for k in kernels(valid)
                                                                  if k != OP.kernel_name(SHAPE, stored)]
    study = optuna.load_study(study_name="small", storage=sqlite(tmp_path))
    # every config asked once: no trial told as a repeat, none left enqueued
    assert not [t.number for t in study.trials if "repeat_of" in t.user_attrs]
    assert not study.get_trials(states=(optuna.trial.TrialState.WAITING,))


# ---- failures ----

def test_failed_gate_is_a_failed_trial_with_its_reason_never_a_finalist(recording, small, tmp_path):
    # Derived from the recording: the fastest variant of small is made to fail its gate.
    valid, _ = expand(OP, SHAPE, small)
    held = by_kernel(recording)
    passing = [k for k in kernels(valid) if held[k]["hot"]]
    broken = min(passing, key=lambda k: held[k]["hot"]["median_us"])
    reason = "{'m': 37}: y has 768 NaN (first at (36, 0)): unwritten or computed NaN"
    held[broken].update(gate={"passed": False, "reason": reason, "worst_error": float("inf"), "errors": {}},
                        hot=None, cold=None)
    path = write_derived(tmp_path, recording)

    backend = Recorder(path)
    result = run_tune(backend, small, tmp_path, study_name="failed")
    expected = {k: "gate: " + held[k]["gate"]["reason"] for k in kernels(valid) if not held[k]["gate"]["passed"]}
    assert result.failed == expected and result.failed[broken] == "gate: " + reason
    assert broken in backend.evaluated  # it was measured ...
    assert broken not in backend.finalists  # ... but never re-timed or ranked
    assert result.winner.name != broken and broken not in [f.name for f in result.runner_ups]
    study = optuna.load_study(study_name="failed", storage=sqlite(tmp_path))
    [trial] = [t for t in study.trials if t.user_attrs.get("kernel") == broken]
    assert trial.state == optuna.trial.TrialState.FAIL and trial.user_attrs["reason"] == "gate: " + reason
    # reopened, the study still knows why
    assert run_tune(Recorder(path), small, tmp_path, study_name="failed").failed == expected


def test_failed_compile_is_a_failed_trial_that_never_reaches_the_backend(recording_path, small, tmp_path, monkeypatch):
    valid, _ = expand(OP, SHAPE, small)
    doomed = kernels(valid)[1]
    real_compile = variants_module.compile_source

    def compile_source(source, arch, *args, **kwargs):
        if source.kernel_name == doomed:
            raise CompileError("nvrtc: error: something the template got wrong\nline 12: more of the log")
        return real_compile(source, arch, *args, **kwargs)

    # At the compiler, so that the parallel prebuild (forked workers) meets the failure as the trial does.
    monkeypatch.setattr(variants_module, "compile_source", compile_source)
    backend = Recorder(recording_path)
    result = run_tune(backend, small, tmp_path, study_name="compile")
    assert result.failed[doomed] == "compile: nvrtc: error: something the template got wrong"
    assert doomed not in backend.evaluated and doomed not in backend.finalists
    assert result.measured == len(valid)  # a failed compile is a measured (failed) trial


def test_every_variant_failing_is_an_error(recording, wide, tmp_path):
    # Derived from the recording: every variant of wide fails its gate.
    valid, _ = expand(OP, SHAPE, wide)
    for k in kernels(valid):
        by_kernel(recording)[k].update(gate={"passed": False, "reason": "y has NaN", "worst_error": 1.0,
                                             "errors": {}}, hot=None, cold=None)
    with pytest.raises(MageError, match="^tune: every measured variant failed; first failure: gate: y has NaN"):
        run_tune(Recorder(write_derived(tmp_path, recording)), wide, tmp_path)


# ---- the tie rule ----

@pytest.fixture(scope="module")
def wide_census(wide) -> dict[str, tuple[int, int]]:
    """kernel -> (registers, threads per block) of every wide variant, as compiled here."""
    valid, _ = expand(OP, SHAPE, wide)
    return {v.source.kernel_name: (v.census.registers, OP.geometry(SHAPE, v.params, {"m": 1}).threads)
            for v in build_all(OP, SHAPE, valid, "sm_90")}


def pick_pair(census: dict[str, tuple[int, int]], by: str) -> tuple[str, str]:
    """(a, b): b wins a tie against a by fewer registers (though it has more threads: registers come
    first), or by fewer threads with equal registers."""
    names = sorted(census)
    for a in names:
        for b in names:
            (ra, ta), (rb, tb) = census[a], census[b]
            if (by == "registers" and rb < ra and tb > ta) or (by == "threads" and rb == ra and tb < ta):
                return a, b
    raise AssertionError(f"no two wide variants differ by {by} alone: {census}")


@pytest.mark.parametrize("by, spreads, tie", [
    ("registers", (0.10, 0.10), True),
    ("registers", (0.01, 0.10), True),  # the larger spread decides
    ("threads", (0.10, 0.10), True),
    ("registers", (0.01, 0.01), False),
    ("threads", (0.01, 0.01), False),
])
def test_tie_goes_to_fewer_registers_then_fewer_threads(recording, wide, tmp_path, wide_census, by, spreads, tie):
    # Derived from the recording: the fastest two wide variants are 0.08 us apart, the others far behind.
    fast, frugal = pick_pair(wide_census, by)
    held = by_kernel(recording)
    for i, k in enumerate(sorted(wide_census)):
        timed(held[k], 20.0 + i, 0.01)
    timed(held[fast], 5.00, spreads[0])
    timed(held[frugal], 5.08, spreads[1])
    backend = Recorder(write_derived(tmp_path, recording))
    result = run_tune(backend, wide, tmp_path)
    assert set(backend.finalists) >= {fast, frugal}
    assert result.tie is tie
    if tie:
        assert result.winner.name == frugal and result.tied_with == [fast]
        assert result.runner_ups[0].name == fast
        assert (result.winner.registers, result.winner.threads) == wide_census[frugal]
    else:
        assert result.winner.name == fast and result.tied_with == []
        assert result.runner_ups[0].name == frugal


def with_rounds(record: dict, ratios: list[float]) -> None:
    """Give a recorded variant final-round samples: in round r, its medians times ratios[r], hot and cold."""
    record["rounds"] = {method: [[record[method]["median_us"] * ratio] * 4 for ratio in ratios]
                        for method in ("hot", "cold")}


@pytest.mark.parametrize("frugal_ratios, tie", [
    ([1.05, 1.04, 1.06, 1.05, 1.05, 1.03, 1.06, 1.04], False),  # slower in every round: told apart
    ([1.05, 0.99, 1.06, 1.01, 1.05, 0.98, 1.06, 1.04], True),  # faster in two rounds: not told slower
])
def test_the_final_round_tells_finalists_apart_by_paired_rounds_where_it_has_them(
        recording, wide, tmp_path, wide_census, frugal_ratios, tie):
    # fast and frugal are 1% apart in their pooled medians, well within the pooled spreads: by spreads a tie,
    # which goes to frugal. The rounds decide instead, as the benches compare two kernels.
    fast, frugal = pick_pair(wide_census, "registers")
    held = by_kernel(recording)
    for i, k in enumerate(sorted(wide_census)):
        timed(held[k], 20.0 + i, 0.01)
        with_rounds(held[k], [1.0] * 8)
    timed(held[fast], 5.00, 0.25)
    timed(held[frugal], 5.05, 0.25)
    with_rounds(held[fast], [1.0] * 8)
    held[frugal]["rounds"] = {m: [[held[fast][m]["median_us"] * ratio] * 4 for ratio in frugal_ratios]
                              for m in ("hot", "cold")}
    path = write_derived(tmp_path, recording)
    result = run_tune(Recorder(path), wide, tmp_path)
    assert result.tie_test == "paired rounds"
    assert result.tie is tie and result.winner.name == (frugal if tie else fast)
    entry = result.entry(OP, SHAPE, RUN, recording["gpu"], "hot")
    over = {r["kernel"]: r["over_winner"] for r in entry["runner_ups"]}
    loser = fast if tie else frugal
    expected = sorted(1 / r for r in frugal_ratios) if tie else sorted(frugal_ratios)
    assert over[loser]["hot"]["low"] == pytest.approx(expected[0])
    assert over[loser]["hot"]["verdict"] == ("tie" if tie else "slower")
    # the winner against each peer timed in the same rounds, by those rounds: the peer 5.5 µs hot in every round
    for name, peer in recording["peers"].items():
        peer["rounds"] = {m: [[5.5 * (1 if m == "hot" else 2)] * 4] * 8 for m in ("hot", "cold")}
    result = run_tune(Recorder(write_derived(tmp_path, recording)), wide, tmp_path, study_name="peers")
    entry = result.entry(OP, SHAPE, RUN, recording["gpu"], "hot")
    for name in recording["peers"]:
        over = entry["peers"][name]["winner_over_peer"]["hot"]
        expected = float(np.median([np.median(r) / 5.5 for r in result.winner.rounds["hot"]]))
        assert over["median"] == pytest.approx(expected) and over["verdict"] == "faster"
    for record in [*by_kernel(recording).values(), *recording["peers"].values()]:  # without rounds: spreads
        record.pop("rounds", None)
        record.pop("rounds", None)
    by_spreads = run_tune(Recorder(write_derived(tmp_path, recording)), wide, tmp_path, study_name="spreads")
    assert by_spreads.tie_test == "spreads" and by_spreads.tie and by_spreads.winner.name == frugal


@pytest.mark.parametrize("objective", ["hot", "cold"])
def test_a_tie_on_the_objective_goes_to_the_faster_on_the_other_method_before_fewer_registers(
        recording, wide, tmp_path, wide_census, objective):
    # fast and frugal tie on the objective; fast (more registers) is clearly faster on the other method
    fast, frugal = pick_pair(wide_census, "registers")
    other = "cold" if objective == "hot" else "hot"
    held = by_kernel(recording)
    for i, k in enumerate(sorted(wide_census)):
        timed(held[k], 20.0 + i, 0.01)
    timed(held[fast], 5.00, 0.10)
    timed(held[frugal], 5.04, 0.10)
    for name, other_median in ((fast, 4.0), (frugal, 4.6)):
        held[name][other] = Timing(method=other, samples=20, median_us=other_median, spread_us=0.05,
                                   min_us=other_median - 0.05).to_dict()
    result = run_tune(Recorder(write_derived(tmp_path, recording)), wide, tmp_path, objective=objective)
    assert result.tie and result.winner.name == fast and result.tied_with == [frugal]


def test_cold_objective_searches_and_ranks_by_cold(recording, wide, tmp_path, wide_census):
    # Derived from the recording: a is fastest hot; b is slowest hot (not among the 5 hot finalists of the
    # 6) but fastest cold; nothing ties.
    a, b, *others = sorted(wide_census)
    assert len(others) >= FINALISTS - 1
    held = by_kernel(recording)
    for i, k in enumerate(others):
        timed(held[k], 20.0 + i, 0.01)
    timed(held[a], 5.0, 0.01)  # cold 10.0
    timed(held[b], 30.0, 0.01)
    held[b]["cold"]["median_us"] = 8.0
    path = write_derived(tmp_path, recording)
    assert run_tune(Recorder(path), wide, tmp_path, objective="hot").winner.name == a
    cold = run_tune(Recorder(path), wide, tmp_path, objective="cold")
    assert cold.winner.name == b and cold.winner.cold.median_us == 8.0 and not cold.tie


def test_both_objective_ranks_by_hot_and_cold_together(recording, wide, tmp_path, wide_census):
    # a is fastest hot, c fastest cold, b second on each and first on their geometric mean; nothing ties
    a, b, c, *others = sorted(wide_census)
    held = by_kernel(recording)
    for i, k in enumerate(others):
        timed(held[k], 20.0 + i, 0.01)
    for name, hot, cold in ((a, 5.0, 14.0), (b, 7.0, 9.0), (c, 10.0, 8.0)):
        timed(held[name], hot, 0.01)
        held[name]["cold"]["median_us"] = cold
    path = write_derived(tmp_path, recording)
    assert run_tune(Recorder(path), wide, tmp_path, objective="hot").winner.name == a
    assert run_tune(Recorder(path), wide, tmp_path, objective="cold").winner.name == c
    result = run_tune(Recorder(path), wide, tmp_path, objective="both")
    assert result.winner.name == b and not result.tie
    assert result.winner.timing("both").median_us == pytest.approx((7.0 * 9.0) ** 0.5)


@pytest.mark.parametrize("frugal_hot", [5.02, 5.40])
def test_under_both_a_tie_is_one_on_each_method(recording, wide, tmp_path, wide_census, frugal_hot):
    # fast leads on the geometric mean; frugal (fewer registers) is close cold, and hot either within the spread
    # (a tie: the frugal one is kept) or 8% behind, which the wide cold spread must not hide
    fast, frugal = pick_pair(wide_census, "registers")
    held = by_kernel(recording)
    for i, k in enumerate(sorted(wide_census)):
        timed(held[k], 20.0 + i, 0.01)
    timed(held[fast], 5.00, 0.05)
    timed(held[frugal], frugal_hot, 0.05)
    for name, cold in ((fast, 10.4), (frugal, 10.0)):
        held[name]["cold"] = Timing(method="cold", samples=20, median_us=cold, spread_us=0.6, min_us=cold - 0.5).to_dict()
    result = run_tune(Recorder(write_derived(tmp_path, recording)), wide, tmp_path, objective="both")
    if frugal_hot < 5.05:
        assert result.tie and result.winner.name == frugal and result.tied_with == [fast]
    else:
        assert not result.tie and result.winner.name == fast
        assert result.winner.timing("both").ties_with(result.runner_ups[0].timing("both"))  # the mean alone would


def test_both_timing_is_the_geometric_mean_and_ties_only_within_both_spreads():
    hot = Timing(method="hot", samples=20, median_us=4.0, spread_us=0.04, min_us=3.9)
    cold = Timing(method="cold", samples=16, median_us=9.0, spread_us=0.27, min_us=8.1)
    b = by_objective(hot, cold, "both")
    assert (b.method, b.samples, b.median_us) == ("both", 16, pytest.approx(6.0))
    assert b.spread_us == pytest.approx(6.0 * (0.01 + 0.03) / 2)
    assert b.min_us == pytest.approx((3.9 * 8.1) ** 0.5)
    slower = by_objective(hot, dataclasses.replace(cold, median_us=9.0 * 1.05), "both")  # 2.5% on the mean
    assert not b.ties_with(slower)
    assert b.ties_with(by_objective(hot, dataclasses.replace(cold, median_us=9.2), "both"))  # 1.1%, within 2%
    assert by_objective(hot, cold, "hot") is hot and by_objective(hot, cold, "cold") is cold
    with pytest.raises(ValueError, match="objective"):
        by_objective(hot, cold, "warm")


def test_an_unknown_objective_is_refused_before_any_study(recording_path, wide, tmp_path):
    with pytest.raises(ConfigError, match="objective: must be one of hot, cold, both"):
        run_tune(ReplayBackend(recording_path), wide, tmp_path, objective="warm")
    assert not (tmp_path / "studies.db").exists()


# ---- study and storage ----

class OtherOp(LayerNorm):
    name = "otherop"


@pytest.mark.parametrize("change", ["shape", "run", "objective", "op"])
def test_a_study_name_is_bound_to_its_op_and_shape(recording_path, wide, tmp_path, change):
    assert run_tune(Recorder(recording_path), wide, tmp_path, study_name="mine").study == "mine"
    op, shape, run, objective = OP, SHAPE, RUN, "hot"
    if change == "shape":
        shape = OP.shape(d=1024)
    elif change == "run":
        run = {"m": 2048}
    elif change == "objective":
        objective = "cold"
    else:
        op = OtherOp()
    backend = Recorder(recording_path)
    with pytest.raises(ConfigError) as exc:
        tune(op, shape, run, wide, backend, objective=objective, storage=sqlite(tmp_path), study_name="mine")
    assert str(exc.value).startswith("study:") and "'mine'" in str(exc.value) and "--study" in str(exc.value)
    assert backend.evaluated == []


@pytest.mark.parametrize("url", ["postgresql://nobody@127.0.0.1:1/none", "sqlite:///{tmp}/no/such/folder/s.db"])
def test_unreachable_storage_is_a_one_line_error(recording_path, wide, tmp_path, url):
    url = url.format(tmp=tmp_path)
    backend = Recorder(recording_path)
    with pytest.raises(MageError) as exc:
        tune(OP, SHAPE, RUN, wide, backend, storage=url)
    message = str(exc.value)
    assert message.startswith("storage:") and repr(url) in message and "\n" not in message
    assert backend.evaluated == []


# ---- what the tuner hands on ----

def test_entry_round_trips_through_the_store_and_matches_the_recording(small_run, recording_doc, tmp_path):
    backend, result, _ = small_run
    held = by_kernel(recording_doc)
    entry = result.entry(OP, SHAPE, RUN, backend.device, "hot")
    save_entry(OP.name, backend.device["name"], entry_key(OP, SHAPE, RUN), entry, directory=tmp_path)
    loaded = load_entry(OP.name, H200, "d=768/float32/m=4096", directory=tmp_path)
    assert loaded == json.loads(json.dumps(entry))
    assert load_winner(OP, SHAPE, H200, directory=tmp_path).params == result.winner.params  # not stale
    w = held[loaded["kernel"]]
    assert loaded["kernel"] == result.winner.name
    assert OP.params_from_dict(loaded["params"]) == OP.params_from_dict(w["params"]) == result.winner.params
    assert loaded["timings"] == {"hot": w["hot"], "cold": w["cold"]}
    assert loaded["peers"] == recording_doc.get("peers", {})
    assert loaded["gpu"] == recording_doc["gpu"] and loaded["objective"] == "hot"
    for r in loaded["runner_ups"]:
        assert (r["hot"], r["cold"]) == (held[r["kernel"]]["hot"], held[r["kernel"]]["cold"])
    assert loaded["search"]["sampler"] == "exhaustive" and loaded["search"]["measured"] == result.measured
    # nothing measured beats the winner by more than the spread
    best = min((held[k] for k in backend.evaluated if held[k]["hot"]), key=lambda r: r["hot"]["median_us"])
    assert Timing.from_dict(w["hot"]).ties_with(Timing.from_dict(best["hot"]))
