"""What a timed sample counts besides the GPU's work: each sample taken with and without a hold before it.

A start event recorded on an idle GPU is stamped at once; a sample then also counts the host's time to reach the
launch (cuda-python's cuGraphLaunch or cuLaunchKernel, torch's graph replay, Triton's launcher, Inductor's
guards), where a hold (mage_gen.measure.hold: one thread spinning on the global timer) keeps the GPU busy until
the host has queued the whole sample. At three bf16 norm shapes, the stored winner, torch, Inductor and Triton,
gated on one copy of the inputs (Triton writing the kernel's y), are timed hot and cold in alternating passes:
without a hold, each sample waited on before the next (as every figure before it was taken), and as measure.py
now times them. Writes
bench/results/<gpu>/timing_hold_probe.json.

    python bench/timing_hold_probe.py
"""
import json
import sys

sys.path.insert(0, "bench")
from _beside_copy import winner_beside_peers
from _common import provenance, write_result

from mage_gen import gpu, measure, peers
from mage_gen.ops import get_op

SHAPES = [("layernorm", 4096, 768), ("rmsnorm", 4096, 768), ("rmsnorm", 4096, 8192), ("rmsnorm", 16384, 8192)]
PASSES, PER_ROUND = 3, 5  # passes of each setting, alternating; a round of PER_ROUND samples per subject in each


def unheld_hot(s):
    """A sample as every figure before the hold was taken: start event, one graph replay, stop event, wait."""
    def take(replays: int) -> list[float]:
        out = []
        for _ in range(replays):
            if isinstance(s, measure.KernelSubject):
                s.events.start(s.stream)
                s._graph.launch(s.stream)
                s.events.stop(s.stream)
                out.append(s.events.elapsed_us() / measure.HOT_LAUNCHES_PER_GRAPH)
            else:
                s._begin.record()
                s._graph.replay()
                s._end.record()
                s._end.synchronize()
                out.append(s._begin.elapsed_time(s._end) * 1000.0 / measure.HOT_LAUNCHES_PER_GRAPH)
        return out
    return take


def unheld_cold(s):
    """Likewise cold: the flush, start event, launch, stop event, wait."""
    def take(count: int) -> list[float]:
        out = []
        for i in range(count):
            if isinstance(s, measure.KernelSubject):
                measure.flush_buffer().fill32(i, s.stream.handle)
                s.events.start(s.stream)
                s.bound.enqueue(s.stream.handle)
                s.events.stop(s.stream)
                out.append(s.events.elapsed_us())
            else:
                peers.torch_flush_buffer().zero_()
                s._begin.record()
                s.run()
                s._end.record()
                s._end.synchronize()
                out.append(s._begin.elapsed_time(s._end) * 1000.0)
        return out
    return take


def main() -> None:
    device = gpu.open_device()
    rows = []
    for name, m, d in SHAPES:
        op = get_op(name)
        shape = op.shape(d=d, dtype="bf16")
        run = {"m": m}
        with winner_beside_peers(op, shape, run, device) as (bench, subject, others, missing):
            everyone = [subject, *others]
            for s in everyone:
                s.hot(1)  # graphs captured
            samples = {setting: {method: {s.name: [] for s in everyone} for method in ("hot", "cold")}
                       for setting in ("without", "with")}
            for _ in range(PASSES):
                for setting in ("without", "with"):
                    for method in ("hot", "cold"):
                        for s in everyone:
                            take = (s.hot if method == "hot" else s.cold) if setting == "with" else \
                                (unheld_hot if method == "hot" else unheld_cold)(s)
                            samples[setting][method][s.name] += take(PER_ROUND)
        table = {setting: {method: {n: measure.Timing.from_samples(method, v).to_dict() for n, v in by.items()}
                           for method, by in methods.items()} for setting, methods in samples.items()}
        rows.append({"op": name, "m": m, "d": d, "kernel": subject.bound.kernel.name, "missing": missing,
                     "timings": table})
        for method in ("hot", "cold"):
            line = "  ".join(f"{n} {table['without'][method][n]['median_us']:.2f}±{table['without'][method][n]['spread_us']:.2f}"
                             f" → {table['with'][method][n]['median_us']:.2f}±{table['with'][method][n]['spread_us']:.2f}"
                             for n in table["with"][method])
            print(f"{name} {m}x{d} {method}: {line}", flush=True)
    doc = {"what": "each subject timed as before the hold (without) and with it (with), in alternating passes",
           "method": {"hold_us": measure.HOLD_US, "passes": PASSES, "per_round": PER_ROUND,
                      "hot": f"{measure.HOT_LAUNCHES_PER_GRAPH} launches per CUDA graph; with the hold, a round's "
                             "replays queued back to back behind it, an event between each",
                      "cold": f"{measure.flush_bytes() >> 20} MB written before each launch; with the hold, behind it"},
           **provenance(device), "shapes": rows}
    out = write_result(device, "timing_hold_probe.json", json.dumps(doc, indent=1) + "\n")
    print(f"wrote {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
