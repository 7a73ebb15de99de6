"""The eager norm the torch and Inductor peers run, on the CPU: what it computes and where it writes."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from mage_gen.peers import eager_norm, eager_norm_into  # noqa: E402

EPS = 1e-5


def reference(torch_fn: str, h: np.ndarray, weights: list[np.ndarray]) -> np.ndarray:
    if torch_fn == "F.rms_norm":
        return h / np.sqrt((h * h).mean(-1, keepdims=True) + EPS) * weights[0]
    centred = h - h.mean(-1, keepdims=True)
    return centred / np.sqrt((centred * centred).mean(-1, keepdims=True) + EPS) * weights[0] + weights[1]


@pytest.mark.parametrize("torch_fn", ["F.rms_norm", "F.layer_norm"])
@pytest.mark.parametrize("residual", [False, True])
def test_the_eager_norm_writes_the_norm_of_x_plus_residual_and_the_sum_into_the_outputs_given(torch_fn, residual):
    generator = torch.Generator().manual_seed(7)
    m, d = 5, 24
    x, r = (torch.randn(m, d, generator=generator, dtype=torch.float64) for _ in range(2))
    weights = [torch.randn(d, generator=generator, dtype=torch.float64)
               for _ in range(2 if torch_fn == "F.layer_norm" else 1)]
    y_out, r_out = (torch.full((m, d), float("nan"), dtype=torch.float64) for _ in range(2))
    got = eager_norm_into(eager_norm(torch_fn, d, EPS))(x, r if residual else None, y_out,
                                                         r_out if residual else None, *weights)
    h = (x + r if residual else x).numpy()
    np.testing.assert_allclose(y_out.numpy(), reference(torch_fn, h, [t.numpy() for t in weights]), rtol=1e-12,
                               atol=1e-12)
    if residual:
        assert got[0] is y_out and got[1] is r_out
        np.testing.assert_array_equal(r_out.numpy(), h)
    else:
        assert got is y_out and torch.isnan(r_out).all()
