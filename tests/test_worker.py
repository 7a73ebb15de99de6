"""The tuner's worker process on the CPU: stand-in backends that hang, crash, raise a CUDA error or
fail otherwise, in a real spawned child, as a GPU variant would."""

import functools
import os
import time
from dataclasses import dataclass

import pytest

from mage_gen.errors import GpuError, MageError, NoGpuError
from mage_gen.measure import Evaluation
from mage_gen.verdict import GateResult
from mage_gen.timing import Timing
from mage_gen.worker import IsolatedBackend


@dataclass(frozen=True)
class Job:
    """Stands in for a Variant: what the stand-in backend should do with it."""

    action: str


class StandIn:
    """Behaves as each Job says, the way a broken kernel would make a GpuBackend behave."""

    device = {"name": "stand-in", "cc": "9.0", "sms": 1, "l2_bytes": 0, "driver": "0"}
    arch = "sm_90"

    def __init__(self):
        self.pid = os.getpid()

    def evaluate(self, job: Job) -> Evaluation:
        if job.action == "hang":  # a kernel that never finishes
            time.sleep(3600)
        if job.action == "crash":  # the process killed under us
            os._exit(3)
        if job.action == "gpu_error":  # an illegal address leaves the context unusable
            raise GpuError("cuStreamSynchronize failed: CUDA_ERROR_ILLEGAL_ADDRESS")
        if job.action == "error":
            raise ValueError("a bug in the backend")
        if job.action == "pid":
            return Evaluation(GateResult(True, str(os.getpid()), 0.0))
        t = Timing.from_samples("hot", [1.0, 1.1])
        return Evaluation(GateResult(True, "", 1e-7), t, t)

    def final(self, jobs, progress=None):
        for done in range(len(jobs) + 1):
            progress(done, len(jobs))
        return {}, {}, {}


def refuse():
    raise NoGpuError("no CUDA driver on this machine")


def broken():
    raise RuntimeError("cannot start")


FLOOR_S = 2.0  # far above a stand-in round trip (~10 ms idle), so a loaded machine does not time one out


@pytest.fixture
def worker():
    backend = IsolatedBackend(StandIn, min_timeout_s=FLOOR_S, first_timeout_s=60)
    assert backend.evaluate(Job("ok")).gate.passed  # the median trial time now sets the timeout
    yield backend
    backend.close()


def child_pid(backend) -> int:
    return int(backend.evaluate(Job("pid")).gate.reason)


@pytest.mark.parametrize("action, says", [
    ("hang", "no answer in"),
    ("crash", "exit code 3"),
    ("gpu_error", "CUDA_ERROR_ILLEGAL_ADDRESS"),
])
def test_a_broken_trial_fails_with_its_reason_and_the_worker_is_replaced(worker, action, says):
    before = child_pid(worker)
    started = time.monotonic()
    result = worker.evaluate(Job(action))
    assert not result.gate.passed and says in result.gate.reason and "restarted" in result.gate.reason
    assert result.hot is None  # a failed trial is never timed
    assert time.monotonic() - started < 30
    assert worker.restarts == 1 and child_pid(worker) != before
    assert worker.evaluate(Job("ok")).gate.passed  # the study goes on


def test_an_ordinary_exception_fails_the_trial_and_keeps_the_worker(worker):
    before = child_pid(worker)
    result = worker.evaluate(Job("error"))
    assert not result.gate.passed and "a bug in the backend" in result.gate.reason
    assert worker.restarts == 0 and child_pid(worker) == before


def test_the_final_round_s_steps_reach_the_parent_as_they_end(worker):
    told = []
    assert worker.final([Job("ok")] * 3, progress=lambda done, total: told.append((done, total))) == ({}, {}, {})
    assert told == [(0, 3), (1, 3), (2, 3), (3, 3)]
    assert worker.final([Job("ok")]) == ({}, {}, {})  # told to nobody


def test_the_timeout_follows_the_trials_so_far(worker):
    assert worker.timeout_s() == FLOOR_S  # fast stand-in trials: the floor
    fresh = IsolatedBackend(StandIn, min_timeout_s=FLOOR_S, first_timeout_s=60)
    try:
        assert fresh.timeout_s() == 60  # nothing measured yet
    finally:
        fresh.close()


def test_no_gpu_in_the_child_is_no_gpu_in_the_parent():
    with pytest.raises(NoGpuError, match="no CUDA driver"):
        IsolatedBackend(refuse, first_timeout_s=60)
    with pytest.raises(MageError, match="could not start: RuntimeError: cannot start"):
        IsolatedBackend(broken, first_timeout_s=60)


def test_the_real_gpu_backend_in_a_spawned_child_says_there_is_no_gpu_here(monkeypatch):
    from mage_gen.ops import get_op
    from mage_gen.worker import gpu_backend

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # the child inherits it: no GPU, on a GPU machine too
    op = get_op("layernorm")
    # The factory crosses to the spawned child pickled; a factory that could not would fail differently.
    with pytest.raises(NoGpuError, match="needs an NVIDIA GPU"):
        IsolatedBackend(functools.partial(gpu_backend, op.name, op.shape(d=768), {"m": 4096}, 0))


def test_a_whole_search_through_the_worker_matches_one_in_process(tmp_path):
    # ReplayBackend in the child: real Variants, Evaluations and final timings cross the pipe.
    from pathlib import Path

    from mage_gen.backends import ReplayBackend
    from mage_gen.ops import get_op
    from mage_gen.space import Space
    from mage_gen.tune import tune

    recording = Path(__file__).parent / "fixtures" / "layernorm_trials_h200_d768_m4096.json"
    op = get_op("layernorm")
    space = Space(op="layernorm", preset="corner", axes=(
        ("template", ("row",)), ("threads", (64, 96, 128)), ("vector", (8, 16)), ("rows_per_block", (1,)),
        ("rsqrt", ("approx",)), ("hint", ("nc",)), ("stats", ("two_pass",)), ("grid_cap", (0,))))
    shape, run = op.shape(d=768), {"m": 4096}
    isolated = IsolatedBackend(functools.partial(ReplayBackend, recording), first_timeout_s=60)
    try:
        through_worker = tune(op, shape, run, space, isolated, storage=f"sqlite:///{tmp_path / 'a.db'}")
    finally:
        isolated.close()
    in_process = tune(op, shape, run, space, ReplayBackend(recording), storage=f"sqlite:///{tmp_path / 'b.db'}")
    assert through_worker.winner.name == in_process.winner.name
    assert through_worker.winner.hot == in_process.winner.hot
    assert through_worker.peers.keys() == in_process.peers.keys() and isolated.restarts == 0
