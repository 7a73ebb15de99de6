"""RMSNorm d = 8192 bf16: is Inductor's lead at 16384 rows where its y lies? bench/norms.py's Inductor peer
writes y into memory of its own; our kernel and the Triton peer write the placement's y (norms §19). Here, in one
process and the same rounds: the stored winner, Inductor as the bench makes it, and the same eager code compiled
with its result copied into the placement's y (`y.copy_(F.rms_norm(...))`, which Inductor may store directly;
the CUDA kernels one call launches are listed to show whether it does), each gated on the same inputs.
Writes bench/results/<gpu>/norms_inductor_output_probe.json.

    python bench/norms_inductor_output_probe.py
"""
import json
import sys

sys.path.insert(0, "bench")
import torch
from _common import cuda_kernels_of, provenance, stored_case, write_result

from mage_gen.dtypes import dtype as element_type
from mage_gen.measure import Bench, interleave
from mage_gen.peers import TorchSubject, make_peers, on_gpu
from mage_gen.variants import build

SHAPES = ((16384, 8192), (4096, 8192))
ROUNDS, PER_ROUND = 6, 6


def main() -> None:
    doc, device = {"what": __doc__.split("\n\n")[0], "shapes": {}}, None
    for m, d in SHAPES:
        device, op, shape, run, stored = stored_case("rmsnorm", m, d)
        variant = build(op, shape, stored, device.arch)
        bench = Bench(op, shape, run, seed=m + d)
        kernel = bench.load(variant)
        subject, checked = bench.checked_subject(variant, kernel, name="mage-gen", placement=0)
        assert subject is not None, checked.reason
        place = bench.placement(0)
        ins, outs = place.input_pointers(), place.output_pointers()
        bf16 = element_type("bfloat16")
        x = on_gpu(ins["x"], (m, d), bf16)
        w = on_gpu(ins["w"], (d,), bf16)
        y = on_gpu(outs["y"], (m, d), bf16)
        eps = float(op.scalars(shape, run)["eps"])
        peers, missing = make_peers(op, shape, run, subject.bound.inputs, None, check=bench.check_tensor,
                                    inductor=True, device_inputs=ins, device_outputs=outs)
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
        row = {"gate of inductor into y": {"error": error, "reason": reason},
               "kernels per call": {"inductor": cuda_kernels_of(inductor.run),
                                     "inductor into y": cuda_kernels_of(shared.run)}}
        print(f"{m}x{d}: inductor into y gate {error:.2e} {reason or 'passed'}; kernels {row['kernels per call']}",
              flush=True)
        subjects = [subject, inductor, triton] + ([] if reason else [shared])
        for method in ("hot", "cold"):
            table = interleave(subjects, method, ROUNDS, PER_ROUND)
            row[method] = {n: t.to_dict() for n, t in table.items()}
            print(f"{m}x{d} {method}: " + "  ".join(f"{n} {t.median_us:.2f}±{t.spread_us:.2f}"
                                                  for n, t in table.items()), flush=True)
        doc["shapes"][f"{m}x{d}"] = row
        for s in [subject, *peers, shared]:
            s.close()
        kernel.unload()
        bench.free_placements()
    doc.update(provenance(device))
    write_result(device, "norms_inductor_output_probe.json", json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
