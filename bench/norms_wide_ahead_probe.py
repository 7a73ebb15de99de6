"""Norms d = 8192 bf16: template `wide` with the rows asked ahead of L2 (l2_ahead), against the stored winner.

`wide` reads the row from DRAM in pass 1 and from L2 in pass 2, so a block's reads from DRAM stop while it is in
its second pass; RMSNorm's `wide` runs at the copy's time at 4096×8192, the layer norm's, with more arithmetic an
element, 4% behind its `row` winner (bench/NOTES.md, norms §21). `row` gained 2-4% when each block asked L2 for a
later block's row (§13). Here `wide` asks too, at 1-3 MB ahead, at 128-512 threads, each config gated, then timed hot
and cold, interleaved, on one copy of the inputs beside the copy of the same bytes. Writes
bench/results/<gpu>/norms_wide_ahead_probe.json. The set `fitted`: nothing asked ahead, the blocks fitted per SM
from 2 to 6, so that the layer norm's kernel holds its statistics in registers (at 4 blocks of 256 threads ptxas
spills them); writes norms_wide_fitted_probe.json. The set `fitted_ahead`: fewer blocks per SM, rows asked ahead
(norms_wide_fitted_ahead_probe.json).

    python bench/norms_wide_ahead_probe.py
    python bench/norms_wide_ahead_probe.py fitted
    python bench/norms_wide_ahead_probe.py fitted_ahead
"""
import dataclasses
import json
import sys

sys.path.insert(0, "bench")
from _beside_copy import build_named, time_beside_copy
from _common import provenance, stored_case, write_result

# (op, rows, d)
CASES = (("layernorm", 4096, 8192), ("rmsnorm", 4096, 8192), ("layernorm", 16384, 8192))
# (threads, blocks fitted per SM, KB asked ahead)
LAYER_WIDE = ((256, 4, 0), (256, 4, 1024), (256, 4, 2048), (256, 4, 3072), (256, 3, 2048), (512, 2, 2048), (512, 3, 2048),
              (128, 8, 2048))
RMS_WIDE = ((256, 4, 1024), (256, 4, 2048), (512, 2, 2048))
SETS = {"ahead": (LAYER_WIDE, RMS_WIDE, "norms_wide_ahead_probe.json"),
        "fitted": (((256, 4, 0), (256, 3, 0), (256, 2, 0), (384, 2, 0), (384, 3, 0), (512, 2, 0), (512, 3, 0), (128, 6, 0),
                    (128, 5, 0)),
                   ((256, 3, 0), (512, 3, 0), (128, 6, 0)), "norms_wide_fitted_probe.json"),
        "fitted_ahead": (((256, 3, 1024), (256, 3, 3072), (256, 3, 4096), (128, 6, 1024), (128, 6, 2048),
                          (128, 6, 3072), (384, 3, 2048), (512, 3, 1024), (512, 3, 3072)),
                         ((256, 3, 2048), (128, 6, 2048)), "norms_wide_fitted_ahead_probe.json")}


def main() -> None:
    layer_wide, rms_wide, filename = SETS[sys.argv[1] if len(sys.argv) > 1 else "ahead"]
    doc, device = {"what": __doc__.split("\n\n")[0], "cases": {}}, None
    for op_name, m, d in CASES:
        device, op, shape, run, stored = stored_case(op_name, m, d)
        wide = op.params_from_dict({"template": "wide", "vector": 16, "hint": "keep_unreleased",
                                    **({"stats": "shifted"} if op_name == "layernorm" else {})})
        configs = {"stored": stored}
        for t, blocks, kb in layer_wide if op_name == "layernorm" else rms_wide:
            configs[f"wide t{t} b{blocks} ahead{kb}k"] = dataclasses.replace(wide, threads=t, min_blocks=blocks,
                                                                            l2_ahead=kb)
        label = f"{op_name} {m}x{d}"
        variants = build_named(op, shape, configs, device.arch, label)
        row = time_beside_copy(op, shape, run, variants, label, seed=m + d)
        row["kernels"] = {n: v.source.kernel_name for n, v in variants.items()}
        doc["cases"][label] = row
    doc.update(provenance(device))
    write_result(device, filename, json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
