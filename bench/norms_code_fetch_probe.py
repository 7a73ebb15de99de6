"""Norms: is what a cold launch of the `wide` kernels pays beyond Inductor's their code, fetched from DRAM?

In bench/norms.py's runs (norms §24), where Inductor's two-pass kernel is the best peer, our kernel's cold time
exceeds its hot time by 0.2-0.8 µs more than Inductor's does (RMSNorm 16384×8192: 1.75 / 1.80 / 2.10 µs against
1.33 / 1.61 / 1.33 in three runs; with the residual at 4096×4096, `wide` against the same structure: 2.27-2.31
against 1.87-2.02), and it is that, not the hot time, that leaves the cold ratio at 1.000. A cold sample follows a
256 MB flush, so its code is in no cache: every SM fetches it from DRAM as the launch starts, and our kernels are
4-6.5 KB of SASS. Here each stored kernel is timed cold three ways, interleaved sample by sample: as
bench/norms.py times it; with a launch of the same kernel on a one-row problem of its own buffers between the flush
and the timed launch (its code, and nothing of x, w or y, then in L2 and the SMs' caches); and with a hold of the
GPU of about as long in that place instead (what waiting between flush and launch does by itself). Writes
bench/results/<gpu>/norms_code_fetch_probe.json.

    python bench/norms_code_fetch_probe.py
"""
import json
import statistics
import sys

import numpy as np

sys.path.insert(0, "bench")
from _common import provenance, stored_case, write_result

from mage_gen import gpu
from mage_gen.measure import Bench, Bound, hold_kernel, flush_buffer, hold, own_lines_only
from mage_gen.timing import Timing
from mage_gen.variants import build

# (op, residual, rows, d)
CASES = (("rmsnorm", False, 16384, 8192), ("rmsnorm", True, 4096, 4096), ("rmsnorm", True, 16384, 8192),
         ("rmsnorm", False, 4096, 8192), ("rmsnorm", False, 32768, 4096))
SAMPLES = 60  # per way
GAP_NS = 4000  # the hold in place of the one-row launch: about as long as that launch takes


def main() -> None:
    doc, device = {"what": __doc__.split("\n\n")[0], "samples": SAMPLES, "gap_ns": GAP_NS, "cases": {}}, None
    for op_name, residual, m, d in CASES:
        device, op, shape, run, stored = stored_case(op_name, m, d, residual=residual)
        label = f"{op_name}{'+res' if residual else ''}:{m}x{d}"
        variant = build(op, shape, stored, device.arch)
        bench = Bench(op, shape, run, seed=m + d)
        kernel = bench.load(variant)
        subject, checked = bench.checked_subject(variant, kernel, name="stored", share_inputs=True)
        if subject is None:
            print(f"{label}: failed the gate: {checked.reason}", flush=True)
            kernel.unload()
            continue
        one_row = Bound(op, shape, stored, kernel, {"m": 1}, op.make_inputs(shape, {"m": 1}, np.random.default_rng(1)))
        stream, flush, events = bench.stream, flush_buffer(), gpu.EventPair()
        ways = {"as timed": None,
                "after a one-row launch": lambda: one_row.enqueue(stream.handle),
                "after a hold": lambda: hold_kernel().launch((1, 1, 1), (1, 1, 1), 0,
                                                              gpu.KernelArgs([("i64", GAP_NS)]), stream.handle)}
        samples = {w: [] for w in ways}
        try:
            hot = Timing.from_samples("hot", subject.hot(40))
            for i in range(SAMPLES):
                for way, before in ways.items():
                    own_lines_only()
                    hold(stream.handle)
                    flush.fill32(i, stream.handle)
                    if before is not None:
                        before()
                    events.start(stream)
                    subject.bound.enqueue(stream.handle)
                    events.stop(stream)
                    samples[way].append(events.elapsed_us())
        finally:
            events.destroy()
            one_row.free()
            subject.close()
            kernel.unload()
        if bench.inputs_changed():
            raise SystemExit(f"{label}: the kernel wrote into its inputs")
        cold = {w: Timing.from_samples("cold", v) for w, v in samples.items()}
        doc["cases"][label] = {"kernel": variant.source.kernel_name, "hot": hot.to_dict(),
                               "cold": {w: t.to_dict() for w, t in cold.items()},
                               "cubin_bytes": len(variant.compiled.cubin)}
        print(f"{label:22} {variant.source.kernel_name:62} hot {hot.median_us:7.2f}±{hot.spread_us:.2f}  "
              + "  ".join(f"{w} {t.median_us:7.2f}±{t.spread_us:.2f}" for w, t in cold.items()), flush=True)
        print(f"{'':22} cold − hot: " + ", ".join(f"{w} {t.median_us - hot.median_us:+.2f}" for w, t in cold.items())
              + f"; the one-row launch against the hold {statistics.median(samples['after a one-row launch']) - statistics.median(samples['after a hold']):+.2f} µs",
              flush=True)
    doc.update(provenance(device))
    write_result(device, "norms_code_fetch_probe.json", json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
