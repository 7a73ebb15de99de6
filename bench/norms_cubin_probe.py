"""Norms: the same machine code, built by different assemblers, timed side by side.

Triton's RMSNorm kernel at 8 warps ran 35.2 µs hot at 4096×8192 when Triton assembled it with its own ptxas
(12.8) and 33.8 when Inductor's set-up had pointed Triton at torch's ptxas (13.0) (norms_peer_state_probe.json),
though both assemblers give that PTX the same SASS. Here cubins built beforehand from one PTX each (the tuned
winner's, as NVRTC emits it, and Triton's) by NVRTC, ptxas 13.0 and ptxas 12.8, with and without line info and
for sm_90 and sm_90a, are loaded and launched on one set of buffers, gated against a float64 reference, and
timed hot and cold, interleaved, beside the copy. Writes bench/results/<gpu>/norms_cubin_probe.json.

    python bench/norms_cubin_probe.py DIR   # DIR holds ours_*.cubin and tri_*.cubin

The cubins of norms_cubin_probe.json: ours_nvrtc is the winner's cubin from NVRTC 13.0; ours_px13* its PTX
through ptxas 13.0 (-arch=sm_90 or sm_90a, -lineinfo or not); ours_px128* the same PTX, .version lowered to 8.7,
through Triton 3.6's ptxas 12.8; tri_* Triton's PTX of triton_rmsnorm (BLOCK 8192, 8 warps, pointers and N
divisible by 16, compiled for sm_90 on the CPU) through ptxas 13.0 and 12.8. Both assemblers give each PTX the
same SASS (cuobjdump -sass).
"""
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, "bench")
from _common import write_result

from mage_gen import gpu
from mage_gen.dtypes import dtype as element_type
from mage_gen.measure import interleave
from mage_gen.ops import get_op
from mage_gen.peers import TorchSubject

M, D, EPS = 4096, 8192, 1e-6
OURS = ("rmsnorm_row_d8192_bf16_t384_v8_r1_approx_nc_wearly_b3", (M, 1, 1), (384, 1, 1), 0)
TRITON = ("triton_rmsnorm", (M, 1, 1), (256, 1, 1), 32)  # 8 warps; 32 bytes of shared memory, as Triton launches it

device = gpu.open_device()
op = get_op("rmsnorm")
tolerance = op.tolerance_of(op.shape(d=D, dtype="bf16"), "y", element_type("bf16"))
x = torch.randn(M, D, device="cuda").to(torch.bfloat16)
w = torch.randn(D, device="cuda").to(torch.bfloat16)
reference = torch.nn.functional.rms_norm(x.double(), (D,), w.double(), EPS)
kernels, subjects, gates = [], [], {}
for path in sorted(Path(sys.argv[1]).glob("*.cubin")):
    name, grid, block, shared = OURS if path.name.startswith("ours") else TRITON
    kernel = gpu.Kernel(path.read_bytes(), name, shared)
    kernels.append(kernel)
    y = torch.full_like(x, float("nan"))
    if name == OURS[0]:
        values = [("ptr", y.data_ptr()), ("ptr", x.data_ptr()), ("ptr", w.data_ptr()), ("i32", M), ("f32", EPS)]
    else:  # X, Y, W, N, eps, R, R_OUT, and Triton's global and profile scratch pointers
        values = [("ptr", x.data_ptr()), ("ptr", y.data_ptr()), ("ptr", w.data_ptr()), ("i32", D), ("f32", EPS),
                  ("ptr", x.data_ptr()), ("ptr", y.data_ptr()), ("ptr", 0), ("ptr", 0)]
    args = gpu.KernelArgs(values)

    def go(kernel=kernel, grid=grid, block=block, shared=shared, args=args, y=y):
        kernel.launch(grid, block, shared, args, torch.cuda.current_stream().cuda_stream)
        return y

    go()
    torch.cuda.synchronize()
    yd = y.double()
    err = float(torch.linalg.vector_norm(yd - reference) / torch.linalg.vector_norm(reference)) \
        if torch.isfinite(yd).all() else float("inf")
    gates[path.stem] = err
    if err > tolerance:
        print(path.stem, "FAILED GATE", err, flush=True)
        continue
    subjects.append(TorchSubject(path.stem, go))
copy_y = torch.empty_like(x)
subjects.append(TorchSubject("copy", lambda: copy_y.copy_(x)))
hot, cold = interleave(subjects, "hot", 5, 5), interleave(subjects, "cold", 5, 5)
for s in subjects:
    print(f"{s.name:26} hot {hot[s.name].median_us:7.2f} ±{hot[s.name].spread_us:5.2f}  "
          f"cold {cold[s.name].median_us:7.2f} ±{cold[s.name].spread_us:5.2f}", flush=True)
doc = {"what": __doc__.split("\n\n")[0], "shape": {"m": M, "d": D, "dtype": "bfloat16"}, "gate_errors": gates,
       "hot": {k: t.to_dict() for k, t in hot.items()}, "cold": {k: t.to_dict() for k, t in cold.items()}}
write_result(device, "norms_cubin_probe.json", json.dumps(doc, indent=1) + "\n")
