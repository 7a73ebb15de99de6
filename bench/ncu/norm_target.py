"""The program bench/ncu/norm.sh profiles: a bf16 norm at 16384×8192 launched a few times, either a mage-gen
config (params as JSON, built and launched as mage_gen.runtime launches a tuned kernel: a runtime.Prepared of
it on torch's current stream) or the Triton peer of mage_gen.peers at a num_warps; for the Triton kernel it also
prints its registers and spills. The config "tuned" launches the stored winner through mage_gen.torch; NORM_M and
NORM_D set another size.

    python -m bench.ncu.norm_target ours layernorm '{"template": "row", "threads": 256, "vector": 16}'
    python -m bench.ncu.norm_target ours rmsnorm tuned
    python -m bench.ncu.norm_target triton layernorm 8
"""
import json
import os
import sys

import torch

import mage_gen.torch as mt
from mage_gen import gpu
from mage_gen.ops import get_op
from mage_gen.peers import triton_layernorm, triton_rmsnorm
from mage_gen.variants import build

from bench._common import prepared

M, D = int(os.environ.get("NORM_M", "16384")), int(os.environ.get("NORM_D", "8192"))
EPS = {"layernorm": 1e-5, "rmsnorm": 1e-6}
kind, opname, cfg = sys.argv[1:4]
x = torch.randn(M, D, device="cuda", dtype=torch.bfloat16)
w = torch.randn(D, device="cuda", dtype=torch.bfloat16)
b = torch.randn_like(w)
y = torch.empty_like(x)
if kind == "triton":
    warps = int(cfg)
    for _ in range(5):
        if opname == "layernorm":
            k = triton_layernorm[(M,)](x, y, w, b, D, EPS[opname], x, x, BLOCK=D, RESIDUAL=False, num_warps=warps)
        else:
            k = triton_rmsnorm[(M,)](x, y, w, D, EPS[opname], x, x, BLOCK=D, RESIDUAL=False, num_warps=warps)
    torch.cuda.synchronize()
    print("triton", opname, warps, "regs", getattr(k, "n_regs", None), "spills", getattr(k, "n_spills", None))
    print(k.asm["ptx"].count("ld.global"), "ld.global;", k.asm["ptx"].count("bar.sync"), "bar.sync")
elif cfg == "tuned":
    for _ in range(5):
        out = mt.layer_norm(x, w, b) if opname == "layernorm" else mt.rms_norm(x, w)
    torch.cuda.synchronize()
    print("ours", opname, cfg)
else:  # this config, not the tuned entry: built and launched as the runtime launches the tuned one
    device = gpu.open_device()
    op = get_op(opname)
    shape, run = op.shape(d=D, dtype="bf16"), {"m": M}
    variant = build(op, shape, op.params_from_dict(json.loads(cfg)), device.arch)
    launch = prepared(op, shape, variant, run)
    values = {"y": y.data_ptr(), "x": x.data_ptr(), "w": w.data_ptr(), "b": b.data_ptr(), "M": M, "eps": EPS[opname]}
    for _ in range(5):
        launch.launch([values[name] for name in launch.arg_names], torch.cuda.current_stream().cuda_stream)
    torch.cuda.synchronize()
    print("ours", opname, variant.source.kernel_name, cfg)
