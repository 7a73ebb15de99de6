"""Norms: does where y lies relative to x move a DRAM-bound bf16 norm's time, for every kernel alike?

The same Triton kernel timed 33.8 µs hot in one process (bench/norms.py) and 35.5 in another
(norms_buffer_probe.json) at RMSNorm 4096×8192, while the copy of the same bytes timed 33.8 in both. Here one
pool holds x and, at several offsets after it, y: at each placement the tuned winner (through mage_gen.torch),
the Triton peer and torch's copy of x into y, gated against a float64 reference, then timed hot and cold,
interleaved across placements. Writes bench/results/<gpu>/norms_placement_probe.json.

    python bench/norms_placement_probe.py
"""
import json
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

M, D, EPS = 4096, 8192, 1e-6
MB = 1 << 20
# y's start after x's, in bytes: x is 64 MB here
OFFSETS = [64 * MB, 64 * MB + 4096, 64 * MB + 64 * 1024, 66 * MB, 68 * MB, 72 * MB, 80 * MB, 96 * MB, 128 * MB,
           192 * MB]
WARPS = 8


def relative_error(y: torch.Tensor, ref: torch.Tensor) -> float:
    y = y.double()
    if not torch.isfinite(y).all():
        return float("inf")
    return float(torch.linalg.vector_norm(y - ref) / torch.linalg.vector_norm(ref))


device = gpu.open_device()
op = get_op("rmsnorm")
shape = op.shape(d=D, dtype="bf16")
tolerance = op.tolerance_of(shape, "y", element_type("bf16"))
row_bytes = M * D * 2
pool = torch.empty((max(OFFSETS) + row_bytes) // 2, dtype=torch.bfloat16, device="cuda")
x = pool[: M * D].view(M, D)
x.copy_(torch.randn(M, D, device="cuda"))
w = torch.randn(D, device="cuda").to(torch.bfloat16)
reference = torch.nn.functional.rms_norm(x.double(), (D,), w.double(), EPS)
subjects, gates = [], {}
for offset in OFFSETS:
    y = pool[offset // 2: offset // 2 + M * D].view(M, D)
    tag = f"+{offset / MB:g}MB"

    def ours(y=y):
        return mt.rms_norm(x, w, EPS, out=y)

    def triton_(y=y):
        triton_rmsnorm[(M,)](x, y, w, D, EPS, x, y, BLOCK=D, RESIDUAL=False, num_warps=WARPS)
        return y

    def copy(y=y):
        return y.copy_(x)

    for name, go, check in ((f"ours {tag}", ours, True), (f"triton/w{WARPS} {tag}", triton_, True),
                            (f"copy {tag}", copy, False)):
        y.fill_(float("nan"))
        go()
        torch.cuda.synchronize()
        err = relative_error(y, reference) if check else (0.0 if torch.equal(y, x) else 1.0)
        gates[name] = err
        if err > (tolerance if check else 0.0):
            print(name, "FAILED GATE", err, flush=True)
            continue
        subjects.append(TorchSubject(name, go))
hot, cold = interleave(subjects, "hot", 4, 5), interleave(subjects, "cold", 4, 5)
for s in subjects:
    print(f"{s.name:28} hot {hot[s.name].median_us:7.2f} ±{hot[s.name].spread_us:5.2f}  "
          f"cold {cold[s.name].median_us:7.2f} ±{cold[s.name].spread_us:5.2f}", flush=True)
doc = {"what": __doc__.split("\n\n")[0], "shape": {"m": M, "d": D, "dtype": "bfloat16"},
       "x": hex(x.data_ptr()), "offsets_bytes": OFFSETS, "gate_errors": gates,
       "hot": {k: t.to_dict() for k, t in hot.items()}, "cold": {k: t.to_dict() for k, t in cold.items()}}
write_result(device, "norms_placement_probe.json", json.dumps(doc, indent=1) + "\n")
