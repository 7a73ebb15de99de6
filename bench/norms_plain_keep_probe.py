"""Norms: Inductor's two-pass RMSNorm pays less than ours for a cold launch; is it its plain loads?

Where Inductor is the best peer, a cold launch of our `wide` kernel costs 0.2-0.8 µs more over its hot time than
Inductor's does, in every run (bench/NOTES.md, norms §24), and not for fetching its code. The two run the same
passes under the same L2 policies; our keep hints read x (and the residual) and w by the read-only path with the
policy (`ld.global.nc.L2::cache_hint`), Inductor's Triton kernel by plain loads with it. Here the stored `wide`
kernels beside the same kernel with every load plain (`ld.global.L2::cache_hint`: a context changed in this
process only, the kernel named `_plainld`), in bench/norms.py's rounds, placements and peers. Writes
bench/results/<gpu>/norms_plain_keep_probe.json.

    python bench/norms_plain_keep_probe.py
"""
import json
import sys

sys.path.insert(0, "bench")
from _common import ProbeRMSNorm, provenance, report_contenders, stored_case, write_result
from norms import bench_shape

from mage_gen.variants import build

CASES = (("rmsnorm", False, 16384, 8192), ("rmsnorm", True, 4096, 4096), ("rmsnorm", False, 4096, 8192),
         ("rmsnorm", True, 32768, 4096))


def plain_loads(context: dict) -> dict:
    """The keep hints' loads without .nc (the policy kept)."""
    return {**context, "X_HINT_PASS1": "", "X_HINT_PASS2": "", "WB_HINT": ""} if context["KEEP"] else context


def main() -> None:
    doc, device = {"what": __doc__.split("\n\n")[0], "rows": {}}, None
    for op_name, residual, m, d in CASES:
        device, op, shape, _, stored = stored_case(op_name, m, d, residual=residual)
        label = f"{op_name}{'+res' if residual else ''}:{m}x{d}"
        plain = build(ProbeRMSNorm(plain_loads, "_plainld"), shape, stored, device.arch)
        row = bench_shape(op, shape, m, stored, device, contenders={"plain loads": plain})
        doc["rows"][label] = row
        report_contenders(label, row, ["plain loads"])
    doc.update(provenance(device))
    write_result(device, "norms_plain_keep_probe.json", json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
