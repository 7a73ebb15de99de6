"""Norms: is the gap to Triton at the DRAM-bound bf16 shapes the kernel, or the buffers it runs on?

The bench times each generated kernel on its own buffers (cuMemAlloc, outputs fenced) and each peer on torch's
tensors. Here, in one process and interleaved, hot and cold, for a few shapes where the tuned winner loses:
  ours/bound      the winner on its own buffers, as bench/norms.py times it
  ours/torch      the same kernel through mage_gen.torch on the peers' torch tensors
  triton/wN       the Triton peer on torch's tensors, as bench/norms.py times it
  triton/wN/bound the same Triton kernel reading and writing the winner's own buffers
and the copy of the same bytes. Every subject is gated on the timing inputs before it is timed.
Writes bench/results/<gpu>/norms_buffer_probe.json.

    python bench/norms_buffer_probe.py
"""
import json
import sys

import torch

sys.path.insert(0, "bench")
from _common import write_result
from _copy import copy_subjects, settle

import mage_gen.torch as mt
from mage_gen import gpu
from mage_gen.dtypes import dtype as element_type
from mage_gen.measure import GUARD_BYTES, Bench, interleave
from mage_gen.ops import get_op
from mage_gen.peers import TorchSubject, triton_layernorm, triton_rmsnorm, on_gpu, to_torch
from mage_gen.store import load_winner
from mage_gen.variants import build

CASES = [("rmsnorm", 4096, 8192), ("layernorm", 16384, 8192), ("rmsnorm", 16384, 8192),
         ("rmsnorm", 32768, 4096), ("layernorm", 4096, 8192)]
WARPS = (4, 8, 16)


def triton_subject(name, opname, x, y, w, b, m, d, warps):
    kernel = triton_layernorm if opname == "layernorm" else triton_rmsnorm

    def go():
        if opname == "layernorm":
            kernel[(m,)](x, y, w, b, d, 1e-5, x, x, BLOCK=d, RESIDUAL=False, num_warps=warps)
        else:
            kernel[(m,)](x, y, w, d, 1e-6, x, x, BLOCK=d, RESIDUAL=False, num_warps=warps)
        return y
    return TorchSubject(name, go, {"num_warps": warps}), go


def gated(bench, subject, go, y) -> bool:
    y.fill_(float("nan"))
    go()
    torch.cuda.synchronize()
    _, reason = bench.check_tensor("y", y)
    if reason:
        print(subject.name, "FAILED GATE", reason, flush=True)
    return not reason


def probe(device, opname: str, m: int, d: int) -> dict | None:
    op = get_op(opname)
    shape = op.shape(d=d, dtype="bf16")
    run = {"m": m}
    winner = load_winner(op, shape, device.name, run, l2_bytes=device.l2_bytes).params
    bench = Bench(op, shape, run, seed=7)
    variant = build(op, shape, winner, device.arch)
    kernel = bench.load(variant)
    ours, checked = bench.checked_subject(variant, kernel, name="ours/bound")
    if ours is None:
        print(opname, m, d, "winner failed the gate:", checked.reason)
        return None
    inputs = bench.timing_inputs()
    x = to_torch(inputs["x"], element_type(shape.dtype))
    w = to_torch(inputs["w"], element_type(shape.weight_dtype))
    b = to_torch(inputs["b"], element_type(shape.weight_dtype)) if "b" in inputs else None
    subjects = [ours]
    y_ours = torch.empty_like(x)

    def ours_go():
        return mt.layer_norm(x, w, b, out=y_ours) if opname == "layernorm" else mt.rms_norm(x, w, out=y_ours)
    on_torch = TorchSubject("ours/torch", ours_go)
    if gated(bench, on_torch, ours_go, y_ours):
        subjects.append(on_torch)
    buffers = ours.bound.buffers
    bf16 = element_type("bf16")
    bx, by = on_gpu(buffers["x"].ptr, (m, d), bf16), on_gpu(buffers["y"].ptr + GUARD_BYTES, (m, d), bf16)
    bw = on_gpu(buffers["w"].ptr, (d,), bf16) if w.dtype == torch.bfloat16 else None
    for warps in WARPS:
        y_tri = torch.empty_like(x)
        s, go = triton_subject(f"triton/w{warps}", opname, x, y_tri, w, b, m, d, warps)
        if gated(bench, s, go, y_tri):
            subjects.append(s)
        if bw is not None:
            bb = on_gpu(buffers["b"].ptr, (d,), bf16) if "b" in buffers else None
            s, go = triton_subject(f"triton/w{warps}/bound", opname, bx, by, bw, bb, m, d, warps)
            if gated(bench, s, go, by):
                subjects.append(s)
    # the Triton runs wrote the winner's output: poison it again so the fence check at close still means something
    ours.bound.poison(bench.stream)
    copies = copy_subjects(op.bytes_moved(shape, run))
    everyone = [*subjects, *copies]
    hot, cold = interleave(everyone, "hot", 4, 5), interleave(everyone, "cold", 4, 5)
    settle(copies, hot, cold)
    complaints = ours.bound.fence_complaints()
    row = {"op": opname, "m": m, "d": d, "kernel": variant.source.kernel_name, "fences": complaints,
           "pointers": {"ours x": hex(buffers["x"].ptr), "ours y": hex(buffers["y"].ptr + GUARD_BYTES),
                        "torch x": hex(x.data_ptr()), "torch y (ours)": hex(y_ours.data_ptr())},
           "hot": {k: t.to_dict() for k, t in hot.items()}, "cold": {k: t.to_dict() for k, t in cold.items()}}
    print(opname, m, d, variant.source.kernel_name, complaints or "fences intact", flush=True)
    for k in hot:
        if not k.startswith("floor:copy/"):
            print(f"   {k:24} hot {hot[k].median_us:8.2f} ±{hot[k].spread_us:5.2f}  cold {cold[k].median_us:8.2f}"
                  f" ±{cold[k].spread_us:5.2f}", flush=True)
    ours.close()
    kernel.unload()
    return row


device = gpu.open_device()
rows = []
for opname, m, d in CASES:
    row = probe(device, opname, m, d)
    if row is not None:
        rows.append(row)
    torch.cuda.empty_cache()
write_result(device, "norms_buffer_probe.json", json.dumps(rows, indent=1) + "\n")
