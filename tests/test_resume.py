"""The tuner killed (SIGKILL: no cleanup runs) and run again, through the real command and a real SQLite study:
no finished trial is lost or measured again, and the tuned/ winner file is always the old one or the new one,
never half of either. Measurements come from the H200 recording (ReplayBackend), so this runs on the CPU.
"""

import contextlib
import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import optuna
import pytest

from mage_gen.store import load_entry

RECORDING = Path(__file__).parent / "fixtures" / "layernorm_trials_h200_d768_m4096.json"
H200 = "NVIDIA H200"
KEY = "d=768/float32/m=4096"
FINISHED = (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.FAIL)


# The command with os.replace wrapped to SIGKILL the process at a named point of writing the winner or the
# emitted kernel: a kill there is certain, not a race against the clock.
KILL_AT = """
import os, runpy, signal, sys
moment, real_replace = os.environ["KILL_AT"], os.replace
def replace(src, dst, *args, **kwargs):
    name = os.path.basename(str(dst))
    if moment == "before-rename" and name == "layernorm.json":
        os.kill(os.getpid(), signal.SIGKILL)
    real_replace(src, dst, *args, **kwargs)
    if (moment == "after-rename" and name == "layernorm.json") or (moment == "emitting" and name.endswith(".cu")):
        os.kill(os.getpid(), signal.SIGKILL)
os.replace = replace
runpy.run_module("mage_gen", run_name="__main__")
"""


def start(tmp_path: Path, db: Path, trials: int, study: str | None = None, seed: int = 0,
          kill_at: str | None = None) -> subprocess.Popen:
    command = ["-c", KILL_AT] if kill_at else ["-m", "mage_gen"]
    args = [sys.executable, *command, "tune", "layernorm", "--d", "768", "--replay", str(RECORDING),
            "--storage", f"sqlite:///{db}", "--trials", str(trials), "--out", str(tmp_path / "k"),
            "--tuned", str(tmp_path / "tuned"),
            "--seed", str(seed), *(["--study", study] if study else [])]
    # MAGE_GEN_CACHE stays the session's; nothing else may leave tmp_path.
    env = {**os.environ, "MAGE_GEN_TUNED": str(tmp_path / "tuned"), "XDG_DATA_HOME": str(tmp_path / "data"),
           "CUDA_VISIBLE_DEVICES": "", **({"KILL_AT": kill_at} if kill_at else {})}
    log = (tmp_path / f"{db.stem}.log").open("ab")
    return subprocess.Popen(args, env=env, cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT)


def measured(db: Path) -> int | None:
    """Configs the study has finished measuring (a repeated proposal carries no params_key), read-only;
    None while the file or its tables do not exist yet or the writer holds the lock."""
    try:
        with contextlib.closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=0.2)) as con:
            return con.execute("SELECT COUNT(*) FROM trials t JOIN trial_user_attributes a ON a.trial_id = t.trial_id"
                               " WHERE a.key = 'params_key' AND t.state IN ('COMPLETE', 'FAIL')").fetchone()[0]
    except sqlite3.Error:
        return None


# Every wait below is a hang guard, not a speed target: under a full suite on two cores a tune compiles its space
# several times slower than alone (one of 120 s ran out there once).
HANG_S = 300


def wait_for(process: subprocess.Popen, db: Path, at_least: int, limit_s: float = HANG_S) -> None:
    deadline = time.monotonic() + limit_s
    while (measured(db) or 0) < at_least:
        if process.poll() is not None:  # it may have finished between two looks: look once more
            assert (measured(db) or 0) >= at_least, f"the tuner ended (rc {process.returncode}) first"
            return
        assert time.monotonic() < deadline, f"fewer than {at_least} trials after {limit_s} s"
        time.sleep(0.01)


def kill(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGKILL)
    process.wait(timeout=30)


