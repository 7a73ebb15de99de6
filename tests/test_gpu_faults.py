"""On the GPU: planted faults run through the real worker process. A trial that writes to an illegal
address, never finishes or cannot launch fails with its reason, the worker is replaced where the CUDA
context is lost, and the clean variant passes again after it: the study goes on. Skipped without a GPU."""

import functools
from dataclasses import dataclass

import pytest

from mage_gen.errors import NoGpuError
from mage_gen.worker import IsolatedBackend, gpu_backend

import planted

pytestmark = pytest.mark.gpu
RUN = {"m": 4096}
MIN_TIMEOUT_S = 2.0


@dataclass(frozen=True)
class Expected:
    says: str  # what the failed trial's reason must name
    loses_context: bool  # the CUDA context is unusable after it: the worker must start a new child


EXPECTED = {
    "out_of_bounds_write": Expected("CUDA_ERROR_ILLEGAL_ADDRESS", loses_context=True),
    "endless_loop": Expected("no answer in", loses_context=True),
    "too_many_registers": Expected("CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES", loses_context=False),
}


@pytest.fixture(scope="module")
def worker():
    """One worker for the module (a child start costs seconds); every test checks it from a clean trial."""
    try:
        backend = IsolatedBackend(functools.partial(gpu_backend, "layernorm", planted.SHAPE, RUN, 0),
                                  min_timeout_s=MIN_TIMEOUT_S)
    except NoGpuError as exc:
        pytest.skip(str(exc))
    yield backend
    backend.close()


@pytest.fixture(scope="module")
def clean(worker):
    return planted.variant(worker.arch)


@pytest.fixture
def calibrated(worker, clean):
    """The worker after a clean trial passed in it: the trials so far set its timeout."""
    result = worker.evaluate(clean)
    assert result.gate.passed, result.gate.reason
    return worker


@pytest.mark.parametrize("fault", planted.LAUNCHED)
def test_a_faulty_trial_fails_with_its_cause_and_the_study_goes_on(calibrated, clean, fault):
    expected = EXPECTED[fault]  # a new fault needs its expected outcome here
    variant = planted.fault_variant(calibrated.arch, fault)
    restarts = calibrated.restarts
    result = calibrated.evaluate(variant)
    reason = result.gate.reason
    assert not result.gate.passed and expected.says in reason, reason
    assert result.hot is None and result.cold is None  # a failed trial is never timed
    if expected.loses_context:
        assert calibrated.restarts > restarts and "restarted" in reason, reason
    else:
        assert calibrated.restarts == restarts, reason  # the context is fine: the child is kept
    after = calibrated.evaluate(clean)
    assert after.gate.passed, f"after {fault}: {after.gate.reason}"
    assert after.hot is not None and after.hot.median_us > 0


def test_a_short_study_through_the_worker_finds_a_winner(worker, tmp_path):
    from mage_gen.space import Space
    from mage_gen.tune import tune

    op = planted.OP
    space = Space(op="layernorm", preset="corner", axes=(
        ("template", ("row",)), ("threads", (64, 128)), ("vector", (8, 16)), ("rows_per_block", (1,)),
        ("rsqrt", ("approx",)), ("hint", ("nc",)), ("stats", ("two_pass",)), ("grid_cap", (0,))))
    result = tune(op, planted.SHAPE, RUN, space, worker, storage=f"sqlite:///{tmp_path / 'study.db'}")
    assert result.measured == 4 and not result.failed, result.failed
    assert result.winner.hot.median_us > 0
    # the final round: every finalist and peer at each placement of the inputs and outputs, the samples pooled
    from mage_gen.backends import FINAL_PER_ROUND, FINAL_PLACEMENTS, FINAL_ROUNDS

    assert result.winner.hot.samples == result.winner.cold.samples == FINAL_ROUNDS * FINAL_PER_ROUND
    for name, peer in result.peers.items():
        assert len(peer["config"]["at the other placements"]) == FINAL_PLACEMENTS - 1, name
    # finalists told apart by the rounds they were timed in together, the winner against each peer too
    assert result.tie_test == "paired rounds"
    assert all(len(result.winner.rounds[m]) == FINAL_ROUNDS for m in ("hot", "cold"))
    assert all(set(result.winner_over_peer(name)) == {"hot", "cold"} for name in result.peers)
