"""Norms: y (and residual_out) stored streaming, `st.global.cs`, at the rows that tie Inductor cold.

Our stores carry no cache operator, as Inductor's do not. Where a launch streams more than L2 holds, the lines
it writes compete with the rows `wide` keeps in L2 between its two passes, and with the rows other templates'
bulk prefetch asked for ahead of their block; written streaming (evict-first), the output would leave L2 before
them. §14 tried evict-first stores on `row` winners (a tie) before `wide` existed. Here the stored kernels of the
rows nearest 1.00 cold beside the same kernels with every store of the row (y, and residual_out) at `.cs`, in
bench/norms.py's rounds, placements and peers. Writes bench/results/<gpu>/norms_store_stream_probe.json.

    python bench/norms_store_stream_probe.py
"""
import sys

sys.path.insert(0, "bench")
from _common import ProbeRMSNorm
from norms import probe_contenders

from mage_gen.variants import build

CASES = (("rmsnorm", True, 4096, 4096), ("rmsnorm", True, 16384, 8192), ("rmsnorm", False, 16384, 8192),
         ("rmsnorm", True, 32768, 4096), ("rmsnorm", False, 4096, 8192))


# y and residual_out stored `st.global.cs`
STREAMING_STORES = ProbeRMSNorm(lambda context: {**context, "Y_HINT": "cs"}, "_stcs")


def main() -> None:
    probe_contenders({"what": __doc__.split("\n\n")[0]}, "norms_store_stream_probe.json", CASES,
                     lambda op, shape, stored, device: {"stores .cs": build(STREAMING_STORES, shape, stored,
                                                                             device.arch)})


if __name__ == "__main__":
    main()
