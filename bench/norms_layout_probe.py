"""RMSNorm 4096×8192 bf16 at five layouts of device memory: does the ranking of ours and Triton, hot, move with
where the inputs and outputs lie?

bench/norms.py, in four fresh processes, put Triton 2.6% ahead of the stored winner hot at 4096 rows (1.6% behind
at 16384), while the tuner's final round, in its own process, put Triton 2.6% behind the same winner
(bench/NOTES.md, norms §18). Each layout here first holds a buffer of `SHIFT_MB` × its index more than the last,
so every later allocation (the inputs, the fenced outputs, the peers' tensors) lies elsewhere; then the stored
winner and its shape without the prefetch (plain loads, nothing asked ahead) are gated and timed hot and cold,
interleaved with torch, Inductor and Triton (Triton writing the winner's y) beside the copy of the same bytes.
Writes bench/results/<gpu>/norms_layout_probe.json.

    python bench/norms_layout_probe.py
"""
import dataclasses
import json
import sys

sys.path.insert(0, "bench")
from _beside_copy import build_named, time_beside_copy
from _common import provenance, stored_case, write_result

from mage_gen import gpu

M, D, LAYOUTS, SHIFT_MB = 4096, 8192, 5, 97  # 97: no multiple of a page size or of the inputs' size


def main() -> None:
    device, op, shape, run, stored = stored_case("rmsnorm", M, D)
    configs = {"stored": stored, "plain": dataclasses.replace(stored, hint="none", l2_ahead=0)}
    variants = build_named(op, shape, configs, device.arch, f"rmsnorm {M}x{D}")
    rows, shifts = [], []
    try:
        for layout in range(LAYOUTS):
            shifts.append(gpu.Buffer(layout * SHIFT_MB << 20))
            rows.append({"layout": layout, "shifted_mb": SHIFT_MB * layout * (layout + 1) // 2,
                         "kernels": {n: v.source.kernel_name for n, v in variants.items()},
                         **time_beside_copy(op, shape, run, variants, f"layout {layout}", seed=M + D + layout,
                                            peers=True, share_outputs=True)})
    finally:
        for b in shifts:
            b.free()
    doc = {"what": __doc__.split("\n\n")[0], "m": M, "d": D, "dtype": "bfloat16", "shift_mb": SHIFT_MB,
           **provenance(device), "rows": rows}
    write_result(device, "norms_layout_probe.json", json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
