"""Norms: the bench's Triton peer, and the generated kernel run on the very tensors that peer runs on.

In bench/norms.py and in phase B of norms_peer_state_probe.json the Triton peer ran RMSNorm 4096×8192 at
33.7 µs hot; launched by hand on tensors of its own it ran 35.0–35.4 (norms_alloc_probe.json,
norms_cubin_probe.json) and the generated kernel 34.8–35.3 everywhere. Here the peers are made as the bench
makes them; then, on the tensors the chosen Triton peer closes over, the tuned winner (through mage_gen.torch)
writes into a fresh y and into the peer's own y, and the peer's kernel writes into a fresh y; all gated, then
timed hot and cold, interleaved, beside the bench's own subjects and the copy.
Writes bench/results/<gpu>/norms_peer_tensors_probe.json.

    python bench/norms_peer_tensors_probe.py
"""
import inspect
import json
import sys

import torch

sys.path.insert(0, "bench")
from _common import write_result
from _copy import copy_subjects, settle

import mage_gen.torch as mt
from mage_gen import gpu
from mage_gen.measure import Bench, interleave
from mage_gen.ops import get_op
from mage_gen.peers import TorchSubject, triton_rmsnorm, make_peers
from mage_gen.store import load_winner
from mage_gen.variants import build

OP, M, D, EPS = "rmsnorm", 4096, 8192, 1e-6

device = gpu.open_device()
op = get_op(OP)
shape, run = op.shape(d=D, dtype="bf16"), {"m": M}
variant = build(op, shape, load_winner(op, shape, device.name, run, l2_bytes=device.l2_bytes).params, device.arch)
bench = Bench(op, shape, run, seed=M + D)  # bench/norms.py's inputs
kernel = bench.load(variant)
ours, checked = bench.checked_subject(variant, kernel, name="mage-gen (own buffers)")
assert ours is not None, checked.reason
peers, missing = make_peers(op, shape, run, ours.bound.inputs, None, check=bench.check_tensor, inductor=True)
triton_peer = next(p for p in peers if p.name == "triton")
held = inspect.getclosurevars(triton_peer.run).nonlocals
x, y_peer, warps = held["x"], held["y"], triton_peer.config["num_warps"]
w = held["weights"][0]
print("peer tensors", hex(x.data_ptr()), hex(y_peer.data_ptr()), "warps", warps, flush=True)
fresh = {name: torch.full_like(x, float("nan")) for name in ("ours", "triton")}
extra = {
    "mage-gen on the peer's x, fresh y": (lambda: mt.rms_norm(x, w, EPS, out=fresh["ours"]), fresh["ours"]),
    "mage-gen on the peer's x and y": (lambda: mt.rms_norm(x, w, EPS, out=y_peer), y_peer),
    "triton on the peer's x, fresh y": (lambda: triton_rmsnorm[(M,)](x, fresh["triton"], w, D, EPS, x, fresh["triton"],
                                                                      BLOCK=D, RESIDUAL=False, num_warps=warps),
                                        fresh["triton"]),
}
subjects = [ours, *peers]
for name, (go, out) in extra.items():
    out.fill_(float("nan"))
    go()
    torch.cuda.synchronize()
    err, reason = bench.check_tensor("y", out)
    if reason:
        print(name, "FAILED GATE", reason, flush=True)
        continue
    subjects.append(TorchSubject(name, go))
copies = copy_subjects(op.bytes_moved(shape, run))
hot, cold = interleave([*subjects, *copies], "hot", 5, 5), interleave([*subjects, *copies], "cold", 5, 5)
settle(copies, hot, cold)
for k in hot:
    if not k.startswith("floor:copy/"):
        print(f"{k:36} hot {hot[k].median_us:7.2f} ±{hot[k].spread_us:5.2f}  cold {cold[k].median_us:7.2f} "
              f"±{cold[k].spread_us:5.2f}", flush=True)
doc = {"what": __doc__.split("\n\n")[0], "op": OP, "m": M, "d": D, "kernel": variant.source.kernel_name,
       "peer_configs": {p.name: p.config for p in peers}, "missing": missing,
       "pointers": {"peer x": hex(x.data_ptr()), "peer y": hex(y_peer.data_ptr()),
                    "own x": hex(ours.bound.buffers["x"].ptr), "own y": hex(ours.bound.buffers["y"].ptr)},
       "hot": {k: t.to_dict() for k, t in hot.items()}, "cold": {k: t.to_dict() for k, t in cold.items()}}
ours.close()
kernel.unload()
write_result(device, "norms_peer_tensors_probe.json", json.dumps(doc, indent=1) + "\n")
