"""A variant drawn by hypothesis from an op's full space, at a drawn row length and row count, gated on the GPU
(shared by the GPU tests of the row-norm ops)."""

import random

import numpy as np
from hypothesis import reject
from hypothesis import strategies as st

from mage_gen import gpu
from mage_gen.measure import gate
from mage_gen.space import draw
from mage_gen.variants import build


def gate_a_drawn_variant(op, space, device, stream, data) -> tuple[str, int, object]:
    """(kernel name, rows, gate result) of one drawn variant."""
    d = data.draw(st.one_of(st.integers(1, 1024), st.integers(1, 16384)), label="d")
    shape = op.shape(d=d)
    params = draw(op, shape, space, random.Random(data.draw(st.integers(0, 2**32 - 1), label="params seed")))
    if params is None:
        reject()
    m = data.draw(st.integers(1, 5000), label="m")
    variant = build(op, shape, params, device.arch)
    kernel = gpu.Kernel(variant.compiled.cubin, variant.source.kernel_name)
    try:
        result = gate(op, shape, params, kernel, {"m": m}, np.random.default_rng(data.draw(st.integers(0, 2**32 - 1))),
                      stream)
    finally:
        kernel.unload()
    return variant.source.kernel_name, m, result
