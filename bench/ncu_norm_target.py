"""The program bench/ncu_norm.sh profiles: a bf16 norm at 16384×8192 launched a few times, either a mage-gen
config (params as JSON, launched through mage_gen.torch with that config in place of the tuned one) or the
Triton peer of mage_gen.peers at a num_warps; for the Triton kernel it also prints its registers and spills.
The config "tuned" launches the stored winner; NORM_M and NORM_D set another size.

    python bench/ncu_norm_target.py ours layernorm '{"template": "row", "threads": 256, "vector": 16}'
    python bench/ncu_norm_target.py triton layernorm 8
"""
import json
import os
import sys

import torch

import mage_gen.runtime as rt
import mage_gen.torch as mt
from mage_gen.ops import get_op
from mage_gen.peers import triton_layernorm, triton_rmsnorm

M, D = int(os.environ.get("NORM_M", "16384")), int(os.environ.get("NORM_D", "8192"))
kind, opname, cfg = sys.argv[1:4]
x = torch.randn(M, D, device="cuda", dtype=torch.bfloat16)
w = torch.randn(D, device="cuda", dtype=torch.bfloat16)
b = torch.randn_like(w)
y = torch.empty_like(x)
if kind == "triton":
    warps = int(cfg)
    for _ in range(5):
        if opname == "layernorm":
            k = triton_layernorm[(M,)](x, y, w, b, D, 1e-5, x, x, BLOCK=D, RESIDUAL=False, num_warps=warps)
        else:
            k = triton_rmsnorm[(M,)](x, y, w, D, 1e-6, x, x, BLOCK=D, RESIDUAL=False, num_warps=warps)
    torch.cuda.synchronize()
    print("triton", opname, warps, "regs", getattr(k, "n_regs", None), "spills", getattr(k, "n_spills", None))
    print(k.asm["ptx"].count("ld.global"), "ld.global;", k.asm["ptx"].count("bar.sync"), "bar.sync")
else:
    if cfg != "tuned":
        params = get_op(opname).params_from_dict(json.loads(cfg))
        rt.choose = lambda *a, **k: params  # this config, not the tuned entry
    for _ in range(5):
        out = mt.layer_norm(x, w, b) if opname == "layernorm" else mt.rms_norm(x, w)
    torch.cuda.synchronize()
    print("ours", opname, cfg)
