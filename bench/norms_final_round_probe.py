"""RMSNorm 4096×8192 bf16 in one process, timed by the tuner's final round and by bench/norms.py's row, in turn:
is the disagreement between the two the method's or the process's?

The tuner's final round put Triton 2.6% behind the stored winner hot; bench/norms.py, in every fresh process and at
five layouts of memory, 2.0–2.8% ahead of it (bench/NOTES.md, norms §18). Here one process runs the final round
(`GpuBackend.final`) over the stored winner, the Triton peer's shape in our templates (256 threads, plain loads,
4 blocks per SM: Triton's 8 warps hold 60 registers, 4 blocks per SM) and the winner's shape with plain loads;
then bench/norms.py's row (`bench_shape`) for each of the three; then the final round again.
Writes bench/results/<gpu>/norms_final_round_probe.json.

    python bench/norms_final_round_probe.py
"""
import dataclasses
import json
import sys

sys.path.insert(0, "bench")
from _common import provenance, stored_case, write_result
from norms import bench_shape

from mage_gen.backends import GpuBackend
from mage_gen.variants import build

M, D = 4096, 8192


def final_round(op, shape, run, variants: dict, label: str) -> dict:
    timings, configs, dropped = GpuBackend(op, shape, run, seed=0).final(list(variants.values()))
    names = {v.source.kernel_name: n for n, v in variants.items()}
    out = {names.get(k, k): {m: t.to_dict() for m, t in by.items()} for k, by in timings.items()}
    for n, by in out.items():
        print(f"{label:14} {n:14} hot {by['hot']['median_us']:7.2f}±{by['hot']['spread_us']:.2f}  "
              f"cold {by['cold']['median_us']:7.2f}±{by['cold']['spread_us']:.2f}", flush=True)
    return {"timings": out, "peer_configs": configs, "dropped": dropped}


def main() -> None:
    device, op, shape, run, stored = stored_case("rmsnorm", M, D)
    configs = {"stored": stored,
               "triton shape": dataclasses.replace(stored, threads=256, hint="none", l2_ahead=0),
               "plain": dataclasses.replace(stored, hint="none", l2_ahead=0)}
    variants = {n: build(op, shape, p, device.arch) for n, p in configs.items()}
    doc = {"what": __doc__.split("\n\n")[0], "m": M, "d": D, "dtype": "bfloat16",
           "kernels": {n: v.source.kernel_name for n, v in variants.items()}, **provenance(device)}
    doc["final round, first"] = final_round(op, shape, run, variants, "final 1")
    rows = {}
    for n, p in configs.items():
        row = bench_shape(op, shape, M, p, device)
        if "timings" not in row:  # failed its gate at some placement: nothing of it was timed
            rows[n] = {"gate": row["gate"]}
            print(f"bench row      {n:14} failed its gate: {row['gate'].get('reason')}", flush=True)
            continue
        rows[n] = {"timings": row["timings"], "by_placement": row.get("by_placement")}
        print("bench row      " + f"{n:14} " + "  ".join(f"{s} {t['hot']['median_us']:.2f}/{t['cold']['median_us']:.2f}"
                                                      for s, t in row["timings"].items()), flush=True)
    doc["bench rows"] = rows
    doc["final round, again"] = final_round(op, shape, run, variants, "final 2")
    write_result(device, "norms_final_round_probe.json", json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
