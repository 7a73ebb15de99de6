"""RMSNorm, fp32, row-major M×d: y = x·rstd·w with rstd = 1/sqrt(mean(x²) + eps).

The layer norm's family with its statistic changed: the same templates (NORM 'rms': no mean, no bias), the
same params, rules and launch geometry, except that there is one statistic (the mean of squares), so
`stats` has only its first value and a row needs one row-wide sum, not two.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from mage_gen.errors import ConfigError
from mage_gen.ops.base import Arg, Launch
from mage_gen.ops.layernorm import LayerNorm, Params, Shape


class RMSNorm(LayerNorm):
    name = "rmsnorm"
    norm = "rms"
    args = (Arg("y", "out"), Arg("x", "in"), Arg("w", "in"), Arg("M", "i32"), Arg("eps", "f32"))
    eps = 1e-6  # torch.nn.RMSNorm's default is the dtype's epsilon; 1e-6 is what most models pass

    def validate(self, shape: Shape, p: Params) -> None:
        if p.stats != "two_pass":
            raise ConfigError(f"stats: rmsnorm has one statistic, the mean of squares; leave stats at two_pass, "
                              f"got {p.stats!r}")
        super().validate(shape, p)

    def kernel_name(self, shape: Shape, p: Params) -> str:
        return "rmsnorm" + super().kernel_name(shape, p).removeprefix("layernorm")

    def geometry(self, shape: Shape, p: Params, run: dict[str, int]) -> Launch:
        launch = super().geometry(shape, p, run)
        warps = p.threads // 32
        if p.template == "wide" and warps > 1:  # one sum per warp, not a layer norm's three statistics
            return Launch(grid=launch.grid, block=launch.block, dynamic_shared_bytes=0,
                          static_shared_bytes=warps * 4)
        return launch

    def make_inputs(self, shape: Shape, run: dict[str, int], rng: np.random.Generator) -> dict[str, np.ndarray]:
        inputs = super().make_inputs(shape, run, rng)
        del inputs["b"]
        return inputs

    def reference(self, shape: Shape, inputs: dict[str, np.ndarray], scalars: dict[str, int | float]) -> dict[str, np.ndarray]:
        y = inputs["x"].astype(np.float64)
        mean_square = np.einsum("ij,ij->i", y, y)[:, None] / shape.d
        y *= 1.0 / np.sqrt(mean_square + float(scalars["eps"]))
        y *= inputs["w"].astype(np.float64)
        return {"y": y}

    def contract(self, shape: Shape, p: Params) -> dict[str, Any]:
        doc = super().contract(shape, p)
        del doc["tensors"]["b"]
        doc["aliasing"] = "y must not overlap x or w (no in-place use): every pointer is declared __restrict__"
        doc["scalars"]["eps"] = {"meaning": "added to the mean of squares before the square root",
                                 "default": self.eps}
        return doc


OP = RMSNorm()
