"""Many workers on one study in a real PostgreSQL (started here from the system's packages, as an unprivileged
user): replay-backend workers share the budget without measuring a config twice, a worker killed mid-trial
loses nothing, a worker joins late, and bad storages are one-line errors."""

import glob
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import optuna
import pytest

RECORDING = Path(__file__).parent / "fixtures" / "layernorm_trials_h200_d768_m4096.json"
PASSWORD = "mage-gen-test"
# one PostgreSQL cluster (the module fixture) for all of them, under pytest-xdist too
pytestmark = pytest.mark.xdist_group("fleet")


def postgres_bin(tool: str) -> str:
    found = shutil.which(tool) or next(iter(sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{tool}"))[-1:]), None)
    if found is None:
        if os.environ.get("CI"):
            pytest.fail(f"PostgreSQL's {tool} is missing in CI; .ci/run installs the postgresql package")
        pytest.skip(f"PostgreSQL's {tool} is not installed")
    return found


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def postgres():
    """A PostgreSQL cluster on a free local port with a password-protected user and a database: its URL."""
    pytest.importorskip("psycopg")
    initdb, pg_ctl = postgres_bin("initdb"), postgres_bin("pg_ctl")
    root = Path(tempfile.mkdtemp(prefix="mage-gen-pg-"))
    os.chmod(root, 0o755)
    as_user: list[str] = []
    if os.geteuid() == 0:  # PostgreSQL refuses to run as root
        shutil.chown(root, "nobody")
        as_user = ["runuser", "-u", "nobody", "--"]
    (root / "pw").write_text(PASSWORD)
    if as_user:
        shutil.chown(root / "pw", "nobody")
    port = free_port()

    def run(*args: str) -> None:
        done = subprocess.run([*as_user, *args], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stdout + done.stderr

    run(initdb, "-D", str(root / "data"), "-U", "mage", "--pwfile", str(root / "pw"), "--auth-host=scram-sha-256",
        "--auth-local=trust", "-E", "UTF8")
    run(pg_ctl, "-D", str(root / "data"), "-l", str(root / "log"), "-w", "-o",
        f"-p {port} -k {root} -c listen_addresses=127.0.0.1", "start")
    try:
        run(postgres_bin("createdb"), "-h", str(root), "-p", str(port), "-U", "mage", "studies")
        yield f"postgresql://mage:{PASSWORD}@127.0.0.1:{port}/studies"
    finally:
        subprocess.run([*as_user, pg_ctl, "-D", str(root / "data"), "-m", "immediate", "stop"], capture_output=True)
        shutil.rmtree(root, ignore_errors=True)


def env(tmp_path: Path, replay_seconds: float = 0.0) -> dict[str, str]:
    return {**os.environ, "MAGE_GEN_TUNED": str(tmp_path / "tuned"), "XDG_DATA_HOME": str(tmp_path / "data"),
            "MAGE_GEN_REPLAY_SECONDS": str(replay_seconds)}


def tune_args(url: str, study: str, trials: int, gpus: str, tmp_path: Path) -> list[str]:
    return [sys.executable, "-m", "mage_gen", "tune", "layernorm", "--d", "768", "--replay", str(RECORDING),
            "--storage", url, "--study", study, "--trials", str(trials), "--gpus", gpus,
            "--tuned", str(tmp_path / "tuned"), "-o", str(tmp_path / "k")]


def counted(url: str, study: str) -> list[optuna.trial.FrozenTrial]:
    """The trials that measured a config: finished with a params key, failed ones with a reason."""
    trials = optuna.load_study(study_name=study, storage=url.replace("postgresql://", "postgresql+psycopg://")).trials
    return [t for t in trials if "params_key" in t.user_attrs and (
        t.state == optuna.trial.TrialState.COMPLETE
        or (t.state == optuna.trial.TrialState.FAIL and "reason" in t.user_attrs))]


def test_three_workers_share_one_study_and_never_measure_a_config_twice(postgres, tmp_path):
    done = subprocess.run(tune_args(postgres, "three", 24, "0,1,2", tmp_path), env=env(tmp_path, 0.05),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    trials = counted(postgres, "three")
    keys = [t.user_attrs["params_key"] for t in trials]
    assert len(keys) == 24 and len(set(keys)) == 24  # the study's total is the budget, each config once
    assert len({t.user_attrs["worker"] for t in trials}) == 3  # all three measured
    assert json.loads((tmp_path / "tuned" / "h200" / "layernorm.json").read_text())["entries"]


def test_a_worker_killed_mid_trial_loses_nothing(postgres, tmp_path):
    starter = subprocess.Popen(tune_args(postgres, "killed", 12, "0,1", tmp_path), env=env(tmp_path, 1.0),
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = postgres.replace("postgresql://", "postgresql+psycopg://")
    victim, deadline = None, time.monotonic() + 120
    try:
        while victim is None and time.monotonic() < deadline:
            time.sleep(0.3)
            try:
                running = optuna.load_study(study_name="killed", storage=url).get_trials(
                    states=(optuna.trial.TrialState.RUNNING,))
            except KeyError:  # not created yet
                continue
            pids = {int(t.user_attrs["worker"].rsplit(":", 1)[1]): t.number for t in running if "worker" in t.user_attrs}
            victim = next(((pid, number) for pid, number in pids.items() if pid != starter.pid), None)
        assert victim is not None, "no worker of the starter's was seen measuring"
        os.kill(victim[0], signal.SIGKILL)
        stderr = starter.communicate(timeout=240)[1]
    finally:
        if starter.poll() is None:
            starter.kill()
    assert starter.returncode == 0, stderr
    assert "ended with exit code -9" in stderr
    study = optuna.load_study(study_name="killed", storage=url)
    lost = study.trials[victim[1]]
    assert lost.state == optuna.trial.TrialState.FAIL and "reason" not in lost.user_attrs  # failed by its heartbeat
    trials = counted(postgres, "killed")
    keys = [t.user_attrs["params_key"] for t in trials]
    assert len(keys) == 12 and len(set(keys)) == 12
    assert lost.user_attrs["params_key"] in keys  # its config was measured again by another worker


def test_a_worker_joins_late_and_the_study_stops_at_its_budget(postgres, tmp_path):
    starter = subprocess.Popen(tune_args(postgres, "late", 16, "0", tmp_path), env=env(tmp_path, 0.3),
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        time.sleep(3)
        joined = subprocess.run([sys.executable, "-m", "mage_gen", "worker", "--storage", postgres, "--study", "late",
                                 "--replay", str(RECORDING)], env=env(tmp_path, 0.3), capture_output=True, text=True,
                                timeout=240)
        stderr = starter.communicate(timeout=240)[1]
    finally:
        if starter.poll() is None:
            starter.kill()
    assert joined.returncode == 0 and starter.returncode == 0, joined.stderr + stderr
    assert "of study late; it holds" in joined.stdout
    trials = counted(postgres, "late")
    keys = [t.user_attrs["params_key"] for t in trials]
    assert len(keys) == 16 and len(set(keys)) == 16
    assert len({t.user_attrs["worker"] for t in trials}) == 2


def one_line_error(args: list[str], tmp_path: Path) -> str:
    done = subprocess.run([sys.executable, "-m", "mage_gen", *args], env=env(tmp_path), capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("mage-gen: error: "), done.stderr
    return lines[0]


@pytest.mark.parametrize("change, says", [
    (lambda url: url.replace(PASSWORD, "wrong"), "password"),
    (lambda url: url.rsplit(":", 1)[0] + ":1/studies", "cannot open Optuna storage"),
    (lambda url: url.rsplit("/", 1)[0] + "/no_such_database", "no_such_database"),
], ids=["wrong-password", "unreachable", "missing-database"])
def test_a_bad_server_storage_is_one_line_without_its_password(postgres, tmp_path, change, says):
    line = one_line_error(["worker", "--storage", change(postgres), "--study", "x", "--replay", str(RECORDING)],
                          tmp_path)
    assert "cannot open Optuna storage" in line and says in line and "wrong" not in line and PASSWORD not in line


def test_several_workers_on_sqlite_are_refused(tmp_path):
    line = one_line_error(tune_args(f"sqlite:///{tmp_path / 's.db'}", "s", 4, "0,1", tmp_path)[3:], tmp_path)
    assert "SQLite is not safe for concurrent writers" in line and "postgresql://" in line
    assert not (tmp_path / "s.db").exists()


def test_a_worker_of_another_gpu_model_is_refused(postgres, tmp_path):
    # seed 1: its first configs are ones the recording measured (tests/test_bad_input.py uses the same)
    done = subprocess.run([*tune_args(postgres, "h200-only", 4, "0", tmp_path), "--seed", "1"], env=env(tmp_path),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    other = json.loads(RECORDING.read_text())
    other["gpu"] = {**other["gpu"], "name": "NVIDIA H100 80GB HBM3"}
    (tmp_path / "h100.json").write_text(json.dumps(other))
    line = one_line_error(["worker", "--storage", postgres, "--study", "h200-only", "--replay",
                           str(tmp_path / "h100.json")], tmp_path)
    assert "is for NVIDIA H200" in line and "another GPU model tunes a study of its own" in line
