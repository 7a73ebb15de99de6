"""Is a cold sample cold: each subject timed cold with the persisting lines of L2 reset before the flush, and not.

The flush (256 MB written) does not evict lines a kernel loaded at evict-last priority: §14 found such lines of x
still in L2 after a 512 MB stream and the flush. Inductor's norms at d = 8192 load x at evict-last (norms §16), and
bench/norms.py found Inductor's cold median at 16384×8192 under the copy of the same bytes. cuCtxResetPersistingL2Cache
gives persisting lines normal priority again. At three bf16 shapes the stored winner, torch, Inductor, Triton (on
the kernel's y) and the copies of the same bytes are timed cold (measure's cold sample: reset, hold, flush, launch)
in alternating passes, with the reset and with it switched off, every one on one copy of the inputs. (This probe
found no cold figure moved; norms §19 then found Triton's hot one did, and measure's samples have reset since.)
Writes bench/results/<gpu>/cold_flush_probe.json.

    python bench/cold_flush_probe.py
"""
import json
import sys

sys.path.insert(0, "bench")
from _beside_copy import winner_beside_peers
from _common import provenance, write_result
from _copy import FLOOR, picked_copies

from mage_gen import gpu, measure
from mage_gen.dtypes import dtype
from mage_gen.ops import get_op
from mage_gen.peers import on_gpu

SHAPES = [("rmsnorm", 16384, 8192), ("rmsnorm", 4096, 8192), ("layernorm", 65536, 768)]
PASSES, PER_ROUND = 3, 5


def main() -> None:
    device = gpu.open_device()
    rows = []
    for name, m, d in SHAPES:
        op = get_op(name)
        shape = op.shape(d=d, dtype="bf16")
        run = {"m": m}
        with winner_beside_peers(op, shape, run, device) as (bench, subject, others, missing):
            x = on_gpu(bench.placement(0).inputs["x"].ptr, bench.timing_inputs()["x"].shape, dtype(shape.dtype))
            copy = picked_copies(op.bytes_moved(shape, run), (x,))["cold"]
            copy_is = copy.name
            copy.name = FLOOR
            everyone = [subject, *others, copy]
            samples = {setting: {s.name: [] for s in everyone} for setting in ("reset", "no reset")}
            reset = gpu.reset_persisting_l2  # what a cold sample calls first (measure.own_lines_only)
            try:
                for _ in range(PASSES):
                    for setting in ("no reset", "reset"):
                        gpu.reset_persisting_l2 = reset if setting == "reset" else (lambda: None)
                        for s in everyone:
                            samples[setting][s.name] += s.cold(PER_ROUND)
            finally:
                gpu.reset_persisting_l2 = reset
                copy.close()
        table = {setting: {n: measure.Timing.from_samples("cold", v).to_dict() for n, v in by.items()}
                 for setting, by in samples.items()}
        rows.append({"op": name, "m": m, "d": d, "kernel": subject.bound.kernel.name, "missing": missing,
                     "copy": copy_is, "cold": table})
        line = "  ".join(f"{n} {table['no reset'][n]['median_us']:.2f}±{table['no reset'][n]['spread_us']:.2f}"
                         f" → {table['reset'][n]['median_us']:.2f}±{table['reset'][n]['spread_us']:.2f}" for n in table["reset"])
        print(f"{name} {m}x{d} cold, no reset → reset: {line}", flush=True)
    doc = {"what": "each subject timed cold without and with the persisting L2 lines reset before the flush",
           "method": {"passes": PASSES, "per_round": PER_ROUND, "hold_us": measure.HOLD_US,
                      "cold": f"{measure.flush_bytes() >> 20} MB written before each launch, behind a hold; "
                              "with cuCtxResetPersistingL2Cache called before each sample, or not"},
           **provenance(device), "shapes": rows}
    out = write_result(device, "cold_flush_probe.json", json.dumps(doc, indent=1) + "\n")
    print(f"wrote {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
