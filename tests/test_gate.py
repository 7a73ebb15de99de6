"""measure.gate's verdicts and its account of the host's time, without a GPU: the device side (buffers, launch,
fences) is a stand-in that writes what a kernel would, so that what the gate does with it is what is tested."""

import numpy as np
import pytest

from mage_gen import measure
from mage_gen.dtypes import dtype as element_type
from mage_gen.ops import get_op

OP = get_op("layernorm")
SHAPE = OP.shape(d=256, dtype="bf16")


class Stream:
    handle = None

    def synchronize(self) -> None:
        pass


def standing_in(writes):
    """A Bound whose 'kernel' leaves writes(reference, run) in its outputs, and whose fences are never hit
    unless writes says so (by returning complaints)."""

    class Bound:
        freed = 0

        def __init__(self, op, shape, params, kernel, run, inputs):
            self.op, self.shape, self.run, self.inputs = op, shape, run, inputs

        def poison(self, stream) -> None:
            pass

        def enqueue(self, handle) -> None:
            pass

        def outputs(self):
            reference = self.op.reference(self.shape, self.inputs, self.op.scalars(self.shape, self.run))
            return writes(reference, self.run)

        def free(self) -> None:
            Bound.freed += 1

    return Bound


def as_written(reference, run):
    act = element_type(SHAPE.dtype)
    return {name: act.round(ref) for name, ref in reference.items()}, []


@pytest.fixture
def params():
    return OP.params_from_dict({"threads": 64, "vector": 16})


def test_a_kernel_that_writes_the_reference_passes_at_every_gate_size_and_the_host_time_is_counted(
        monkeypatch, params):
    bound = standing_in(as_written)
    monkeypatch.setattr(measure, "Bound", bound)
    result = measure.gate(OP, SHAPE, params, None, {"m": 4096}, np.random.default_rng(0), Stream())
    assert result.passed, result.reason
    assert list(result.errors) == [f"m={r['m']}" for r in OP.gate_runs(SHAPE, {"m": 4096}, params)]
    assert result.host_s > 0 and bound.freed == len(result.errors)


def test_a_nan_in_the_output_fails_the_gate_at_the_first_size_it_appears(monkeypatch, params):
    def nan_from_37_rows(reference, run):
        outputs, _ = as_written(reference, run)
        if run["m"] >= 37:
            outputs["y"][-1, -1] = 0x7FC0  # a bf16 NaN
        return outputs, []

    monkeypatch.setattr(measure, "Bound", standing_in(nan_from_37_rows))
    result = measure.gate(OP, SHAPE, params, None, {"m": 4096}, np.random.default_rng(0), Stream())
    assert not result.passed and "m': 37" in result.reason and "NaN" in result.reason
    assert list(result.errors) == ["m=1", "m=37"] and result.errors["m=37"] == float("inf") and result.host_s > 0


def test_a_written_fence_fails_the_gate(monkeypatch, params):
    def fence_hit(reference, run):
        return as_written(reference, run)[0], ["wrote 2 elements outside y"]

    monkeypatch.setattr(measure, "Bound", standing_in(fence_hit))
    result = measure.gate(OP, SHAPE, params, None, {"m": 4096}, np.random.default_rng(0), Stream())
    assert not result.passed and "wrote 2 elements outside y" in result.reason and result.worst_error == float("inf")


def test_cases_drawn_ahead_are_fresh_for_every_check_and_fixed_by_the_seed():
    def drawn(seed):
        cases = measure.GateCases(OP, SHAPE, np.random.default_rng(seed), ahead=True)
        try:
            return [cases.take({"m": m}) for m in (37, 37, 300, 37, 300)]
        finally:
            cases.close()

    first, again, other = drawn(5), drawn(5), drawn(6)
    xs = [inputs["x"].tobytes() for inputs, _ in first]
    assert len(set(xs)) == len(xs)  # no case is handed out twice
    for (inputs, reference), (inputs_again, _), (inputs_other, _) in zip(first, again, other):
        np.testing.assert_array_equal(inputs["x"], inputs_again["x"])
        assert not np.array_equal(inputs["x"], inputs_other["x"])
        expected = OP.reference(SHAPE, inputs, OP.scalars(SHAPE, {"m": len(inputs["x"])}))
        np.testing.assert_array_equal(reference["y"], expected["y"])  # the reference of these very inputs


def test_the_gate_takes_its_cases_from_the_cases_given(monkeypatch, params):
    taken = []

    class Counted(measure.GateCases):
        def take(self, run):
            taken.append(run["m"])
            return super().take(run)

    monkeypatch.setattr(measure, "Bound", standing_in(as_written))
    cases = Counted(OP, SHAPE, np.random.default_rng(0), ahead=True)
    try:
        for _ in range(2):
            assert measure.gate(OP, SHAPE, params, None, {"m": 4096}, None, Stream(), cases).passed
    finally:
        cases.close()
    assert taken == 2 * [r["m"] for r in OP.gate_runs(SHAPE, {"m": 4096}, params)]


