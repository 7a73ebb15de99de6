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
import copy
import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import numpy as np
import optuna
import pytest

from mage_gen import variants as variants_module
from mage_gen.backends import ReplayBackend
from mage_gen.errors import CompileError, ConfigError, MageError
from mage_gen.ops import get_op
from mage_gen.ops.layernorm import LayerNorm
from mage_gen.space import Space, expand, load_space
from mage_gen.store import entry_key, load_entry, load_winner, save_entry
from mage_gen.timing import Timing, by_objective
from mage_gen.tune import EXHAUSTIVE_LIMIT, FINALISTS, params_key, tune
from mage_gen.variants import build_all

RECORDING = Path(__file__).parent / "fixtures" / "layernorm_trials_h200_d768_m4096.json"
RECORD_COMMAND = ("python -m bench.probes.layernorm_trials --d 768 --m 4096 --preset quick "
                  "--out tests/fixtures/layernorm_trials_h200_d768_m4096.json")
H200 = "NVIDIA H200"
OP = get_op("layernorm")
SHAPE = OP.shape(d=768)
RUN = {"m": 4096}
QUICK = load_space(OP, "quick")


# ---- the recording ----

@pytest.fixture(scope="session")
def recording_path() -> Path:
    if not RECORDING.is_file():
        pytest.fail(f"{RECORDING} is missing: these tests replay timings recorded on an H200. Record it there "
                    f"with `{RECORD_COMMAND}` and commit it.", pytrace=False)
    return RECORDING


@pytest.fixture(scope="session")
def recording_doc(recording_path) -> dict:
    return json.loads(recording_path.read_text())


@pytest.fixture
def recording(recording_doc) -> dict:
    """A private copy of the recording, free to modify into a derived one."""
    return copy.deepcopy(recording_doc)


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


def by_kernel(doc: dict) -> dict[str, dict]:
    return {r["kernel"]: r for r in doc["variants"]}


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


def sqlite(folder: Path) -> str:
    return f"sqlite:///{folder / 'studies.db'}"


def run_tune(backend, space: Space, storage_dir: Path, **options):
    return tune(OP, SHAPE, RUN, space, backend, storage=sqlite(storage_dir), **options)


def hot_median(doc: dict, kernel: str) -> float | None:
    record = by_kernel(doc)[kernel]
    return record["hot"]["median_us"] if record["hot"] else None


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


def test_the_norm_spaces_for_long_rows_start_from_the_triton_peer_s_kernel():
    for name in ("layernorm", "rmsnorm"):
        op = get_op(name)
        shape = op.shape(d=8192, dtype="bf16")
        space = load_space(op, "long", shape)
        valid = set(expand(op, shape, space, "sm_90")[0])
        triton_w8 = op.params_from_dict({"template": "row", "threads": 256, "vector": 16, "hint": "none"})
        assert triton_w8 in valid and triton_w8.l2_ahead == 0 and triton_w8.min_blocks == 1
        assert triton_w8 in {op.params_from_dict(dict(values)) for values in space.first}
        # Triton's 16 warps hold 4 rows per SM; ours of 512 threads does only when fitted to it
        triton_w16 = dataclasses.replace(triton_w8, threads=512, min_blocks=4)
        assert triton_w16 in valid and triton_w16 in {op.params_from_dict(dict(values)) for values in space.first}
        assert space.narrowed(threads=(512,)).first == space.first


def test_a_grid_given_per_sm_is_sized_for_the_gpu_the_space_is_loaded_for():
    for name in ("layernorm", "rmsnorm"):
        op = get_op(name)
        assert dict(load_space(op, "full", sms=100).axes)["grid_cap"] == (0, 400)
        assert dict(load_space(op, "quick", sms=132).axes)["grid_cap"] == (0, 528)
        assert dict(load_space(op, "full").axes)["grid_cap"] == (0,)  # no GPU named: no grid to size
        assert load_space(op, "full").needs_sms and not load_space(op, "full", sms=132).needs_sms
    assert not load_space(get_op("matmul"), "quick").needs_sms  # no value of it is given per SM


def test_a_first_table_naming_an_unknown_axis_is_a_one_line_error(tmp_path, monkeypatch):
    spec = (Path(__file__).parents[1] / "search" / "rmsnorm.toml").read_text()
    (tmp_path / "search").mkdir()
    (tmp_path / "search" / "rmsnorm.toml").write_text(spec.replace('hint = ["none"]\n', 'warps = [8]\n', 1))
    monkeypatch.setattr("mage_gen.space.data_dir", lambda name: tmp_path / name)
    with pytest.raises(ConfigError, match=r"\[first\] of rmsnorm.toml names unknown axes warps"):
        load_space(get_op("rmsnorm"), "long")


