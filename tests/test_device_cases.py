"""Gate cases drawn by torch (mage_gen.device_cases) are what the op's numpy make_inputs and reference would give:
the same storage, layout, padding and ranges of values, and for those very inputs the same float64 reference. Run
here on torch's CPU device; on the GPU the same code runs on "cuda" (tests/test_gpu_gemm_sm90.py)."""

import numpy as np
import pytest

from mage_gen.ops import get_op

torch = pytest.importorskip("torch")
from mage_gen.device_cases import gemm_sm90_case  # noqa: E402  (needs torch)

OP = get_op("gemm_sm90")


def host_arrays(inputs: dict, reference: dict) -> tuple[dict, dict]:
    """The torch tensors as the host's arrays of make_inputs and reference (the same bytes, the op's storage)."""
    host = {name: t.numpy() for name, t in inputs.items()}
    return host, {name: t.numpy() for name, t in reference.items()}


@pytest.mark.parametrize("fields", [
    {"m": 33, "n": 72, "k": 203},
    {"m": 17, "n": 43, "k": 136, "b_layout": "kn"},
    {"m": 9, "n": 64, "k": 300, "precision": "e4m3"},
    {"m": 9, "n": 130, "k": 300, "precision": "e4m3_block"},
    {"m": 20, "n": 48, "k": 64, "bias": True, "residual": True},
    {"m": 20, "n": 48, "k": 64, "gate": "silu", "c_dtype": "fp32", "bias": True},
])
def test_a_case_drawn_by_torch_is_laid_out_as_make_inputs_and_its_reference_is_the_ops(fields):
    shape = OP.shape(**fields)
    drawn, reference = gemm_sm90_case(shape, {}, seed=5, device="cpu")
    host = OP.make_inputs(shape, {}, np.random.default_rng(5))
    inputs, ref = host_arrays(drawn, reference)
    assert set(inputs) == set(host)
    for name, array in host.items():
        got = inputs[name]
        assert got.shape == array.shape and got.dtype.itemsize == array.dtype.itemsize, name
        if array.ndim == 2 and array.shape[1] > (cols := {"A": shape.k, "B": shape.k if shape.b_layout == "nk"
                                                          else shape.n}.get(name, array.shape[1])):
            # the padding past K (or N) is the element type's NaN, as on the host
            assert (got[:, cols:].view(array.dtype) == array[:, cols:]).all(), name
    element = shape.element
    for name in ("A", "B"):
        cols = shape.k if name == "A" or shape.b_layout == "nk" else shape.n
        values = element.widen(inputs[name][:, :cols].view(element.storage))
        assert np.isfinite(values).all(), name
        spread = 8.0 if shape.precision == "e4m3" else 1.0
        assert 0.8 * spread < values.std() < 1.2 * spread, name
    for name in ("scale_a", "scale_b"):
        if name in host:
            assert inputs[name].dtype == np.float32 and (inputs[name] >= 0.5).all() and (inputs[name] < 2).all()
    # the op's own reference of these very inputs, on the host
    typed = {name: inputs[name].view(host[name].dtype) for name in host}
    expected = OP.reference(shape, typed, OP.scalars(shape, {}))["C"]
    assert ref["C"].dtype == np.float64 and ref["C"].shape == expected.shape == (shape.m, shape.c_cols)
    assert np.allclose(ref["C"], expected, rtol=1e-12, atol=1e-12 * np.abs(expected).max())


def test_a_seed_fixes_the_case_and_another_seed_draws_another():
    shape = OP.shape(m=16, n=64, k=128)
    first, again, other = (gemm_sm90_case(shape, {}, seed, "cpu")[0]["B"] for seed in (1, 1, 2))
    assert torch.equal(first, again) and not torch.equal(first, other)


def test_the_gate_draws_on_the_gpu_where_the_op_can_and_torch_sees_one_unless_told_not_to(monkeypatch):
    from mage_gen import measure

    rng = np.random.default_rng(0)
    shape = OP.shape(m=16, n=64, k=128)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert isinstance(measure.gate_cases(OP, shape, rng), measure.GateCases)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert isinstance(measure.gate_cases(OP, shape, rng), measure.DeviceCases)
    norm = get_op("rmsnorm")  # no device_case: drawn on the host
    assert isinstance(measure.gate_cases(norm, norm.shape(d=64), rng), measure.GateCases)
    monkeypatch.setenv(measure.HOST_CASES_ENV, "1")
    assert isinstance(measure.gate_cases(OP, shape, rng), measure.GateCases)


@pytest.mark.parametrize("fields, values", [
    ({"m": 65, "n": 72, "k": 136, "precision": "e4m3"}, {}),
    ({"m": 33, "n": 80, "k": 73, "bias": True, "residual": True, "gate": "silu"}, {}),
])
def test_the_kernel_on_the_interpreter_computes_a_torch_drawn_case_s_reference(fields, values):
    # the case's inputs as the kernel reads them (their padding, scales and epilogue terms), and its reference as
    # the gate on the GPU holds the kernel's output to
    from mage_gen import interp
    from mage_gen.variants import build
    from mage_gen.verdict import relative_error

    shape = OP.shape(**fields)
    drawn, reference = gemm_sm90_case(shape, {}, seed=3, device="cpu")
    host = OP.make_inputs(shape, {}, np.random.default_rng(3))
    inputs = {name: t.numpy().view(host[name].dtype) for name, t in drawn.items()}
    params = OP.params_from_dict({"bm": 64, "bn": 64, "consumers": 1, "stages": 2, "grid": 2, "producer_regs": 0,
                                  **values})
    out = interp.launch_with(OP, shape, build(OP, shape, params, "sm_90"), {}, inputs)["C"]
    err = relative_error(out, reference["C"].numpy())
    assert err <= OP.tolerance_of(shape, "C", OP.output_dtypes(shape)["C"]), err
