"""Norms: does compiling the Inductor peer change how fast the Triton peer runs in the same process?

At RMSNorm 4096×8192 the same Triton kernel timed 33.8 µs hot in bench/norms.py and 35.2–36.1 in processes
that never compiled Inductor (norms_buffer_probe.json, norms_placement_probe.json, the tune studies), while
the generated kernel and the copy timed alike in all of them. Phase A times the winner, the peers without
Inductor and the copy; phase B compiles Inductor (as the bench does) and times everything of phase A again,
the same CUDA graphs, beside the new peers. Environment variables and Triton's knobs are recorded before and
after. Writes bench/results/<gpu>/norms_peer_state_probe.json.

    python bench/norms_peer_state_probe.py
"""
import json
import os
import sys

sys.path.insert(0, "bench")
import triton
from _common import write_result
from _copy import copy_subjects, settle

from mage_gen import gpu
from mage_gen.measure import Bench, interleave
from mage_gen.ops import get_op
from mage_gen.peers import make_peers
from mage_gen.store import load_winner
from mage_gen.variants import build

OP, M, D = "rmsnorm", 4096, 8192


def knobs() -> dict[str, str]:
    found = {}
    for group in ("runtime", "compilation", "nvidia", "cache"):
        obj = getattr(triton.knobs, group, None)
        for name in dir(obj):
            if not name.startswith("_"):
                try:
                    found[f"{group}.{name}"] = repr(getattr(obj, name))[:200]
                except Exception as exc:  # noqa: BLE001  (a knob that cannot be read is recorded as such)
                    found[f"{group}.{name}"] = f"unreadable: {type(exc).__name__}"
    return found


def timed(subjects, label):
    hot, cold = interleave(subjects, "hot", 4, 5), interleave(subjects, "cold", 4, 5)
    for s in subjects:
        if not s.name.startswith("floor:copy/"):
            print(f"{label} {s.name:22} hot {hot[s.name].median_us:7.2f} ±{hot[s.name].spread_us:5.2f}  "
                  f"cold {cold[s.name].median_us:7.2f} ±{cold[s.name].spread_us:5.2f}", flush=True)
    return hot, cold


device = gpu.open_device()
op = get_op(OP)
shape, run = op.shape(d=D, dtype="bf16"), {"m": M}
variant = build(op, shape, load_winner(op, shape, device.name, run, l2_bytes=device.l2_bytes).params, device.arch)
bench = Bench(op, shape, run, seed=M + D)  # bench/norms.py's inputs
kernel = bench.load(variant)
ours, checked = bench.checked_subject(variant, kernel, name="mage-gen")
assert ours is not None, checked.reason
env_before, knobs_before = dict(os.environ), knobs()
peers_a, _ = make_peers(op, shape, run, ours.bound.inputs, None, check=bench.check_tensor, inductor=False)
for p in peers_a:
    p.name = f"A {p.name}"
copies_a = copy_subjects(op.bytes_moved(shape, run))
a = [ours, *peers_a, *copies_a]
hot_a, cold_a = timed(a, "A")
peers_b, missing = make_peers(op, shape, run, ours.bound.inputs, None, check=bench.check_tensor, inductor=True)
for p in peers_b:
    p.name = f"B {p.name}"
env_after, knobs_after = dict(os.environ), knobs()
hot_b, cold_b = timed([*a, *peers_b], "B")
settle(copies_a, hot_a, cold_a, hot_b, cold_b)
doc = {
    "what": __doc__.split("\n\n")[0], "op": OP, "m": M, "d": D, "kernel": variant.source.kernel_name,
    "peer_configs": {p.name: p.config for p in [*peers_a, *peers_b]}, "missing": missing,
    "env_changed": {k: [env_before.get(k), env_after.get(k)] for k in set(env_before) | set(env_after)
                    if env_before.get(k) != env_after.get(k)},
    "knobs_changed": {k: [knobs_before.get(k), knobs_after.get(k)] for k in set(knobs_before) | set(knobs_after)
                      if knobs_before.get(k) != knobs_after.get(k)},
    "phase_a": {"hot": {k: t.to_dict() for k, t in hot_a.items()}, "cold": {k: t.to_dict() for k, t in cold_a.items()}},
    "phase_b": {"hot": {k: t.to_dict() for k, t in hot_b.items()}, "cold": {k: t.to_dict() for k, t in cold_b.items()}},
}
print("env changed:", doc["env_changed"])
print("knobs changed:", doc["knobs_changed"])
ours.close()
kernel.unload()
write_result(device, "norms_peer_state_probe.json", json.dumps(doc, indent=1) + "\n")
