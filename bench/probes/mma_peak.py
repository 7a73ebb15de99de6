"""How fast mma.sync can go on this GPU: the ceiling of the tensor-core matmul's instruction, against which
bench/matmul_tc.py's targets are set.

A kernel (templates/probe/mma_peak.cu.j2) in which every warp issues CHAINS independent mma.sync per step from
fragments in registers, with no memory traffic, over warps per SM and CHAINS; the fastest is the instruction's
ceiling for bf16 (m16n8k16) and tf32 (m16n8k8). Each probe is gated first: its fragments hold fresh random
small integers, its output is poisoned with NaN, and every element must equal iters · K · a · b exactly.
cuBLAS at 4096³ (bf16; tf32; SGEMM with TF32 off) is timed in the same process, so the file says what share
of cuBLAS mma.sync could reach at most, and the least time 3xTF32 (three tf32 mma per product) could take
against SGEMM. Writes bench/results/<gpu>/mma_peak.json.

    python -m bench.probes.mma_peak
"""

from __future__ import annotations

import itertools
import json
import sys

import numpy as np
import torch

from mage_gen import gpu
from mage_gen.compile import compile_source
from mage_gen.measure import interleave
from mage_gen.peers import TorchSubject
from mage_gen.render import render

from bench._common import passing, provenance, timing_method, write_result

K_OF = {"bf16": 16, "tf32": 8}  # m16n8k16 and m16n8k8
WARPS_PER_BLOCK = 4
BLOCKS_PER_SM = (1, 2, 4)  # 4, 8, 16 warps per SM: 1, 2, 4 per scheduler
CHAINS = (1, 2, 4, 8, 16)
ITERS = 4096
ROUNDS, PER_ROUND = 3, 3
CUBLAS_SIZE = 4096


def bits_of(value: float, dtype: str) -> int:
    """A fragment register holding `value` in every element: bf16 twice, or the fp32 (tf32-exact) once."""
    word = int(np.float32(value).view(np.uint32))
    return (word >> 16) * 0x10001 if dtype == "bf16" else word


class Probe:
    def __init__(self, dtype: str, chains: int, blocks: int, device: gpu.DeviceInfo):
        self.dtype, self.chains, self.blocks = dtype, chains, blocks
        self.name = f"mma_peak_{dtype}_c{chains}_w{blocks * WARPS_PER_BLOCK}"
        threads = WARPS_PER_BLOCK * 32
        source = render("probe/mma_peak.cu.j2", {"THREADS": threads, "CHAINS": chains, "DTYPE": dtype},
                        self.name, None)
        self.kernel = gpu.Kernel(compile_source(source, device.arch).cubin, self.name)
        self.grid = (device.sms * blocks, 1, 1)
        self.block = (threads, 1, 1)
        self.out = torch.empty(self.grid[0] * threads * chains * 4, dtype=torch.float32, device="cuda")
        self.flops = 2 * 16 * 8 * K_OF[dtype] * chains * ITERS * self.grid[0] * WARPS_PER_BLOCK

    def launch(self, a: float, b: float) -> None:
        args = gpu.KernelArgs([("ptr", self.out.data_ptr()), ("i32", bits_of(a, self.dtype)),
                               ("i32", bits_of(b, self.dtype)), ("i32", ITERS)])
        self.kernel.launch(self.grid, self.block, 0, args, torch.cuda.current_stream().cuda_stream)

    def gate(self, rng: np.random.Generator) -> str:
        a, b = (float(v) for v in rng.integers(1, 4, size=2))
        self.out.fill_(float("nan"))
        self.launch(a, b)
        want = ITERS * K_OF[self.dtype] * a * b
        got = self.out.cpu().numpy()
        wrong = int(np.count_nonzero(got != want))
        return "" if wrong == 0 else f"{wrong} of {got.size} outputs differ from {want:g} (first {got[got != want][0]})"

    def subject(self) -> TorchSubject:
        return TorchSubject(self.name, lambda: self.launch(1.0, 1.0), {"chains": self.chains,
                            "warps_per_sm": self.blocks * WARPS_PER_BLOCK, "dtype": self.dtype})


