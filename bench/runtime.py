"""What calling a tuned kernel from PyTorch costs beyond the kernel.

- Eager, 4096×768: 1000 calls in a loop synchronized once, wall time per call, interleaved rounds of
  torch.nn.functional.layer_norm, mage_gen.torch.layer_norm (eager fast path) and
  torch.ops.mage_gen.layer_norm (the dispatcher's path, as torch.compile's graph calls it).
- In a CUDA graph: mage_gen.torch.layer_norm captured by torch against the same kernel launched raw by
  mage-gen's own timing (measure.KernelSubject), hot and cold, interleaved: the same within spread.
- The command line's start-up: wall time of `mage-gen --help`, `inspect` and `emit --config`.
Writes bench/results/<gpu>/runtime.json.

    python -m bench.runtime
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import time

import torch

import mage_gen.torch as mt
from mage_gen import gpu, runtime
from mage_gen.measure import Bench, interleave
from mage_gen.ops import get_op
from mage_gen.peers import TorchSubject
from mage_gen.store import load_winner
from mage_gen.timing import Timing
from mage_gen.variants import build

from bench._common import provenance, timing_method, write_result

M, D = 4096, 768
CALLS, ROUNDS = 1000, 7
ROUNDS_GRAPH, PER_ROUND = 5, 6


def eager_per_call(fn) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(CALLS):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / CALLS * 1e6


def eager(x, w, b) -> dict:
    y = torch.empty_like(x)
    calls = {"torch F.layer_norm": lambda: torch.nn.functional.layer_norm(x, (D,), w, b, 1e-5),
             "mage_gen.torch.layer_norm": lambda: mt.layer_norm(x, w, b, 1e-5),
             "mage_gen.torch.layer_norm out=": lambda: mt.layer_norm(x, w, b, 1e-5, out=y),
             "torch.ops.mage_gen.layer_norm": lambda: torch.ops.mage_gen.layer_norm(x, w, b, 1e-5)}
    for fn in calls.values():
        eager_per_call(fn)  # warm-up: kernels loaded, caches filled
    samples = {name: [] for name in calls}
    for _ in range(ROUNDS):
        for name, fn in calls.items():
            samples[name].append(eager_per_call(fn))
    return {name: Timing.from_samples("eager wall", values).to_dict() for name, values in samples.items()}


def breakdown(x, w, b) -> dict:
    """Where an eager call's time goes: each step alone, CALLS times, synchronized once (median of ROUNDS)."""
    from mage_gen.torch import check_norm, is_eager, launches

    y = torch.empty_like(x)
    mt.layer_norm(x, w, b)
    prepared = launches[(x.get_device(), "layernorm", D, M)]
    stream = torch.cuda.current_stream().cuda_stream
    values = (y.data_ptr(), x.data_ptr(), w.data_ptr(), b.data_ptr(), M, 1e-5)
    steps = {"wrapper checks (is_eager + check_norm)": lambda: (is_eager(x, w, b),
                                                              check_norm("mage_gen.torch.layer_norm", x, w, b)),
             "torch.empty_like(x)": lambda: torch.empty_like(x),
             "Prepared.launch (alignment, pack, cuLaunchKernel)": lambda: prepared.launch(values, stream),
             "torch stream lookup": lambda: torch._C._cuda_getCurrentRawStream(0),
             "whole mage_gen.torch.layer_norm": lambda: mt.layer_norm(x, w, b, 1e-5)}
    for fn in steps.values():
        eager_per_call(fn)
    samples = {name: [] for name in steps}
    for _ in range(ROUNDS):
        for name, fn in steps.items():
            samples[name].append(eager_per_call(fn))
    return {name: Timing.from_samples("eager wall", values).to_dict() for name, values in samples.items()}