def test_a_shape_with_no_preset_named_gets_the_first_whose_sizes_hold_it():
    from mage_gen.space import default_preset

    gemm = get_op("gemm_sm90")
    chosen = {m: load_space(gemm, None, gemm.shape(m=m, n=4096, k=4096)).preset for m in (16, 256, 257, 1024, 1025)}
    assert chosen == {16: "skinny", 256: "skinny", 257: "mid", 1024: "mid", 1025: "quick"}
    assert default_preset(gemm) == "quick" and load_space(gemm).preset == "quick"  # no shape: the spec's default
    assert load_space(gemm, "full", gemm.shape(m=16, n=64, k=64)).preset == "full"  # a preset named is the preset
    layernorm = get_op("layernorm")
    assert load_space(layernorm, None, layernorm.shape(d=768)).preset == "quick"  # no rules: the default


@pytest.mark.parametrize("rule", ['{ preset = "narrow", up_to = { m = 256 } }', '{ preset = "skinny", up_to = { x = 2 } }',
                                  '{ preset = "skinny", up_to = { m = 2.5 } }', '{ preset = "skinny" }'])
def test_a_default_by_size_rule_the_spec_cannot_hold_is_a_one_line_error(tmp_path, monkeypatch, rule):
    spec = (Path(__file__).parents[1] / "search" / "gemm_sm90.toml").read_text()
    (tmp_path / "search").mkdir()
    (tmp_path / "search" / "gemm_sm90.toml").write_text(
        spec.replace('{ preset = "skinny", up_to = { m = 256 } }', rule, 1))
    monkeypatch.setattr("mage_gen.space.data_dir", lambda name: tmp_path / name)
    gemm = get_op("gemm_sm90")
    with pytest.raises(ConfigError, match=r"^space: each default_by_size of gemm_sm90.toml takes a preset of the spec"):
        load_space(gemm, None, gemm.shape(m=4096, n=64, k=64))


def test_a_preset_with_a_base_narrows_the_base_s_axes_then_its_own():
    gemm = get_op("gemm_sm90")
    skinny, chained = (dict(load_space(gemm, preset).axes) for preset in ("skinny", "skinny_chains"))
    assert chained["chains"] == (1, 2) and skinny["chains"] == (1,)
    assert {axis: v for axis, v in chained.items() if axis != "chains"} == \
        {axis: v for axis, v in skinny.items() if axis != "chains"}
    assert "base" not in chained
    # a base's own base first: skinny_tail is skinny_chains with the split summed by ticket as well
    tail = dict(load_space(gemm, "skinny_tail").axes)
    assert tail["split_sum"] == ("global", "ticket") and tail["chains"] == (1, 2)
    assert {axis: v for axis, v in tail.items() if axis != "split_sum"} == \
        {axis: v for axis, v in chained.items() if axis != "split_sum"}


@pytest.mark.parametrize("base, why", [("narrow", "is not a preset"), ("skinny_chains", "leads back to itself")])
def test_a_base_that_is_no_preset_or_leads_back_is_a_one_line_error(tmp_path, monkeypatch, base, why):
    spec = (Path(__file__).parents[1] / "search" / "gemm_sm90.toml").read_text()
    (tmp_path / "search").mkdir()
    (tmp_path / "search" / "gemm_sm90.toml").write_text(spec.replace('base = "skinny"', f'base = "{base}"', 1))
    monkeypatch.setattr("mage_gen.space.data_dir", lambda name: tmp_path / name)
    with pytest.raises(ConfigError, match=rf"^space: the base '{base}' of preset skinny_chains in gemm_sm90.toml {why}"):
        load_space(get_op("gemm_sm90"), "skinny_chains")


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


# ---- the command line ----

def mage_gen(*args: str, env: dict | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mage_gen", *args], capture_output=True, text=True, timeout=300,
                          env=env, cwd=cwd)


