"""Norms: how much L2 fetches from DRAM on a miss of the row's first read (`.L2::128B`, `.L2::256B`).

Where our kernel and Inductor's both stream at the copy's rate, their cold ratio is a tie that lands either side
of 1.00 from run to run (bench/NOTES.md, norms §24-§26): no kernel shape or cache policy tried so far moves more
bytes a second there. One qualifier of the loads is untried: the prefetch size, how many bytes L2 asks of DRAM
for a load that misses (the default leaves it to L2; 128 or 256 bytes ask for whole lines, or pairs of them, at
once). Here the stored kernels of the rows nearest 1.00 cold beside the same kernels with the row's first read
(x and the residual; `wide`'s first pass, the other templates' one read) at `.L2::128B` and `.L2::256B`, in
bench/norms.py's rounds, placements and peers. Writes bench/results/<gpu>/norms_l2_fetch_probe.json.

    python bench/norms_l2_fetch_probe.py
"""
import sys

sys.path.insert(0, "bench")
from _common import ProbeRMSNorm
from norms import probe_contenders

from mage_gen.variants import build

CASES = (("rmsnorm", True, 4096, 4096), ("rmsnorm", True, 16384, 8192), ("rmsnorm", False, 16384, 8192),
         ("rmsnorm", True, 32768, 4096), ("rmsnorm", False, 4096, 8192), ("rmsnorm", True, 4096, 768))
FETCH_BYTES = (128, 256)


def l2_fetch(size: int) -> ProbeRMSNorm:
    """RMSNorm whose first read of the row asks L2 for `size` bytes a miss."""
    return ProbeRMSNorm(lambda context: {**context, "X_HINT": f"{context['X_HINT']}@{size}",
                                         "X_HINT_PASS1": f"{context['X_HINT_PASS1']}@{size}"}, f"_f{size}")


def main() -> None:
    def fetches(op, shape, stored, device):
        return {f"L2::{size}B": build(l2_fetch(size), shape, stored, device.arch) for size in FETCH_BYTES}

    probe_contenders({"what": __doc__.split("\n\n")[0], "fetch_bytes": FETCH_BYTES}, "norms_l2_fetch_probe.json",
                     CASES, fetches)


if __name__ == "__main__":
    main()
