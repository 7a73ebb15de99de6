"""Gating a variant on the GPU (shared by the GPU tests): one given config, or one drawn by hypothesis from a row
norm's full space at a drawn row length and row count; and a small Hopper GEMM config drawn at a drawn shape, gated
on the interpreter (the CPU tests of gemm_sm90)."""

import random

import numpy as np
from hypothesis import reject
from hypothesis import strategies as st

from mage_gen import gpu, interp
from mage_gen.ops import get_op
from mage_gen.space import load_space
from mage_gen.measure import gate
from mage_gen.space import draw
from mage_gen.variants import build


def gate_on_gpu(op, device, stream, shape, params, run: dict | None = None, seed: int = 0, cases=None):
    """The gate's result for one config, its kernel loaded with the dynamic shared memory it asks for; its cases
    drawn on the host from the seed, or taken from `cases` (measure.GateCases or DeviceCases) where given."""
    run = run or {}
    variant = build(op, shape, params, device.arch)
    launch = op.geometry(shape, params, run)
    kernel = gpu.Kernel(variant.compiled.cubin, variant.source.kernel_name, launch.dynamic_shared_bytes)
    try:
        return gate(op, shape, params, kernel, run, np.random.default_rng(seed), stream, cases)
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


def gate_a_drawn_gemm_on_the_interpreter(data, k, **narrowed) -> None:
    """A gemm_sm90 config drawn from the full space, narrowed to small tiles (and `narrowed`), at M and N in 1..200
    and K drawn from `k`, passes the interpreter's gate."""
    op = get_op("gemm_sm90")
    dims = st.integers(1, 200)
    shape = op.shape(m=data.draw(dims, label="m"), n=data.draw(dims, label="n"), k=data.draw(k, label="k"),
                     c_dtype=data.draw(st.sampled_from(["bf16", "fp32"]), label="c_dtype"),
                     b_layout=data.draw(st.sampled_from(["nk", "kn"]), label="b_layout"))
    space = load_space(op, "full", shape).narrowed(bm=(64, 128), bn=(64, 128), cluster=(1,), multicast=("b",),
                                                   grid=(0, 2, 3), **narrowed)
    params = draw(op, shape, space, random.Random(data.draw(st.integers(0, 2**32 - 1), label="params seed")))
    if params is None:
        reject()
    result = interp.gate(op, shape, build(op, shape, params, "sm_90"), {}, np.random.default_rng(0))
    assert result.passed, f"{params.label()} at {shape}: {result.reason}"