def test_cli_tune_from_a_recording_stores_and_emits_the_winner(recording_path, recording_doc, tmp_path):
    env = {**os.environ, "MAGE_GEN_TUNED": str(tmp_path / "tuned")}  # MAGE_GEN_CACHE: the session's
    done = mage_gen("tune", "layernorm", "--d", "768", "--replay", str(recording_path), "--trials", "12",
                    "--storage", sqlite(tmp_path), "--out", str(tmp_path / "k"), "--tuned", str(tmp_path / "tuned"),
                    env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    doc = json.loads((tmp_path / "tuned" / "h200" / "layernorm.json").read_text())
    entry = doc["entries"]["d=768/float32/m=4096"]
    winner = entry["kernel"]
    winner_line = next(line for line in done.stdout.splitlines() if "winner" in line and "layernorm_" in line)
    assert winner in winner_line and "winner by hot" in winner_line  # the objective that ranked it, beside it
    assert "so this measures the L2" in " ".join(done.stdout.split())  # 4096×768 fp32 fits the H200's L2
    emitted = sorted(p.name for p in (tmp_path / "k").iterdir())
    assert emitted == sorted(f"layernorm_d768_m4096{ext}" for ext in (".cu", ".ptx", ".cubin", ".launch.json", ".h"))
    assert json.loads((tmp_path / "k" / "layernorm_d768_m4096.launch.json").read_text())["kernel"] == winner
    # the stored winner is one of the study's measured configs: the best of them, or tied with it
    (name,) = optuna.get_all_study_names(storage=sqlite(tmp_path))
    assert name == f"replay-layernorm-d768-quick-{recording_path.stem}"  # never the study a GPU's tune resumes
    assert entry["replay"] == str(recording_path)
    header = (tmp_path / "k" / "layernorm_d768_m4096.cu").read_text()
    assert "a replay of the recording" in header and "tuned on" not in header
    study = optuna.load_study(study_name=name, storage=sqlite(tmp_path))
    complete = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE and "params_key" in t.user_attrs]
    assert len(complete) + sum(t.state == optuna.trial.TrialState.FAIL and "params_key" in t.user_attrs
                               for t in study.trials) == 12
    assert winner in {t.user_attrs["kernel"] for t in complete}
    best = min(complete, key=lambda t: t.value)
    assert Timing.from_dict(entry["timings"]["hot"]).ties_with(Timing.from_dict(best.user_attrs["hot"]))
    assert entry["timings"]["hot"] == by_kernel(recording_doc)[winner]["hot"]

    again = mage_gen("emit", "layernorm", "--d", "768", "--gpu", H200, "-o", str(tmp_path / "e"), env=env,
                     cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    launch = json.loads((tmp_path / "e" / "layernorm_d768_m4096.launch.json").read_text())
    assert launch["kernel"] == winner and launch["provenance"]["kernel"] == winner
    cubin = "layernorm_d768_m4096.cubin"
    assert (tmp_path / "e" / cubin).read_bytes() == (tmp_path / "k" / cubin).read_bytes()


def first_cli_tune(recording_path, tmp_path) -> tuple[dict, list[str]]:
    """A replayed tune of d = 768 into an empty tuned/ folder; (its environment, the command's common part)."""
    env = {**os.environ, "MAGE_GEN_TUNED": str(tmp_path / "tuned")}
    common = ["tune", "layernorm", "--d", "768", "--replay", str(recording_path), "--trials", "5",
              "--storage", sqlite(tmp_path), "--out", str(tmp_path / "k"), "--tuned", str(tmp_path / "tuned")]
    first = mage_gen(*common, "--seed", "3", "--study", "first", env=env, cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    # nothing was stored before
    assert "stored winner" not in first.stderr and "nearest tuned shapes" not in first.stderr
    return env, common


def test_cli_retune_measures_the_stored_winner_first(recording_path, tmp_path):
    env, common = first_cli_tune(recording_path, tmp_path)
    stored = json.loads((tmp_path / "tuned" / "h200" / "layernorm.json").read_text())["entries"]["d=768/float32/m=4096"]
    second = mage_gen(*common, "--seed", "4", "--study", "second", env=env, cwd=tmp_path)
    assert second.returncode == 0, second.stderr
    assert f"the stored winner {stored['kernel']} is measured first" in second.stderr
    study = optuna.load_study(study_name="second", storage=sqlite(tmp_path))
    assert study.trials[0].user_attrs["kernel"] == stored["kernel"]


def test_cli_tune_of_an_untuned_shape_measures_the_nearest_tuned_shape_s_winner_first(recording_path, recording,
                                                                                    tmp_path):
    env, common = first_cli_tune(recording_path, tmp_path)
    # the winner moved to d = 1024: d = 768 is untuned again, with a neighbour whose params it can take
    path = tmp_path / "tuned" / "h200" / "layernorm.json"
    doc = json.loads(path.read_text())
    entry = doc["entries"].pop("d=768/float32/m=4096")
    doc["entries"]["d=1024/float32/m=4096"] = {**entry, "shape": {**entry["shape"], "d": 1024}}
    path.write_text(json.dumps(doc))
    second = mage_gen(*common, "--seed", "4", "--study", "second", env=env, cwd=tmp_path)
    assert second.returncode == 0, second.stderr
    assert "stored winner" not in second.stderr
    assert "the winners of the nearest tuned shapes: {'d': 1024}" in " ".join(second.stderr.split())
    study = optuna.load_study(study_name="second", storage=sqlite(tmp_path))
    assert study.trials[0].user_attrs["kernel"] == entry["kernel"]  # d = 1024's params, built at d = 768
    # a retune measures its own stored winner first, then a neighbour's (another config of the first study, moved
    # to d = 512)
    other = next(p for p in expand(OP, SHAPE, QUICK)[0] if OP.kernel_name(SHAPE, p) != entry["kernel"]
                 and hot_median(recording, OP.kernel_name(SHAPE, p)) is not None)
    doc = json.loads(path.read_text())
    doc["entries"]["d=768/float32/m=4096"] = entry
    doc["entries"]["d=512/float32/m=4096"] = {**entry, "shape": {**entry["shape"], "d": 512},
                                              "params": OP.params_to_dict(other)}
    path.write_text(json.dumps(doc))
    third = mage_gen(*common, "--seed", "5", "--study", "third", env=env, cwd=tmp_path)
    assert third.returncode == 0, third.stderr
    said = " ".join(third.stderr.split())
    assert said.index("the stored winner") < said.index("the winners of the nearest tuned shapes: {'d': 512}")
    trials = optuna.load_study(study_name="third", storage=sqlite(tmp_path)).trials
    assert [t.user_attrs["kernel"] for t in trials[:2]] == [entry["kernel"], OP.kernel_name(SHAPE, other)]


def test_a_replay_writes_no_tuned_entry_study_or_kernel_unless_given_paths(recording_path, tmp_path):
    # The defaults are the folders a real tune on the GPU writes and resumes: a replay leaves them alone.
    env = {**os.environ, "MAGE_GEN_TUNED": str(tmp_path / "tuned"), "XDG_DATA_HOME": str(tmp_path / "data")}
    done = mage_gen("tune", "layernorm", "--d", "768", "--replay", str(recording_path), "--trials", "6",
                    env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "not stored or emitted" in done.stdout and "--tuned" in done.stdout
    written = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*"))
    assert written == [], written  # no tuned/, no study under the user data folder, no kernels/


def test_cli_tune_without_a_gpu_says_so_at_once_and_compiles_nothing(tmp_path):
    # It used to compile the whole preset first: hours at the full one. CUDA_VISIBLE_DEVICES="" hides a GPU where
    # there is one; the rest keeps a stray run out of real folders.
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "MAGE_GEN_TUNED": str(tmp_path / "tuned"),
           "XDG_DATA_HOME": str(tmp_path / "data"), "MAGE_GEN_CACHE": str(tmp_path / "cache")}
    done = mage_gen("tune", "layernorm", "--d", "768", "--preset", "full", env=env, cwd=tmp_path)
    assert done.returncode == 2
    assert "Traceback" not in done.stderr and done.stdout == ""
    assert done.stderr.strip().splitlines() == [done.stderr.strip()]
    assert "needs an NVIDIA GPU" in done.stderr and "`mage-gen variants layernorm --d 768 --preset full`" in done.stderr
    assert not (tmp_path / "cache").exists(), "it compiled"
    assert not (tmp_path / "tuned").exists() and not (tmp_path / "kernels").exists()


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


def test_a_tune_reports_its_own_trials_seconds_and_no_one_elses():
    import optuna

    from mage_gen.tune import WORKER, _seconds_per_trial
    study = optuna.create_study()
    for worker, seconds in ((WORKER, {"load": 0.02, "gate": 0.3, "gate_host": 0.2, "timing": 0.1}),
                            (WORKER, {"load": 0.04, "gate": 0.5, "gate_host": 0.4}),  # failed its gate: not timed
                            ("another-host:1", {"load": 9.0, "gate": 9.0, "gate_host": 9.0, "timing": 9.0})):
        study.add_trial(optuna.trial.create_trial(value=1.0, user_attrs={"worker": worker, "seconds": seconds}))
    study.add_trial(optuna.trial.create_trial(value=1.0, user_attrs={"worker": WORKER}))  # a replay says nothing
    assert _seconds_per_trial(study) == pytest.approx({"load": 0.03, "gate": 0.4, "gate_host": 0.3, "timing": 0.05})
    assert _seconds_per_trial(optuna.create_study()) == {}


def test_the_trial_seconds_line_names_each_part():
    from mage_gen.cli_tune import _trial_seconds_line
    line = _trial_seconds_line({"load": 0.012, "gate": 0.31, "gate_host": 0.25, "timing": 0.12})
    assert line == "a trial, on average: load 0.01 s, gate 0.31 s (host 0.25 s), timing 0.12 s"


def test_the_rmsnorm_space_for_long_rows_starts_from_inductor_s_kernel_too():
    op = get_op("rmsnorm")
    shape = op.shape(d=8192, dtype="bf16")
    space = load_space(op, "long", shape)
    valid = set(expand(op, shape, space, "sm_90")[0])
    first = [op.params_from_dict(dict(values)) for values in space.first]
    inductor = op.params_from_dict({"template": "wide", "threads": 512, "vector": 16, "hint": "keep_unreleased",
                                    "min_blocks": 4})
    assert inductor in valid and inductor in first
    # Triton's tables come first, in the order written, then Inductor's, and no config is measured twice
    assert first[0].template == "row" and len(set(first)) == len(first)
    asking = [i for i, p in enumerate(first) if p.weights == "l2"]
    assert asking and first.index(inductor) < min(asking)
    # then Inductor's kernel with w asked of L2 as the launch starts
    inductor_asking = dataclasses.replace(inductor, weights="l2")
    assert inductor_asking in valid and inductor_asking in first


def test_cli_tunes_a_gemm_at_several_m_in_turn_each_from_the_winners_stored_before_it(tmp_path):
    """gemm_sm90's entries are classes over M: --m 16,32 tunes two shapes, one study each, and the second measures
    the first's fresh winner first (a recording of made-up times stands in for the GPU)."""
    gemm = get_op("gemm_sm90")
    device = {"name": "NVIDIA H200", "cc": "9.0", "sms": 132, "l2_bytes": 60 << 20, "driver": "13.0"}
    variants = []
    for m in (16, 32):
        shape = gemm.shape(m=m, n=64, k=64)
        for i, params in enumerate(expand(gemm, shape, load_space(gemm, None, shape, sms=132))[0]):
            timing = {method: {"method": method, "samples": 8, "median_us": 10.0 + i, "spread_us": 0.1,
                               "min_us": 10.0 + i} for method in ("hot", "cold")}
            variants.append({"kernel": gemm.kernel_name(shape, params), "gate": {"passed": True, "reason": "",
                                                                                 "worst_error": 0.0}, **timing})
    recording = tmp_path / "gemm_recording.json"
    recording.write_text(json.dumps({"gpu": device, "variants": variants}))
    env = {**os.environ, "MAGE_GEN_TUNED": str(tmp_path / "tuned")}
    done = mage_gen("tune", "gemm_sm90", "--m", "16,32", "--n", "64", "--k", "64", "--replay", str(recording),
                    "--trials", "3", "--storage", sqlite(tmp_path), "--tuned", str(tmp_path / "tuned"), "-o",
                    str(tmp_path / "k"), env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    said = " ".join(done.stderr.split())
    assert said.index("tuning gemm_sm90 {'m': 16") < said.index("tuning gemm_sm90 {'m': 32")
    assert "the winner of the size class that serves this shape now, {'m': 16, 'n': 64, 'k': 64}" in said
    entries = json.loads((tmp_path / "tuned" / "h200" / "gemm_sm90.json").read_text())["entries"]
    assert sorted(entries) == ["m=16,n=64,k=64/bf16/nk/bf16", "m=32,n=64,k=64/bf16/nk/bf16"]
    studies = optuna.get_all_study_summaries(storage=sqlite(tmp_path))
    assert len(studies) == 2
    second = next(s for s in studies if "m32" in s.study_name)
    first_trial = optuna.load_study(study_name=second.study_name, storage=sqlite(tmp_path)).trials[0]
    m16 = entries["m=16,n=64,k=64/bf16/nk/bf16"]
    assert first_trial.user_attrs["kernel"] == gemm.kernel_name(gemm.shape(m=32, n=64, k=64),
                                                                gemm.params_from_dict(m16["params"]))
    assert sorted(p.name for p in (tmp_path / "k").iterdir() if p.suffix == ".cu") == [
        "gemm_sm90_bf16_nk_bf16_m16_n64_k64.cu", "gemm_sm90_bf16_nk_bf16_m32_n64_k64.cu"]


def test_a_new_gemm_size_class_keeps_the_winner_that_served_its_shape_unless_beaten(tmp_path):
    """A class tuned where another class serves its shape (dispatch.CLASS_RULE) starts from that class's winner and
    re-times it in the final round: tied with the finalists, the serving winner is kept, not the fastest of the
    frugal ones, so that a short search never stores a class slower than what ran at its shape before."""
    gemm = get_op("gemm_sm90")
    device = {"name": "NVIDIA H200", "cc": "9.0", "sms": 132, "l2_bytes": 60 << 20, "driver": "13.0"}
    recording = tmp_path / "gemm_recording.json"
    threads = {}

    def record(m: int, microseconds) -> None:
        shape = gemm.shape(m=m, n=64, k=64)
        variants = []
        for params in expand(gemm, shape, load_space(gemm, None, shape, sms=132))[0]:
            name, us = gemm.kernel_name(shape, params), microseconds(params)
            threads[name] = gemm.geometry(shape, params, {"m": m}).threads
            timing = {method: {"method": method, "samples": 8, "median_us": us, "spread_us": 0.1, "min_us": us}
                      for method in ("hot", "cold")}
            variants.append({"kernel": name, "gate": {"passed": True, "reason": "", "worst_error": 0.0}, **timing})
        recording.write_text(json.dumps({"gpu": device, "variants": variants}))

    env = {**os.environ, "MAGE_GEN_TUNED": str(tmp_path / "tuned")}
    common = ("--n", "64", "--k", "64", "--replay", str(recording), "--trials", "6", "--storage", sqlite(tmp_path),
              "--tuned", str(tmp_path / "tuned"), "-o", str(tmp_path / "k"))
    record(16, lambda params: 20.0)
    assert mage_gen("tune", "gemm_sm90", "--m", "16", *common, env=env, cwd=tmp_path).returncode == 0
    stored = tmp_path / "tuned" / "h200" / "gemm_sm90.json"
    served = gemm.params_from_dict(json.loads(stored.read_text())["entries"]["m=16,n=64,k=64/bf16/nk/bf16"]["params"])
    # at M = 32 the serving winner ties with every other config, a tenth of their spread slower
    record(32, lambda params: 10.01 if params == served else 10.0)
    done = mage_gen("tune", "gemm_sm90", "--m", "32", *common, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert ("the winner of the size class that serves this shape now, {'m': 16, 'n': 64, 'k': 64}, is measured "
            "first") in " ".join(done.stderr.split())
    new = json.loads(stored.read_text())["entries"]["m=32,n=64,k=64/bf16/nk/bf16"]
    assert gemm.params_from_dict(new["params"]) == served and new["tie"] is True
    # the frugal rule alone would have kept another: a tied finalist with fewer registers, threads, or microseconds
    frugal = min((f["registers"], threads[f["kernel"]], f["hot"]["median_us"]) for f in new["runner_ups"])
    assert frugal < (new["census"]["registers"], threads[new["kernel"]], new["timings"]["hot"]["median_us"])
    # a retune measures its stored winner first, then what would serve its shape without it: M = 16's winner, made
    # another config here
    doc = json.loads(stored.read_text())
    other = next(p for p in expand(gemm, gemm.shape(m=32, n=64, k=64),
                                   load_space(gemm, None, gemm.shape(m=32, n=64, k=64), sms=132))[0] if p != served)
    doc["entries"]["m=16,n=64,k=64/bf16/nk/bf16"]["params"] = gemm.params_to_dict(other)
    stored.write_text(json.dumps(doc))
    again = mage_gen("tune", "gemm_sm90", "--m", "32", *common, "--study", "again", env=env, cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    said = " ".join(again.stderr.split())
    assert said.index("the stored winner") < said.index(
        "the winner of the size class that would serve this shape without its own entry, {'m': 16, 'n': 64, 'k': 64}")
    trials = optuna.load_study(study_name="again", storage=sqlite(tmp_path)).trials
    assert [t.user_attrs["kernel"] for t in trials[:2]] == [gemm.kernel_name(gemm.shape(m=32, n=64, k=64), p)
                                                           for p in (served, other)]
