"""RMSNorm 4096×8192 bf16: does Triton's time in a run depend on what else that run made? The tuner's final round
and bench/norms.py's row, in one process, time the same Triton kernel 35.0 and 33.4 µs hot while the same
generated kernels take the same time in both (norms_final_round_probe.json). The row also compiles and times
Inductor; the final round does neither. Here the final round runs three times: as the tuner runs it; after the
Inductor peer was compiled and run but is not timed; with Inductor timed beside the rest. Triton's compiled
kernels (cubin hash, registers) are listed after each, in case a later compile replaced them.
Writes bench/results/<gpu>/norms_inductor_order_probe.json.

    python bench/norms_inductor_order_probe.py
"""
import dataclasses
import functools
import hashlib
import json
import sys

sys.path.insert(0, "bench")
from _common import provenance, stored_case, write_result
from norms_final_round_probe import final_round

import mage_gen.peers as peers
from mage_gen.measure import Bench
from mage_gen.variants import build

M, D = 4096, 8192


def triton_kernels() -> list[dict]:
    """Every compiled kernel of the Triton RMSNorm peer in this process: what a later compile could replace."""
    found = []
    for caches in getattr(peers.triton_rmsnorm, "device_caches", {}).values():
        cache = caches[0] if isinstance(caches, tuple) else caches
        for key, kernel in cache.items():
            try:
                found.append({"key": str(key)[:160], "n_regs": kernel.n_regs, "num_warps": kernel.metadata.num_warps,
                              "cubin_sha1": hashlib.sha1(kernel.asm["cubin"]).hexdigest()[:12]})
            except Exception as exc:  # a kernel not yet initialised, or another Triton's layout: say so
                found.append({"key": str(key)[:160], "error": repr(exc)[:200]})
    return found


def main() -> None:
    device, op, shape, run, stored = stored_case("rmsnorm", M, D)
    configs = {"stored": stored,
               "triton shape": dataclasses.replace(stored, threads=256, hint="none", l2_ahead=0)}
    variants = {n: build(op, shape, p, device.arch) for n, p in configs.items()}
    doc = {"what": __doc__.split("\n\n")[0], "m": M, "d": D, "dtype": "bfloat16",
           "kernels": {n: v.source.kernel_name for n, v in variants.items()}, **provenance(device)}
    doc["as the tuner runs it"] = final_round(op, shape, run, variants, "tuner")
    doc["triton kernels, first"] = triton_kernels()

    bench = Bench(op, shape, run, seed=0)
    inputs = bench.timing_inputs()
    made, missing = peers.make_peers(op, shape, run, inputs, None, check=bench.check_tensor, inductor=True)
    for s in made:
        s.hot(2)  # compiled and run, then dropped: nothing of it is timed below
        s.close()
    doc["inductor made, untimed"] = {"peers": [s.name for s in made], "missing": missing}
    doc["after inductor was made"] = final_round(op, shape, run, variants, "after inductor")
    doc["triton kernels, after inductor"] = triton_kernels()

    plain = peers.make_peers
    peers.make_peers = functools.partial(plain, inductor=True)
    try:
        doc["with inductor timed"] = final_round(op, shape, run, variants, "inductor timed")
    finally:
        peers.make_peers = plain
    doc["triton kernels, last"] = triton_kernels()
    doc["as the tuner runs it, again"] = final_round(op, shape, run, variants, "tuner again")
    print(json.dumps({k: v for k, v in doc.items() if k.startswith("triton kernels")}, indent=1))
    write_result(device, "norms_inductor_order_probe.json", json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
