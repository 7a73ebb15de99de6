"""RMSNorm d = 8192 bf16: is Inductor's lead at 16384 rows where its y lies? bench/norms.py's Inductor peer
writes y into memory of its own; our kernel and the Triton peer write the placement's y (norms §19). Here, in one
process and the same rounds: the stored winner, Inductor as the bench makes it, and the same eager code compiled
with its result copied into the placement's y (`y.copy_(F.rms_norm(...))`, which Inductor may store directly;
the CUDA kernels one call launches are listed to show whether it does), each gated on the same inputs. (Run before
the bench's Inductor peer itself wrote the placement's y, which it has done since: run again, the two Inductor rows
are the same kernel writing the same y.)
Writes bench/results/<gpu>/norms_inductor_output_probe.json.

    python bench/norms_inductor_output_probe.py
"""
import json
import sys

sys.path.insert(0, "bench")
import torch
from _beside_copy import winner_beside_peers
from _common import cuda_kernels_of, provenance, stored_case, write_result

from mage_gen.dtypes import dtype as element_type
from mage_gen.measure import interleave
from mage_gen.peers import TorchSubject, on_gpu

SHAPES = ((16384, 8192), (4096, 8192))
ROUNDS, PER_ROUND = 6, 6


def main() -> None:
    doc, device = {"what": __doc__.split("\n\n")[0], "shapes": {}}, None
    for m, d in SHAPES:
        device, op, shape, run, _ = stored_case("rmsnorm", m, d)
        with winner_beside_peers(op, shape, run, device) as (bench, subject, peers, missing):
            place = bench.placement(0)
            ins, outs = place.input_pointers(), place.output_pointers()
            bf16 = element_type("bfloat16")
            x, w, y = on_gpu(ins["x"], (m, d), bf16), on_gpu(ins["w"], (d,), bf16), on_gpu(outs["y"], (m, d), bf16)
            eps = float(op.scalars(shape, run)["eps"])
            inductor = next(p for p in peers if p.name == "inductor")
            triton = next(p for p in peers if p.name == "triton")
            torch._dynamo.reset()
            into = torch.compile(lambda x, w, y: y.copy_(torch.nn.functional.rms_norm(x, (d,), w, eps)),
                                 dynamic=False, fullgraph=True)
            shared = TorchSubject("inductor into y", lambda: into(x, w, y))
            y.fill_(float("nan"))
            shared.run()
            torch.cuda.synchronize()
            error, reason = bench.check_tensor("y", y)
            row = {"gate of inductor into y": {"error": error, "reason": reason}, "peers_missing": missing,
                   "kernels per call": {"inductor": cuda_kernels_of(inductor.run),
                                        "inductor into y": cuda_kernels_of(shared.run)}}
            print(f"{m}x{d}: inductor into y gate {error:.2e} {reason or 'passed'}; kernels "
                  f"{row['kernels per call']}", flush=True)
            subjects = [subject, inductor, triton] + ([] if reason else [shared])
            try:
                for method in ("hot", "cold"):
                    table = interleave(subjects, method, ROUNDS, PER_ROUND)
                    row[method] = {n: t.to_dict() for n, t in table.items()}
                    print(f"{m}x{d} {method}: " + "  ".join(f"{n} {t.median_us:.2f}±{t.spread_us:.2f}"
                                                          for n, t in table.items()), flush=True)
            finally:
                shared.close()
        doc["shapes"][f"{m}x{d}"] = row
    doc.update(provenance(device))
    write_result(device, "norms_inductor_output_probe.json", json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
