"""On the GPU: the tensor-core kernels of test_tensor_core.py give the hardware's answer, and the CPU
interpreter the same one: the fragment layouts it implements are the hardware's. Skipped without a CUDA
driver."""

import numpy as np
import pytest

from mage_gen import gpu, interp
from mage_gen.compile import compile_source
from mage_gen.dtypes import BFLOAT16
from mage_gen.render import Source, environment

from test_tensor_core import FRAGMENTS, LDMATRIX, ROUND, a16_words, b16_words, scatter_accumulator, tf32_a_words, tf32_b_words

pytestmark = pytest.mark.gpu


def both(template: str, name: str, grid: int, block: int, arrays: list, scalars: list, out: int, arch: str,
         **context) -> tuple[np.ndarray, np.ndarray]:
    """(the GPU's, the interpreter's) arrays[out] after one launch of the template's kernel."""
    text = environment().from_string(template).render(**context)
    source = Source(text=text, kernel_name=name, template="test", template_hash="-", params=None)
    compiled = compile_source(source, arch)
    buffers = [gpu.Buffer(a.nbytes) for a in arrays]
    try:
        for buf, array in zip(buffers, arrays):
            buf.upload(array)
        kernel = gpu.Kernel(compiled.cubin, name)
        args = gpu.KernelArgs([("ptr", b.ptr) for b in buffers] + [("i32", v) for v in scalars])
        stream = gpu.Stream()
        kernel.launch((grid, 1, 1), (block, 1, 1), 0, args, stream.handle)
        stream.synchronize()
        on_gpu = buffers[out].download(arrays[out].dtype)
    finally:
        for buf in buffers:
            buf.free()
    on_cpu = [a.copy() for a in arrays]
    interp.run(compile_source(source).ptx, name, (grid,), (block,), 0, on_cpu + scalars)
    return on_gpu, on_cpu[out]


@pytest.mark.parametrize("dtype", ["bf16", "tf32"])
def test_mma_fragments_agree_with_the_interpreter(device, dtype):
    rng = np.random.default_rng(3)
    if dtype == "bf16":
        a_words = a16_words(BFLOAT16.round(rng.standard_normal((16, 16))))
        b_words = b16_words(BFLOAT16.round(rng.standard_normal((16, 8))))
    else:
        a_words = tf32_a_words(rng.standard_normal((16, 8)).astype(np.float32))
        b_words = tf32_b_words(rng.standard_normal((8, 8)).astype(np.float32))
    c = scatter_accumulator(rng.standard_normal((16, 8)).astype(np.float32))
    arrays = [np.full(128, np.nan, np.float32), a_words.ravel().copy(), b_words.ravel().copy(), c.ravel().copy()]
    on_gpu, on_cpu = both(FRAGMENTS, "fragments", 1, 32, arrays, [], 0, device.arch, DTYPE=dtype,
                          A_ORDER=(0, 1, 2, 3))
    assert np.allclose(on_gpu, on_cpu, rtol=1e-5, atol=1e-5), np.abs(on_gpu - on_cpu).max()


def test_ldmatrix_and_mma_agree_with_the_interpreter(device):
    rng = np.random.default_rng(4)
    a_bits, b_bits = BFLOAT16.round(rng.standard_normal((16, 16))), BFLOAT16.round(rng.standard_normal((16, 8)))
    arrays = [np.full(128, np.nan, np.float32), a_bits.ravel().view(np.uint32).copy(),
              b_bits.ravel().view(np.uint32).copy()]
    on_gpu, on_cpu = both(LDMATRIX, "through_shared", 1, 32, arrays, [], 0, device.arch)
    assert np.allclose(on_gpu, on_cpu, rtol=1e-5, atol=1e-5), np.abs(on_gpu - on_cpu).max()


@pytest.mark.parametrize("rounding", ["rna", "rn"])
def test_cvt_tf32_agrees_bit_for_bit(device, rounding):
    # random values, and ties of both parities, where rna and rn part
    ties = (np.float32(1.0) + np.arange(1, 64, 2, dtype=np.float32) * np.float32(2.0**-11)).astype(np.float32)
    values = np.concatenate([np.random.default_rng(5).standard_normal(4096 - 64).astype(np.float32) * np.float32(100),
                             ties, -ties])
    arrays = [np.zeros(4096, np.uint32), values]
    on_gpu, on_cpu = both(ROUND, "to_tf32", 16, 256, arrays, [4096], 0, device.arch, ROUNDING=rounding)
    assert np.array_equal(on_gpu, on_cpu)
