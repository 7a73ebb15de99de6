"""Norms: is the Triton peer's faster time after Inductor's set-up its compile, or the tensors it runs on?

At RMSNorm 4096×8192 Triton's kernel compiled after Inductor's set-up ran 33.8 µs hot, against 35.2 for the
same kernel compiled before (norms_peer_state_probe.json), and Inductor's own kernel also ran 34.0; cubins of
either assembler, loaded by hand, all ran 35.1–35.4 (norms_cubin_probe.json). Here tensors A are allocated
before Inductor compiles the eager RMSNorm and tensors B after it; the tuned winner (through mage_gen.torch),
Triton's kernel compiled before (T0) and after (T1) Inductor's set-up, and Inductor's kernel are timed on A and
on B, hot and cold, interleaved, beside the copy on each. Writes bench/results/<gpu>/norms_alloc_probe.json.

    python bench/norms_alloc_probe.py
"""
import json
import os
import sys

import torch

sys.path.insert(0, "bench")
from _common import write_result

import mage_gen.torch as mt
from mage_gen import gpu
from mage_gen.dtypes import dtype as element_type
from mage_gen.measure import interleave
from mage_gen.ops import get_op
from mage_gen.peers import TorchSubject, triton_rmsnorm

M, D, EPS, WARPS = 4096, 8192, 1e-6, 8


def tensors(seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(M, D, device="cuda", generator=g).to(torch.bfloat16)
    return x, torch.full_like(x, float("nan"))


def triton_compiled_now():
    """A fresh JIT function object: Triton compiles it at its first launch, under the settings then in force."""
    return type(triton_rmsnorm)(triton_rmsnorm.fn)


device = gpu.open_device()
op = get_op("rmsnorm")
tolerance = op.tolerance_of(op.shape(d=D, dtype="bf16"), "y", element_type("bf16"))
w = torch.randn(D, device="cuda").to(torch.bfloat16)
t0 = triton_compiled_now()
xa, ya = tensors(1)
t0[(M,)](xa, ya, w, D, EPS, xa, ya, BLOCK=D, RESIDUAL=False, num_warps=WARPS)  # compiled before Inductor's set-up
allocator_before = torch.cuda.memory.get_allocator_backend() if hasattr(torch.cuda.memory, "get_allocator_backend") else "?"
env_before = dict(os.environ)
compiled = torch.compile(lambda x, w: torch.nn.functional.rms_norm(x, (D,), w, EPS), dynamic=False, fullgraph=True)
compiled(xa, w)
torch.cuda.synchronize()
t1 = triton_compiled_now()
xb, yb = tensors(2)
runs = {}
for tag, x, y in (("A", xa, ya), ("B", xb, yb)):
    out = {name: torch.full_like(x, float("nan")) for name in ("ours", "T0", "T1", "copy")}

    def ours(x=x, y=out["ours"]):
        return mt.rms_norm(x, w, EPS, out=y)

    def tri(fn, x=x, y=None):
        def go():
            fn[(M,)](x, y, w, D, EPS, x, y, BLOCK=D, RESIDUAL=False, num_warps=WARPS)
            return y
        return go

    runs[f"ours on {tag}"] = (ours, x)
    runs[f"T0 on {tag}"] = (tri(t0, x, out["T0"]), x)
    runs[f"T1 on {tag}"] = (tri(t1, x, out["T1"]), x)
    runs[f"inductor on {tag}"] = ((lambda x=x: compiled(x, w)), x)
    runs[f"copy on {tag}"] = ((lambda x=x, y=out["copy"]: y.copy_(x)), None)
subjects, gates = [], {}
for name, (go, x) in runs.items():
    y = go()
    torch.cuda.synchronize()
    if x is not None:
        ref = torch.nn.functional.rms_norm(x.double(), (D,), w.double(), EPS)
        yd = y.double()
        err = float(torch.linalg.vector_norm(yd - ref) / torch.linalg.vector_norm(ref)) if torch.isfinite(yd).all() \
            else float("inf")
        gates[name] = err
        del ref, yd
        if err > tolerance:
            print(name, "FAILED GATE", err, flush=True)
            continue
    subjects.append(TorchSubject(name, go))
hot, cold = interleave(subjects, "hot", 5, 5), interleave(subjects, "cold", 5, 5)
for s in subjects:
    print(f"{s.name:18} hot {hot[s.name].median_us:7.2f} ±{hot[s.name].spread_us:5.2f}  "
          f"cold {cold[s.name].median_us:7.2f} ±{cold[s.name].spread_us:5.2f}", flush=True)
env_after = dict(os.environ)
doc = {"what": __doc__.split("\n\n")[0], "shape": {"m": M, "d": D, "dtype": "bfloat16"}, "gate_errors": gates,
       "pointers": {"xa": hex(xa.data_ptr()), "xb": hex(xb.data_ptr()), "ya": hex(ya.data_ptr()),
                    "yb": hex(yb.data_ptr())},
       "allocator": [allocator_before, torch.cuda.memory.get_allocator_backend()
                     if hasattr(torch.cuda.memory, "get_allocator_backend") else "?"],
       "env_changed": {k: [env_before.get(k), env_after.get(k)] for k in set(env_before) | set(env_after)
                       if env_before.get(k) != env_after.get(k)},
       "hot": {k: t.to_dict() for k, t in hot.items()}, "cold": {k: t.to_dict() for k, t in cold.items()}}
print(doc["env_changed"], doc["allocator"], doc["pointers"])
write_result(device, "norms_alloc_probe.json", json.dumps(doc, indent=1) + "\n")
