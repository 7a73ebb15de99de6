"""Norms: the second pass of `wide` read from L1, by L1 eviction priorities as Inductor's loads give them.

`wide` reads its row twice, the second time from L1 where its lines are still there. How much L1 the SM has moves
the stored kernels by percents (bench/NOTES.md, norms §26: 2% slower with 92 KB of L1, 13% with 28 KB), so the
second pass does find lines in L1, and more the more L1 holds. Our loads give L1 no priority (`ld.global.nc` under
an L2 policy); Inductor's Triton kernels, whose L2 policies ours copy, also mark the first pass's loads
`L1::evict_last` and the second's `L1::evict_first`. Here the stored `wide` kernels beside the same kernels with
L1 priorities (the first pass and w at evict-last, the second pass at evict-first; each half alone; and both with
the most L1 the SM can have, carveout 0), in bench/norms.py's rounds, placements and peers. Writes
bench/results/<gpu>/norms_l1_priority_probe.json.

    python bench/norms_l1_priority_probe.py
"""
import dataclasses
import sys

sys.path.insert(0, "bench")
from _common import ProbeRMSNorm
from norms import probe_contenders

from mage_gen.variants import build

CASES = (("rmsnorm", False, 16384, 8192), ("rmsnorm", True, 4096, 4096), ("rmsnorm", False, 4096, 8192),
         ("rmsnorm", True, 32768, 4096))
# name -> (first pass, second pass, weights)
PRIORITIES = {"L1 last/first": ("nc_l1_last", "nc_l1_first", "nc_l1_last"),
              "L1 last": ("nc_l1_last", "nc", "nc_l1_last"),
              "L1 first": ("nc", "nc_l1_first", "nc")}


def l1_priorities(label: str) -> ProbeRMSNorm:
    """RMSNorm whose keep hints give L1 eviction priorities too (PRIORITIES[label])."""
    first, second, weights = PRIORITIES[label]

    def change(context: dict) -> dict:
        return {**context, "X_HINT_PASS1": first, "X_HINT_PASS2": second, "WB_HINT": weights} if context["KEEP"] \
            else context
    return ProbeRMSNorm(change, "_l1" + "".join(w[0] for w in label[3:].split("/")))


def main() -> None:
    def priorities(op, shape, stored, device):
        contenders = {name: build(l1_priorities(name), shape, stored, device.arch) for name in PRIORITIES}
        contenders["L1 last/first, carveout 0"] = dataclasses.replace(contenders["L1 last/first"], carveout=0)
        return contenders

    probe_contenders({"what": __doc__.split("\n\n")[0], "priorities": PRIORITIES}, "norms_l1_priority_probe.json",
                     CASES, priorities)

if __name__ == "__main__":
    main()