def finished_trials(db: Path) -> dict[int, tuple[str | None, str, float | None]]:
    """number -> (params_key, state, value) of every finished trial of the only study in db."""
    (name,) = optuna.get_all_study_names(storage=f"sqlite:///{db}")
    study = optuna.load_study(study_name=name, storage=f"sqlite:///{db}")
    return {t.number: (t.user_attrs.get("params_key"), t.state.name, t.value)
            for t in study.get_trials(deepcopy=False, states=FINISHED)}


def test_killed_mid_study_then_rerun_loses_nothing_and_measures_nothing_twice(tmp_path):
    db = tmp_path / "s.db"
    first = start(tmp_path, db, trials=40)
    try:
        wait_for(first, db, at_least=8)
    finally:
        kill(first)
    assert first.returncode == -signal.SIGKILL
    before = finished_trials(db)
    measured_before = sum(1 for key, _, _ in before.values() if key)
    assert measured_before >= 8
    assert not (tmp_path / "tuned").exists()  # killed before its final round: nothing stored yet

    second = start(tmp_path, db, trials=40)
    assert second.wait(timeout=HANG_S) == 0, (tmp_path / "s.log").read_text()
    after = finished_trials(db)
    # every finished trial of the killed run is still there, as it was
    assert {n: after.get(n) for n in before} == before
    # and no config was measured twice across both runs: a repeated proposal is answered from the study
    measured_keys = [key for key, _, _ in after.values() if key]
    repeats = {key: n for key, n in Counter(measured_keys).items() if n > 1}
    assert not repeats, repeats
    assert len(measured_keys) == 40  # the budget counts both runs
    # the second run's result is stored and emitted, and says it resumed
    entry = load_entry("layernorm", H200, KEY, directory=tmp_path / "tuned")
    assert entry["search"]["reused"] == measured_before and entry["search"]["measured"] == 40 - measured_before
    complete = {key: value for key, state, value in after.values() if key and state == "COMPLETE"}
    assert json.dumps(entry["params"], sort_keys=True) in complete
    launch = json.loads((tmp_path / "k" / "layernorm_d768_m4096.launch.json").read_text())
    assert launch["kernel"] == entry["kernel"] and launch["provenance"]["date"] == entry["date"]


# moment -> the study whose winner the file must hold after the kill
KILLS = {"starting": "first", "mid-search": "first", "before-rename": "first", "after-rename": "again",
         "emitting": "again"}


@pytest.mark.parametrize("moment", list(KILLS))
def test_winner_file_is_old_or_new_never_partial_whatever_the_kill(tmp_path, moment):
    done = start(tmp_path, tmp_path / "first.db", trials=4, study="first", seed=1)
    assert done.wait(timeout=HANG_S) == 0, (tmp_path / "first.log").read_text()
    tuned = tmp_path / "tuned" / "h200" / "layernorm.json"
    old = tuned.read_bytes()
    assert load_entry("layernorm", H200, KEY, directory=tmp_path / "tuned")["study"] == "first"

    # Another study of the same shape measures again and then replaces the entry, unless it is killed first.
    db = tmp_path / "again.db"
    injected = moment not in ("starting", "mid-search")
    again = start(tmp_path, db, trials=6, study="again", seed=2, kill_at=moment if injected else None)
    try:
        if moment == "starting":
            time.sleep(0.5)
        elif moment == "mid-search":
            wait_for(again, db, at_least=3)
        else:
            again.wait(timeout=HANG_S)  # it kills itself at the moment
    finally:
        kill(again)
    assert again.returncode == -signal.SIGKILL, (tmp_path / "again.log").read_text()

    doc = json.loads(tuned.read_text())  # whole JSON: the old file or the new one
    entry = load_entry("layernorm", H200, KEY, directory=tmp_path / "tuned")  # and a complete entry
    assert entry["study"] in ("first", "again")
    if entry["study"] == "first":
        assert tuned.read_bytes() == old
    assert list(doc["entries"]) == [KEY]
    assert entry["study"] == KILLS[moment]
