"""Tuning on many GPUs and hosts: one Optuna study in a server database (PostgreSQL), one worker process per
GPU, all asking the same study. Optuna is the engine, not a scheduler of ours: mage_gen.tune.measure gives a
config to the first trial that claimed it, and the storage's heartbeats let a live worker take over a dead
one's config (its trial is failed after the grace period and enqueued again).

`mage-gen tune --gpus 0,1` measures on the first GPU itself and starts `mage-gen worker` on the others, then
re-times the finalists on its own GPU alone; `mage-gen worker` joins a study from any host and never writes
tuned/.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from dataclasses import dataclass
from typing import Any

from mage_gen.errors import ConfigError, MageError

HEARTBEAT_S = 2  # a running trial's worker writes a heartbeat this often
GRACE_S = 10  # without one for this long, its trial is failed and its config enqueued again


def is_server(url: str) -> bool:
    return not url.startswith("sqlite") and url != "memory"


def driver_url(url: str) -> str:
    """postgresql:// names SQLAlchemy's default driver, psycopg2; the [distributed] extra brings psycopg 3."""
    if url.startswith("postgresql://") and importlib.util.find_spec("psycopg2") is None:
        return "postgresql+psycopg://" + url.removeprefix("postgresql://")
    return url


def shown(url: str) -> str:
    """The URL with its password hidden, for messages."""
    try:
        from sqlalchemy.engine import make_url

        return make_url(url).render_as_string(hide_password=True)
    except Exception:  # noqa: BLE001  (not a URL SQLAlchemy reads: shown as given, it holds no password)
        return url


def open_storage(url: str, workers: int, joining: bool = False) -> Any:
    """A URL as the study's storage for `workers` concurrent workers (joining: one that joins a study a tune
    writes too): a server database with heartbeats, or SQLite (one worker only) as given."""
    if not is_server(url):
        if joining:
            raise ConfigError(f"storage: a worker joins a study that the tune and other workers write too, and "
                              f"{shown(url)} is SQLite, which is not safe for concurrent writers; give --storage "
                              "postgresql://USER@HOST/DB")
        if workers > 1:
            raise ConfigError(f"storage: {workers} workers cannot share {shown(url)}: SQLite is not safe for "
                              "concurrent writers; give --storage postgresql://USER@HOST/DB")
        return url
    import optuna

    # a stale trial's config enqueued again: Optuna 4.9 renamed the callback and its argument
    if hasattr(optuna.storages, "RetryHeartbeatStaleTrialCallback"):
        retry = {"heartbeat_stale_trial_callback": optuna.storages.RetryHeartbeatStaleTrialCallback(max_retry=3)}
    else:
        retry = {"failed_trial_callback": optuna.storages.RetryFailedTrialCallback(max_retry=3)}
    try:
        return optuna.storages.RDBStorage(driver_url(url), heartbeat_interval=HEARTBEAT_S, grace_period=GRACE_S,
                                          **retry)
    except ModuleNotFoundError as exc:
        raise MageError(f"storage: {exc.name} is not installed; pip install 'mage-gen[distributed]'") from None
    except Exception as exc:  # SQLAlchemy and Optuna raise many kinds for a bad URL, host, password or database
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise MageError(f"storage: cannot open Optuna storage {shown(url)!r} ({first_line[:300]}); "
                        "give a reachable database URL with --storage") from None


def gpu_list(spec: str) -> list[int]:
    """'0,1' or 'all' (every GPU the driver shows)."""
    if spec == "all":
        from mage_gen import gpu

        return list(range(gpu.device_count()))
    try:
        chosen = [int(part) for part in spec.split(",")]
    except ValueError:
        raise ConfigError(f"gpus: give GPU indices like 0,1 or all, got {spec!r}") from None
    if not chosen or len(set(chosen)) != len(chosen) or min(chosen) < 0:
        raise ConfigError(f"gpus: give distinct GPU indices like 0,1 or all, got {spec!r}")
    return chosen


@dataclass
class Workers:
    """`mage-gen worker` processes of one study on this host, one per GPU."""

    processes: dict[int, subprocess.Popen]

    def wait(self) -> list[str]:
        """Wait for all; what went wrong with each that failed (a dead worker loses nothing: its trial is
        failed and retried by another)."""
        trouble = []
        for index, process in self.processes.items():
            code = process.wait()
            if code != 0:
                trouble.append(f"worker on GPU {index} ended with exit code {code}")
        return trouble


def start_workers(url: str, study: str, gpus: list[int], seed: int, extra: list[str]) -> Workers:
    """One `mage-gen worker` per GPU, each pinned to it and sampling with its own seed (the same seed would
    have every worker propose the same configs)."""
    processes = {}
    for position, index in enumerate(gpus, 1):
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": str(index)}
        processes[index] = subprocess.Popen(
            [sys.executable, "-m", "mage_gen", "worker", "--storage", url, "--study", study,
             "--seed", str(seed + position), *extra], env=env, stdout=subprocess.DEVNULL)
    return Workers(processes)
