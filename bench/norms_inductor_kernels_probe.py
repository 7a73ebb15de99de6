"""The CUDA kernels one call of bench/norms.py's Inductor peer launches, for each norm with and without the
residual, at 4096×4096 bf16: the peer copies its results into the kernel's outputs (peers.make_peers), and this
shows that Inductor stores them there from its one fused kernel rather than adding a copy.
Writes bench/results/<gpu>/norms_inductor_kernels_probe.json.

    python bench/norms_inductor_kernels_probe.py
"""
import json
import sys

sys.path.insert(0, "bench")
from _common import cuda_kernels_of, provenance, write_result

from mage_gen import gpu
from mage_gen.measure import Bench
from mage_gen.ops import get_op
from mage_gen.peers import make_peers

M, D = 4096, 4096


def main() -> None:
    device = gpu.open_device()
    doc = {"what": __doc__.split("\n\n")[0], "m": M, "d": D, "calls": {}}
    for name in ("layernorm", "rmsnorm"):
        for residual in (False, True):
            op = get_op(name)
            shape = op.shape(d=D, dtype="bf16", residual=residual)
            run = {"m": M}
            bench = Bench(op, shape, run, seed=0)
            place = bench.placement(0)
            peers, missing = make_peers(op, shape, run, bench.timing_inputs(), None, check=bench.check_tensor,
                                        inductor=True, device_inputs=place.input_pointers(),
                                        device_outputs=place.output_pointers())
            inductor = next(p for p in peers if p.name == "inductor")
            inductor.run()  # compiled and warm: the call listed below launches what every timed call does
            kernels = cuda_kernels_of(inductor.run)
            key = name + ("+res" if residual else "")
            doc["calls"][key] = {"kernels": kernels, "config": inductor.config, "missing": missing}
            print(f"{key}: {kernels} {inductor.config}", flush=True)
            for p in peers:
                p.close()
            bench.free_placements()
    doc.update(provenance(device))
    write_result(device, "norms_inductor_kernels_probe.json", json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
