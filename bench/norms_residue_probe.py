"""RMSNorm 4096×8192 and 16384×8192 bf16, the tuner's final round with Inductor timed beside the rest, in turn with
and without the persisting lines of L2 reset before each subject's hot replays and each cold sample
(`measure.own_lines_only`): is Triton's lead in bench/norms.py the lines Inductor leaves at evict-last?
Triton ran 33.4 µs hot right after Inductor and 35.0 where Inductor was not timed (norms_inductor_order_probe.json).
Writes bench/results/<gpu>/norms_residue_probe.json.

    python bench/norms_residue_probe.py
"""
import dataclasses
import functools
import json
import sys

sys.path.insert(0, "bench")
from _common import provenance, stored_case, write_result
from norms_final_round_probe import final_round

import mage_gen.gpu as gpu
import mage_gen.peers as peers
from mage_gen.variants import build

SHAPES = ((4096, 8192), (16384, 8192))


def main() -> None:
    reset, plain_make = gpu.reset_persisting_l2, peers.make_peers
    peers.make_peers = functools.partial(plain_make, inductor=True)
    doc, device = {"what": __doc__.split("\n\n")[0], "runs": {}}, None
    try:
        for m, d in SHAPES:
            device, op, shape, run, stored = stored_case("rmsnorm", m, d)
            configs = {"stored": stored,
                       "triton shape": dataclasses.replace(stored, threads=256, hint="none", l2_ahead=0)}
            variants = {n: build(op, shape, p, device.arch) for n, p in configs.items()}
            for turn in range(2):
                for setting in ("no reset", "reset"):
                    gpu.reset_persisting_l2 = reset if setting == "reset" else (lambda: None)
                    label = f"{m}x{d} {setting}"
                    doc["runs"][f"{label}, turn {turn}"] = final_round(op, shape, run, variants, label)
    finally:
        gpu.reset_persisting_l2, peers.make_peers = reset, plain_make
    doc.update(provenance(device))
    write_result(device, "norms_residue_probe.json", json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
