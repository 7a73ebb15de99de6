"""Norms: mage_gen.torch serves the stored RMSNorm winners of a few classes (the kernel each dispatches to, printed
by name): y against a float64 reference of the same inputs by relative norm, and x + residual bit for bit as torch
rounds it. Its printout is the record:

    python bench/norms_runtime_check.py > bench/results/h200/runtime_serves_l1_winners.txt
"""
import torch

import mage_gen.runtime as rt
import mage_gen.torch as mt
from mage_gen import gpu
from mage_gen.ops import get_op

dev = gpu.open_device()
op = get_op("rmsnorm")
for m, d, res in ((16384, 8192, False), (32768, 4096, True), (4096, 8192, False), (4096, 768, True)):
    g = torch.Generator(device="cuda").manual_seed(m + d)
    x = torch.randn(m, d, device="cuda", dtype=torch.bfloat16, generator=g)
    w = torch.randn(d, device="cuda", dtype=torch.bfloat16, generator=g)
    r = torch.randn(m, d, device="cuda", dtype=torch.bfloat16, generator=g) if res else None
    shape = op.shape(d=d, dtype="bf16", residual=res)
    name = op.kernel_name(shape, rt.choose(op, shape, {"m": m}, dev, True))
    out = mt.rms_norm(x, w, 1e-6, residual=r)
    y, h = out if res else (out, None)
    hx = (x + r) if res else x
    ref = hx.double() * torch.rsqrt(hx.double().pow(2).mean(-1, keepdim=True) + 1e-6) * w.double()
    err = ((y.double() - ref).norm() / ref.norm()).item()
    same = bool(torch.equal(h, x + r)) if res else None
    print(f"rmsnorm{'+res' if res else ''} {m}x{d} {name}: y rel err {err:.2e}, r_out bit-exact {same}, "
          f"finite {bool(torch.isfinite(y).all())}")
