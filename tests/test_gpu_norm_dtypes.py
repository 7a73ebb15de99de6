"""On the GPU: bf16/fp16 norms and their fused residual form pass the gate (y and residual_out), their peers
pass the same gate, and mage_gen.torch serves them: x + residual bit for bit as torch computes it, y within
the gate's tolerance of float64, inside torch.compile(fullgraph=True). Skipped without a CUDA driver."""

import warnings

import pytest

from mage_gen.dtypes import dtype
from mage_gen.measure import Bench
from mage_gen.ops import get_op
from mage_gen.variants import build

pytestmark = pytest.mark.gpu
LN, RMS = get_op("layernorm"), get_op("rmsnorm")

CASES = [
    (LN, dict(d=768, dtype="bf16"), {"threads": 96, "vector": 16}),
    (LN, dict(d=4096, dtype="bf16", residual=True), {"threads": 256, "vector": 16}),
    (RMS, dict(d=4096, dtype="fp16", weight_dtype="fp32", residual=True), {"threads": 256, "vector": 16, "grid_cap": 528}),
    (RMS, dict(d=1002, dtype="bf16", residual=True), {"template": "multirow", "threads": 64, "vector": 8,
                                                      "rows_per_block": 2}),
    (LN, dict(d=8192, residual=True), {"threads": 512, "vector": 16}),
    # statistics about the row's first element: one reduction; peeled, persistent rows with the residual too
    (LN, dict(d=8192, dtype="bf16"), {"threads": 256, "vector": 16, "stats": "shifted", "min_blocks": 4}),
    (LN, dict(d=1002, dtype="fp16", residual=True), {"template": "multirow", "threads": 128, "vector": 8,
                                                     "rows_per_block": 2, "stats": "shifted", "grid_cap": 528}),
    # each block asks L2 for a later block's rows (1 KB on: the next few blocks, past the end at the last ones)
    (RMS, dict(d=8192, dtype="bf16"), {"threads": 512, "vector": 16, "min_blocks": 4, "l2_ahead": 2048}),
    (LN, dict(d=768, dtype="bf16", residual=True), {"template": "multirow", "threads": 32, "vector": 16,
                                                    "rows_per_block": 2, "l2_ahead": 1}),
    # ... and keeps them at evict-last priority until read
    (RMS, dict(d=4096, dtype="bf16", residual=True), {"threads": 256, "vector": 16, "l2_ahead": 1024,
                                                      "ahead_priority": "last"}),
    (LN, dict(d=8192, dtype="bf16"), {"threads": 128, "vector": 16, "min_blocks": 4, "l2_ahead": 2048,
                                      "ahead_priority": "last"}),
    # the weights asked of L2 by the launch's first block; template wide asking for later blocks' rows
    (LN, dict(d=8192, dtype="bf16"), {"threads": 128, "vector": 16, "min_blocks": 5, "l2_ahead": 1024, "weights": "l2"}),
    (RMS, dict(d=768, dtype="bf16", residual=True), {"template": "multirow", "threads": 32, "vector": 16,
                                                     "rows_per_block": 2, "hold": "packed", "grid_cap": 528,
                                                     "weights": "l2"}),
    (LN, dict(d=8192, dtype="bf16", residual=True), {"template": "wide", "threads": 256, "vector": 16,
                                                     "hint": "keep_unreleased", "stats": "shifted", "l2_ahead": 2048}),
    (RMS, dict(d=4096, dtype="bf16", residual=True), {"template": "wide", "threads": 512, "vector": 16,
                                                      "hint": "keep_unreleased", "min_blocks": 4, "weights": "l2"}),
    # L1 eviction priorities on the two passes and w
    (RMS, dict(d=8192, dtype="bf16"), {"template": "wide", "threads": 256, "vector": 16, "hint": "keep_unreleased",
                                       "min_blocks": 4, "weights": "l2", "l1": "last_first"}),
    (RMS, dict(d=4096, dtype="bf16", residual=True), {"template": "wide", "threads": 512, "vector": 16,
                                                      "hint": "keep_unreleased", "min_blocks": 4, "l1": "first"}),
    # rows too wide for registers, at few rows: the gate's float64 reference is computed on the host
    (LN, dict(d=131074, dtype="bf16", residual=True), {"template": "wide", "threads": 512, "vector": 16, "m": 37}),
    (RMS, dict(d=100002, dtype="fp16", weight_dtype="fp32"), {"template": "wide", "threads": 1024, "vector": 8,
                                                              "m": 37}),
]


@pytest.mark.parametrize("op, dims, values", CASES, ids=lambda c: str(c) if isinstance(c, dict) else None)
def test_16_bit_and_residual_variants_and_their_peers_pass_the_gate(device, op, dims, values):
    pytest.importorskip("torch")
    from mage_gen.peers import TRITON_ROW_BYTES, make_peers

    values = dict(values)
    shape, run = op.shape(**dims), {"m": values.pop("m", 4097)}
    bench = Bench(op, shape, run, seed=5)
    evaluation = bench.evaluate(build(op, shape, op.params_from_dict(values), device.arch))
    assert evaluation.gate.passed, evaluation.gate.reason
    assert evaluation.hot and evaluation.cold
    peers, missing = make_peers(op, shape, run, bench.timing_inputs(), None, check=bench.check_tensor)
    # one Triton program holds a row of at most TRITON_ROW_BYTES (its block a power of two): wider rows have none
    block_bytes = (1 << (shape.d - 1).bit_length()) * dtype(shape.dtype).itemsize
    if block_bytes <= TRITON_ROW_BYTES:
        assert {p.name for p in peers} >= {"torch", "triton"}, missing
    else:
        assert {p.name for p in peers} >= {"torch"} and "more than the 65536 bytes" in missing["triton"], missing


def test_the_runtime_serves_bf16_with_a_residual(device):
    torch = pytest.importorskip("torch")
    import mage_gen.torch as mt

    g = torch.Generator(device="cuda").manual_seed(0)
    x = (torch.randn(37, 1536, device="cuda", generator=g) * 2 + 1).bfloat16()
    r = torch.randn(37, 1536, device="cuda", generator=g).bfloat16()
    w, b = torch.randn(1536, device="cuda", generator=g), torch.randn(1536, device="cuda", generator=g)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # an untuned shape runs a default config, and says so
        y, h = mt.layer_norm(x, w, b, residual=r)
        y_rms, h_rms = mt.rms_norm(x, w.bfloat16(), residual=r)
    assert torch.equal(h, x + r) and torch.equal(h_rms, x + r)
    ref = torch.nn.functional.layer_norm(h.double(), (1536,), w.double(), b.double(), 1e-5)
    assert y.dtype == torch.bfloat16
    assert float((y.double() - ref).norm() / ref.norm()) <= 2 * 2**-8 + 1e-5
    ref_rms = torch.nn.functional.rms_norm(h.double(), (1536,), w.bfloat16().double(), 1e-6)
    assert float((y_rms.double() - ref_rms).norm() / ref_rms.norm()) <= 2 * 2**-8 + 1e-5

    compiled = torch.compile(lambda x, r: mt.rms_norm(x, w.bfloat16(), residual=r), fullgraph=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        y_c, h_c = compiled(x, r)
    assert torch.equal(h_c, h_rms) and torch.equal(y_c, y_rms)
