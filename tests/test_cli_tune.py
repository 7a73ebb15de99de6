"""`mage-gen tune` on the CPU: replays of timings recorded on an H200 (tests/fixtures) and of made-up ones for
gemm_sm90 stand in for the GPU, so that what the command stores, emits, says and resumes is checked end to end."""

import json
import os
import subprocess
import sys
from pathlib import Path

import optuna
import pytest

from mage_gen.ops import get_op
from mage_gen.space import expand, load_space
from mage_gen.timing import Timing
from replayed import H200, OP, QUICK, SHAPE, by_kernel, hot_median, sqlite  # tests/replayed.py


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


def take_d768_out(tmp_path) -> tuple[Path, dict, dict]:
    """first_cli_tune's H200 store with d = 768's entry taken out, not yet written back: (its path, the rest of it,
    the entry)."""
    path = tmp_path / "tuned" / "h200" / "layernorm.json"
    doc = json.loads(path.read_text())
    return path, doc, doc["entries"].pop("d=768/float32/m=4096")


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
    path, doc, entry = take_d768_out(tmp_path)
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


def test_cli_tune_of_a_size_class_untuned_here_measures_its_winner_on_another_gpu_first(recording_path, recording,
                                                                                       tmp_path):
    env, common = first_cli_tune(recording_path, tmp_path)
    # d = 768 is tuned on another GPU only, with a config the first study did not pick; a store no one can read
    # beside it is passed over
    path, doc, entry = take_d768_out(tmp_path)
    path.write_text(json.dumps(doc))
    recorded = by_kernel(recording)
    other = next(p for p in reversed(expand(OP, SHAPE, QUICK)[0])
                 if (name := OP.kernel_name(SHAPE, p)) != entry["kernel"] and name in recorded and recorded[name]["hot"])
    elsewhere = tmp_path / "tuned" / "rtx-4090" / "layernorm.json"
    elsewhere.parent.mkdir()
    elsewhere.write_text(json.dumps({**doc, "entries": {"d=768/float32/m=4096": {**entry,
                                                                                 "params": OP.params_to_dict(other)}}}))
    (tmp_path / "tuned" / "a100").mkdir()
    (tmp_path / "tuned" / "a100" / "layernorm.json").write_text("{not json")
    second = mage_gen(*common, "--seed", "4", "--study", "second", env=env, cwd=tmp_path)
    assert second.returncode == 0, second.stderr
    assert "first, where the preset holds it, this size class's winner on rtx-4090" in " ".join(second.stderr.split())
    study = optuna.load_study(study_name="second", storage=sqlite(tmp_path))
    assert study.trials[0].user_attrs["kernel"] == OP.kernel_name(SHAPE, other)


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
    # at M = 16 a config of one consumer wins (255 registers a thread, where two consumers hold 168)
    record(16, lambda params: 19.0 if params.consumers == 1 else 20.0)
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