def test_a_large_float64_product_goes_to_the_installed_one_and_a_small_one_to_numpy(monkeypatch):
    from mage_gen.ops import base

    taken = []
    monkeypatch.setattr(base, "_large_products", [])
    monkeypatch.setattr(base, "LARGE_PRODUCT_FLOPS", 2 * 4 * 5 * 6)
    a, b = np.arange(20.0).reshape(4, 5), np.arange(30.0).reshape(5, 6)
    assert np.array_equal(base.product64(a, b), a @ b)  # nothing installed: numpy, however large
    base.use_product64(lambda x, y: taken.append((x.shape, y.shape)) or x @ y)
    assert np.array_equal(base.product64(a[:3], b), a[:3] @ b) and taken == []  # below the size
    assert np.array_equal(base.product64(a, b), a @ b) and taken == [((4, 5), (5, 6))]


def test_stored_operands_are_widened_where_the_product_is_taken_numpy_or_torch_alike():
    """A reference's operands in their storage, a padded buffer's rows and a transposed view among them: numpy
    widens them on the host, the installed product (torch's, on the GPU in a bench) from their bits."""
    torch = pytest.importorskip("torch")
    from mage_gen.dtypes import BFLOAT16, E4M3, FLOAT16
    from mage_gen.measure import float64_tensor
    from mage_gen.ops.base import Stored, product64

    rng = np.random.default_rng(7)
    codes = rng.integers(0, 256, (6, 9), dtype=np.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0x38  # e4m3's NaN codes: 1.0 instead
    held = {BFLOAT16: BFLOAT16.round(rng.standard_normal((6, 9)).astype(np.float32)), E4M3: codes,
            FLOAT16: rng.standard_normal((6, 9)).astype(np.float16)}
    for dtype, values in held.items():
        a, b = Stored(values[:5, :7], dtype), Stored(values[:, :7], dtype).T  # (5, 7) and (7, 6), neither contiguous
        want = dtype.widen(values[:5, :7]).astype(np.float64) @ dtype.widen(values[:, :7]).astype(np.float64).T
        assert np.array_equal(product64(a, b), want), dtype.name
        on_torch = (float64_tensor(a, "cpu") @ float64_tensor(b, "cpu")).numpy()
        assert on_torch.dtype == np.float64 and np.array_equal(on_torch, want), dtype.name
    assert float64_tensor(np.eye(2), "cpu").dtype == torch.float64


def test_a_subject_is_timed_holding_the_lock_a_reference_on_the_gpu_waits_for(monkeypatch):
    """A gate's reference drawn ahead on another thread must not run on the GPU while a sample is taken."""
    from mage_gen.peers import TorchSubject

    for subject_type in (measure.KernelSubject, TorchSubject):
        monkeypatch.setattr(subject_type, "_hot", lambda self, replays, launches: [measure.timing_lock.locked()])
        monkeypatch.setattr(subject_type, "_cold", lambda self, count: [measure.timing_lock.locked()])
        subject = subject_type.__new__(subject_type)
        assert subject.hot(1) == [True] and subject.cold(1) == [True]
        assert not measure.timing_lock.locked()


def test_outputs_compared_in_blocks_on_every_core_agree_with_numpy_and_name_the_first_nan(monkeypatch):
    from concurrent.futures import ThreadPoolExecutor

    from mage_gen import verdict
    from mage_gen.dtypes import BFLOAT16
    from mage_gen.ops import base

    rng = np.random.default_rng(4)
    ref = rng.standard_normal((700, 4000))  # several blocks of rows
    out = BFLOAT16.round(ref)
    whole = np.linalg.norm(BFLOAT16.widen(out).astype(np.float64) - ref) / np.linalg.norm(ref)
    assert verdict.relative_error(out, ref) == pytest.approx(whole, rel=1e-12)
    widened = BFLOAT16.widen(out)
    widened[650, 9] = widened[651, 0] = np.nan  # in the last block only
    assert verdict.compare_outputs(get_op("layernorm"), get_op("layernorm").shape(d=4000), {"y": widened},
                                   {"y": ref}) == (float("inf"), "y has 2 NaN (first at (650, 9)): unwritten or "
                                                                 "computed NaN")
    many = verdict.relative_error(out, ref)
    monkeypatch.setattr(base, "_threads", [ThreadPoolExecutor(1)])
    assert verdict.relative_error(out, ref) == many  # the same bits, however many threads
