"""Norms: is the cold start Inductor pays less for the SM's shared-memory configuration?

Where Inductor is the best peer, a cold launch of our `wide` kernel costs 0.2-0.8 µs more over its hot time than
Inductor's does (bench/NOTES.md, norms §24), and neither its code's fetch nor the read-only path is it. Nsight
Compute's launch statistics of earlier profiles show our `row` norms running with 8 KB of shared memory configured
on the SM and Triton's with 16 KB (`results/h200/ncu/norm_16384x8192_bf16_*.csv`). An SM reconfigures its
L1/shared split between two kernels that ask for different sizes, and a cold sample follows the flush's memset; a
hot one follows the same kernel. Here the stored kernels beside the same cubins loaded with a preferred carveout of
0, 7 and 100 percent, in bench/norms.py's rounds, placements and peers (`--once` under ncu read back what each was
given: the driver's own choice 16 KB, then 8, 164 and 228 KB; `results/h200/ncu/carveout_launch_stats.csv`).
Writes bench/results/<gpu>/norms_carveout_probe.json.

    python bench/norms_carveout_probe.py
    python bench/norms_carveout_probe.py --once   # each kernel launched once after the flush, for ncu's launch stats
"""
import dataclasses
import sys

sys.path.insert(0, "bench")
from _common import stored_case
from norms import probe_contenders

from mage_gen.variants import build

CASES = (("rmsnorm", False, 16384, 8192), ("rmsnorm", True, 4096, 4096))
CARVEOUTS = (0, 7, 100)


def once() -> None:
    """The flush, then each kernel of CASES once at each carveout, the copy and Inductor's kernel: what ncu's
    launch statistics read (launch__shared_mem_config_size)."""
    import torch

    from mage_gen import gpu
    from mage_gen.measure import Bench, flush_buffer
    from mage_gen.peers import eager_norm, eager_norm_into

    for op_name, residual, m, d in CASES:
        device, op, shape, run, stored = stored_case(op_name, m, d, residual=residual)
        bench = Bench(op, shape, run, seed=m + d)
        variant = build(op, shape, stored, device.arch)
        for carveout in (None, *CARVEOUTS):
            subject, gate = bench.checked_subject(dataclasses.replace(variant, carveout=carveout),
                                                  bench.load(dataclasses.replace(variant, carveout=carveout)),
                                                  name=f"carveout {carveout}", placement=0)
            if subject is None:
                print(f"carveout {carveout}: FAILED GATE {gate.reason}", flush=True)
                continue
            flush_buffer().fill32(carveout or 0, subject.stream.handle)
            subject.bound.enqueue(subject.stream.handle)
            gpu.synchronize()
            subject.close()
        x = torch.randn(m, d, device="cuda", dtype=torch.bfloat16)
        r = torch.randn_like(x) if residual else None
        w = torch.randn(d, device="cuda", dtype=torch.bfloat16)
        y, r_out = torch.empty_like(x), torch.empty_like(x) if residual else None
        compiled = torch.compile(eager_norm_into(eager_norm("F.rms_norm", d, 1e-6)), dynamic=False, fullgraph=True)
        for _ in range(2):
            flush_buffer().fill32(1, 0)
            compiled(x, r, y, r_out, w)
            flush_buffer().fill32(2, 0)
            y.copy_(x)
        torch.cuda.synchronize()


def main() -> None:
    if "--once" in sys.argv:
        once()
        return

    def carveouts(op, shape, stored, device):
        variant = build(op, shape, stored, device.arch)
        return {f"carveout {c}": dataclasses.replace(variant, carveout=c) for c in CARVEOUTS}

    probe_contenders({"what": __doc__.split("\n\n")[0], "carveouts": CARVEOUTS}, "norms_carveout_probe.json", CASES,
                     carveouts)


if __name__ == "__main__":
    main()
