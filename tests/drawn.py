"""Gating a variant on the GPU (shared by the GPU tests): one given config, or one drawn by hypothesis from a row
norm's full space at a drawn row length and row count."""

import random

import numpy as np
from hypothesis import reject
from hypothesis import strategies as st

from mage_gen import gpu
from mage_gen.measure import gate
from mage_gen.space import draw
from mage_gen.variants import build


def gate_on_gpu(op, device, stream, shape, params, run: dict | None = None, seed: int = 0):
    """The gate's result for one config, its kernel loaded with the dynamic shared memory it asks for."""
    run = run or {}
    variant = build(op, shape, params, device.arch)
    launch = op.geometry(shape, params, run)
    kernel = gpu.Kernel(variant.compiled.cubin, variant.source.kernel_name, launch.dynamic_shared_bytes)
    try:
        return gate(op, shape, params, kernel, run, np.random.default_rng(seed), stream)
    finally:
        kernel.unload()


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