def in_graph(op, device) -> dict:
    shape, run = op.shape(d=D), {"m": M}
    params = load_winner(op, shape, device.name, run, l2_bytes=device.l2_bytes).params
    variant = build(op, shape, params, device.arch)
    bench = Bench(op, shape, run, seed=11)
    kernel = bench.load(variant)
    raw, checked = bench.checked_subject(variant, kernel, name="raw kernel")
    assert raw is not None, checked.reason
    x, w, b = (torch.from_numpy(bench.timing_inputs()[k]).cuda() for k in ("x", "w", "b"))
    y, y_raw = torch.empty_like(x), torch.empty_like(x)

    def raw_in_torch_graph():
        runtime.layer_norm(y_raw.data_ptr(), x.data_ptr(), w.data_ptr(), b.data_ptr(), M, D, 1e-5,
                           torch.cuda.current_stream().cuda_stream)
        return y_raw

    # Captured in a graph only the kernel nodes remain, whatever the Python around them cost. The like-for-like
    # comparison is the raw kernel captured and replayed by the same torch harness; mage-gen's own graph
    # ("raw kernel", measure.KernelSubject) is beside it. A functional call allocates its output: the 20
    # launches of a captured graph then write 20 buffers where out= rewrites one.
    wrapped = [TorchSubject("raw kernel, torch graph", raw_in_torch_graph),
               TorchSubject("mage_gen.torch.layer_norm out=", lambda: mt.layer_norm(x, w, b, 1e-5, out=y)),
               TorchSubject("mage_gen.torch.layer_norm", lambda: mt.layer_norm(x, w, b, 1e-5))]
    errors = {}
    for subject in wrapped:
        errors[subject.name], reason = bench.check_tensor("y", subject.run())
        assert not reason, reason
    try:
        hot = interleave([raw, *wrapped], "hot", ROUNDS_GRAPH, PER_ROUND)
        cold = interleave([raw, *wrapped], "cold", ROUNDS_GRAPH, PER_ROUND)
    finally:
        raw.close()
        kernel.unload()
    return {"kernel": variant.source.kernel_name, "errors": errors,
            "timings": {n: {"hot": hot[n].to_dict(), "cold": cold[n].to_dict()} for n in hot},
            "ties_with_raw": {s.name: {raw_name: {"hot": hot[raw_name].ties_with(hot[s.name]),
                                                  "cold": cold[raw_name].ties_with(cold[s.name])}
                                       for raw_name in ("raw kernel", "raw kernel, torch graph") if raw_name != s.name}
                              for s in wrapped}}


def cli_wall() -> dict:
    out = tempfile.mkdtemp()
    commands = {"--help": ["--help"], "inspect": ["inspect", "layernorm", "--d", "768"],
                "emit --config": ["emit", "layernorm", "--d", "768", "--config", "threads=128", "-o", out]}
    result = {}
    for name, args in commands.items():
        times = []
        for _ in range(5):
            start = time.perf_counter()
            subprocess.run([sys.executable, "-m", "mage_gen", *args], check=True, capture_output=True)
            times.append(time.perf_counter() - start)
        result[name] = {"median_s": statistics.median(times), "samples_s": times}
    return result


def main() -> None:
    op = get_op("layernorm")
    device = gpu.open_device()
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(M, D, device="cuda", generator=g)
    w, b = torch.randn(D, device="cuda", generator=g), torch.randn(D, device="cuda", generator=g)
    ref = torch.nn.functional.layer_norm(x.double(), (D,), w.double(), b.double(), 1e-5)
    err = float(torch.linalg.vector_norm(mt.layer_norm(x, w, b).double() - ref) / torch.linalg.vector_norm(ref))
    assert err <= op.tolerance, err
    doc = {
        "what": "mage_gen.torch.layer_norm's cost beyond the kernel, 4096×768 fp32, recorded by bench/runtime.py",
        "method": {"eager": f"{CALLS} calls in a Python loop, synchronized once, wall time per call; median of "
                            f"{ROUNDS} interleaved rounds (spread = interquartile range)",
                   "graph": "the wrapped call captured in a torch CUDA graph vs the raw kernel in mage-gen's own "
                            "graph: " + timing_method(ROUNDS_GRAPH, PER_ROUND)["hot"],
                   "cli": "wall time of a fresh `python -m mage_gen ...` process, median of 5"},
        **provenance(device),
        "eager_check_error": err,
        "eager_us_per_call": eager(x, w, b),
        "eager_breakdown_us_per_call": breakdown(x, w, b),
        "graph": in_graph(op, device),
        "cli_seconds": cli_wall(),
    }
    out = write_result(device, "runtime.json", json.dumps(doc, indent=1) + "\n")
    for name, t in doc["eager_us_per_call"].items():
        print(f"eager {name:32} {t['median_us']:7.2f} µs/call ± {t['spread_us']:.2f}")
    for name, t in doc["eager_breakdown_us_per_call"].items():
        print(f"  step {name:48} {t['median_us']:7.2f} µs/call")
    for name, t in doc["graph"]["timings"].items():
        print(f"graph {name:32} hot {t['hot']['median_us']:6.2f} ± {t['hot']['spread_us']:.2f}  "
              f"cold {t['cold']['median_us']:6.2f}")
    print(f"graph ties with the raw kernel: {doc['graph']['ties_with_raw']}")
    for name, t in doc["cli_seconds"].items():
        print(f"cli {name:16} {t['median_s']:.3f} s")
    print(f"wrote {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