def cublas_subjects() -> list[TorchSubject]:
    n = CUBLAS_SIZE
    subjects = []
    for name, dtype, tf32 in (("cublas/bf16", torch.bfloat16, False), ("cublas/tf32", torch.float32, True),
                              ("cublas/sgemm", torch.float32, False)):
        a = torch.randn(n, n, device="cuda").to(dtype)
        b = torch.randn(n, n, device="cuda").to(dtype)
        c = torch.empty(n, n, device="cuda", dtype=dtype)

        def run(a=a, b=b, c=c, tf32=tf32):
            before = torch.backends.cuda.matmul.allow_tf32
            torch.backends.cuda.matmul.allow_tf32 = tf32
            try:
                torch.matmul(a, b, out=c)
            finally:
                torch.backends.cuda.matmul.allow_tf32 = before
        subjects.append(TorchSubject(name, run, {"fn": "torch.matmul", "allow_tf32": tf32, "size": n}))
    return subjects


def main() -> None:
    device = gpu.open_device()
    rng = np.random.default_rng()
    built = (Probe(dtype, chains, blocks, device) for dtype, chains, blocks in itertools.product(K_OF, CHAINS, BLOCKS_PER_SM))
    probes, failed = passing((probe, probe.gate(rng)) for probe in built)
    subjects = [p.subject() for p in probes] + cublas_subjects()
    hot = interleave(subjects, "hot", ROUNDS, PER_ROUND)
    rows = []
    for p in probes:
        t = hot[p.name]
        rows.append({"kernel": p.name, "dtype": p.dtype, "chains": p.chains, "warps_per_sm": p.blocks * WARPS_PER_BLOCK,
                     "hot": t.to_dict(), "tflops": p.flops / t.median_us / 1e6})
        print(f"{p.name:28} {t.median_us:9.1f} µs ± {t.spread_us:5.1f}  {rows[-1]['tflops']:7.1f} TFLOP/s", flush=True)
    flops = 2 * CUBLAS_SIZE ** 3
    cublas = {s.name: {"hot": hot[s.name].to_dict(), "tflops": flops / hot[s.name].median_us / 1e6}
              for s in subjects if s.name.startswith("cublas/")}
    ceiling = {d: max((r for r in rows if r["dtype"] == d), key=lambda r: r["tflops"]) for d in K_OF}
    bounds = {
        "bf16: most of cuBLAS's 4096^3 throughput mma.sync can give":
            ceiling["bf16"]["tflops"] / cublas["cublas/bf16"]["tflops"],
        "tf32: most of cuBLAS's 4096^3 throughput mma.sync can give":
            ceiling["tf32"]["tflops"] / cublas["cublas/tf32"]["tflops"],
        "fp32x3: least time over SGEMM's at 4096^3 (three tf32 mma per product at the ceiling)":
            3 * flops / ceiling["tf32"]["tflops"] / 1e6 / cublas["cublas/sgemm"]["hot"]["median_us"],
    }
    for name, value in bounds.items():
        print(f"{name}: {value:.3f}")
    doc = {
        "what": "mma.sync's ceiling on this GPU (a register-only probe) beside cuBLAS at 4096^3, recorded by "
                "bench/probes/mma_peak.py",
        "method": {"probe": f"{WARPS_PER_BLOCK} warps per block, {'/'.join(map(str, BLOCKS_PER_SM))} blocks per SM, "
                            f"CHAINS independent mma per warp per step, {ITERS} steps, fragments in registers",
                   "gate": "fresh random small-integer fragments, NaN-poisoned output, every element exact",
                   **timing_method(ROUNDS, PER_ROUND)},
        **provenance(device), "probes": rows, "failed": failed, "cublas": cublas,
        "ceiling": {d: {"kernel": r["kernel"], "tflops": r["tflops"]} for d, r in ceiling.items()}, "bounds": bounds,
    }
    for p in probes:
        p.kernel.unload()
    out = write_result(device, "mma_peak.json", json.dumps(doc, indent=1) + "\n")
    print(f"wrote {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
