"""Norms d = 8192 bf16: what a launch pays beyond the copy. The weights staged in shared memory (weights shared),
and rows asked of L2 further ahead than the blocks in flight, against the stored winners.

A launch of the 4096-row layer-norm winner costs 1.2-1.8 µs more than the copy of the same bytes at every M from
2048 to 32768 rows, at the copy's time per row (norms_tail_sweep_probe.json, bench/NOTES.md, norms §22): a fixed
cost, at the launch's start or its end. Two leads:
- the end: a row waits on w and b after its statistics, loaded in four register-limited batches (ptxas moves
  weights read `early` after the statistics too, §21); `shared` copies them beside x by cp.async, which no
  register waits on, and reads them from shared memory;
- the start: every resident block (660 rows at 5 per SM) loads its row and then reduces it, and the rows its
  prefetch asks for (1-3 MB ahead) are rows other resident blocks are already loading, so DRAM has little queued
  while the first wave reduces; asked further ahead than the resident rows (10 MB and more), a prefetch is never
  of a row in flight.
Each config gated, then timed hot and cold, interleaved, on one copy of the inputs beside the copy of the same
bytes. Writes bench/results/<gpu>/norms_launch_cost_probe.json. `weights = shared` lost, and left the op after
commit d33623b, whose templates the recorded run used; at later commits the probe names those configs refused and
times the others.
The set `l2`: the weights read late, as the 4096-row winner reads them, and asked of L2 by the launch's first
block as it starts (weights l2), so that in a cold launch the first wave's rows, done with their statistics, find
w and b in L2 and do not all wait on DRAM for them, while DRAM has little else queued; the stored winners of
four d = 8192 classes beside the same config so changed (norms_launch_cost_l2_probe.json).

    python bench/norms_launch_cost_probe.py
    python bench/norms_launch_cost_probe.py l2
"""
import dataclasses
import json
import sys

sys.path.insert(0, "bench")
from _beside_copy import build_named, time_beside_copy
from _common import provenance, stored_case, write_result

FAR_KB = (6144, 10240, 16384, 24576)
# (op, rows, configs as changes to the stored winner)
CASES = (
    ("layernorm", 4096, {
        "shared": {"weights": "shared"},
        "shared ahead2048k": {"weights": "shared", "l2_ahead": 2048},
        "shared b4": {"weights": "shared", "min_blocks": 4},
        "shared shifted": {"weights": "shared", "stats": "shifted"},
        # the 16384-row winner's (held packed, a block of 256 threads fits 4 per SM unasked)
        "shared t256 shifted packed ahead3072k": {"weights": "shared", "threads": 256, "min_blocks": 1,
                                                  "stats": "shifted", "hold": "packed", "hint": "nc", "l2_ahead": 3072},
        **{f"ahead{kb}k": {"l2_ahead": kb} for kb in FAR_KB},
        "shared ahead10240k": {"weights": "shared", "l2_ahead": 10240}}),
    ("rmsnorm", 4096, {f"ahead{kb}k": {"l2_ahead": kb} for kb in FAR_KB}),
    ("layernorm", 16384, {
        "shared": {"weights": "shared", "min_blocks": 1},
        "shared t128 b5 ahead1024k": {"weights": "shared", "threads": 128, "min_blocks": 5, "stats": "two_pass",
                                      "hold": "float", "hint": "none", "l2_ahead": 1024},
        **{f"ahead{kb}k": {"l2_ahead": kb} for kb in FAR_KB},
        "shared ahead10240k": {"weights": "shared", "min_blocks": 1, "l2_ahead": 10240}}),
)


# min_blocks 1 where the early weights the winner held were what left fewer blocks per SM unasked (a config the op
# refuses is named and left out)
L2_CHANGES = {"weights l2": {"weights": "l2"}, "weights l2 b1": {"weights": "l2", "min_blocks": 1}}
# (op, rows, residual)
L2_CASES = (("layernorm", 4096, False), ("layernorm", 16384, False), ("layernorm", 4096, True), ("rmsnorm", 4096, True))


def main() -> None:
    weights_l2 = sys.argv[1:] == ["l2"]
    cases = [(op_name, m, residual, L2_CHANGES) for op_name, m, residual in L2_CASES] \
        if weights_l2 else [(op_name, m, False, changes) for op_name, m, changes in CASES]
    doc, device = {"what": __doc__.split("\n\n")[0], "cases": {}}, None
    for op_name, m, residual, changes in cases:
        device, op, shape, run, stored = stored_case(op_name, m, 8192, residual=residual)
        configs = {"stored": stored}
        for name, c in changes.items():
            params = dataclasses.replace(stored, **c)
            if params not in configs.values():  # a change the winner already has is timed once
                configs[name] = params
        label = f"{op_name}{'+res' if residual else ''} {m}x8192"
        variants = build_named(op, shape, configs, device.arch, label)
        row = time_beside_copy(op, shape, run, variants, label, seed=m + 8192)
        row["kernels"] = {n: v.source.kernel_name for n, v in variants.items()}
        doc["cases"][label] = row
    doc.update(provenance(device))
    write_result(device, "norms_launch_cost_l2_probe.json" if weights_l2 else "norms_launch_cost_probe.json",
                 json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
