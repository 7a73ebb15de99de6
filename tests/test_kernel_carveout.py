"""A kernel loaded with a preferred shared-memory carveout: the driver is asked for it, and a carveout that is not a
percentage is refused before anything is loaded. The GPU test is skipped without a CUDA driver."""

import dataclasses

import numpy as np
import pytest

from mage_gen import gpu
from mage_gen.ops import get_op
from mage_gen.variants import build


@pytest.mark.parametrize("carveout", [-1, 101])
def test_a_carveout_outside_0_to_100_percent_is_refused_before_the_cubin_is_loaded(carveout):
    with pytest.raises(ValueError, match="a percentage from 0 to 100"):
        gpu.Kernel(b"not a cubin", "k", carveout=carveout)


@pytest.mark.gpu
@pytest.mark.parametrize("carveout", [None, 0, 100])
def test_a_variant_loads_with_its_carveout_and_still_passes_the_gate(device, carveout):
    from cuda.bindings import driver as cu

    from mage_gen.measure import Bench

    op = get_op("rmsnorm")
    shape = op.shape(d=4096, dtype="bf16")
    params = op.params_from_dict({"template": "wide", "threads": 256, "vector": 16, "hint": "keep_unreleased"})
    variant = dataclasses.replace(build(op, shape, params, device.arch), carveout=carveout)
    bench = Bench(op, shape, {"m": 1000}, seed=1)
    kernel = bench.load(variant)
    preferred = cu.cuFuncGetAttribute(cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT,
                                      kernel.function)[1]
    assert preferred == (-1 if carveout is None else carveout)
    subject, result = bench.checked_subject(variant, kernel)
    assert subject is not None, result.reason
    assert np.isfinite(result.worst_error)
    subject.close()
