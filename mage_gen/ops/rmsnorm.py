"""RMSNorm, row-major M×d: y = x·rstd·w with rstd = 1/sqrt(mean(x²) + eps).

The layer norm's family with its statistic changed: the same templates (NORM 'rms': no mean, no bias), the
same params, rules and launch geometry, except that there is one statistic (the mean of squares), so
`stats` has only its first value and a row needs one row-wide sum, not two. Element types, the residual
form and the gate's tolerances are the layer norm's (mage_gen/ops/layernorm.py).
"""

from __future__ import annotations

import numpy as np

from mage_gen.ops.base import LazyFunction, Launch, Rule
from mage_gen.ops.layernorm import LayerNorm, Params, Shape, row_norm_rules


class RMSNorm(LayerNorm):
    name = "rmsnorm"
    norm = "rms"
    eps_meaning = "added to the mean of squares before the square root"
    eps = 1e-6  # torch.nn.RMSNorm's default is the dtype's epsilon; 1e-6 is what most models pass
    rules = (Rule("stats", lambda s, p: p.stats == "two_pass",
                  lambda s, p: "rmsnorm has one statistic, the mean of squares; leave stats at two_pass, got "
                               f"{p.stats!r}"),
             *row_norm_rules(norm))
    peer_builder = LazyFunction("mage_gen.peers", "row_norm_peers",
                                (("torch_fn", "F.rms_norm"), ("triton_kernel", "triton_rmsnorm")))
    torch_name = "mage_gen.torch.rms_norm"
    runtime_name = "mage_gen.runtime.rms_norm"

    def kernel_name(self, shape: Shape, p: Params) -> str:
        return "rmsnorm" + super().kernel_name(shape, p).removeprefix("layernorm")

    def geometry(self, shape: Shape, p: Params, run: dict[str, int]) -> Launch:
        launch = super().geometry(shape, p, run)
        warps = p.threads // 32
        if p.template == "wide" and warps > 1:  # one sum per warp, not a layer norm's three statistics
            return Launch(grid=launch.grid, block=launch.block, dynamic_shared_bytes=0,
                          static_shared_bytes=warps * 4)
        return launch

    def _normalize(self, shape: Shape, y: np.ndarray, weights: dict[str, np.ndarray], eps: float) -> None:
        mean_square = np.einsum("ij,ij->i", y, y)[:, None] / shape.d
        y *= 1.0 / np.sqrt(mean_square + eps)
        y *= weights["w"]


OP = RMSNorm()
