"""Where a decoder layer's GPU time goes, kernel by kernel, in each of bench/decoder_layer.py's ways (eager, two
torch.compile modes, the patched layer compiled): each way's output is checked against the layer in float32 first,
then one forward is captured in a CUDA graph, as the bench times it, and the graph is replayed FORWARDS times under
torch.profiler: its kernels' (and memsets') GPU time is summed by name, per forward, and beside it how many there
are, the time the GPU was busy with them and the span from the first one's start to the last one's end, whose
difference is the gaps between them. The question it answers: which kernels, and how many, make a patched layer
slower or faster than the best compiled mode. Writes bench/results/<gpu>/decoder_layer_kernels.json.

    python -m bench.probes.decoder_layer_kernels --tokens 128 --tokens 2048
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
from torch.profiler import ProfilerActivity, profile

from mage_gen import gpu

from bench._common import provenance, write_result
from bench.decoder_layer import MODELS, TOLERANCE, WAYS, make_ways, relative_error

FORWARDS = 20
WARMUP = 3


def kernels_of(fn, args: tuple) -> dict:
    """One forward of `fn` captured in a CUDA graph and replayed FORWARDS times under the profiler: per forward, the
    GPU time of each kernel by name (the longest first), their count, the time the GPU was busy with them and the
    span from the first start to the last end."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the default stream, as graph capture requires
        for _ in range(WARMUP):
            fn(*args)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn(*args)
    graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(FORWARDS):
            graph.replay()
        torch.cuda.synchronize()
    on_gpu = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    by_name: dict[str, list[float]] = {}
    for event in on_gpu:
        by_name.setdefault(event.name, []).append(event.time_range.elapsed_us())
    rows = sorted(({"kernel": name, "us_per_forward": sum(times) / FORWARDS, "launches_per_forward": len(times) / FORWARDS}
                   for name, times in by_name.items()), key=lambda r: -r["us_per_forward"])
    busy = sum(r["us_per_forward"] for r in rows)
    span = ((max(e.time_range.end for e in on_gpu) - min(e.time_range.start for e in on_gpu)) / FORWARDS
            if on_gpu else 0.0)
    return {"us_per_forward": busy, "kernels_per_forward": len(on_gpu) / FORWARDS, "span_us_per_forward": span,
            "gaps_us_per_forward": span - busy, "kernels": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=list(MODELS), default="llama3-8b")
    parser.add_argument("--tokens", type=int, action="append", required=True)
    parser.add_argument("--way", action="append", help="profile only these ways (default: all); max-autotune's "
                                                       "compiles take minutes where Inductor's cache is cold")
    args = parser.parse_args()
    if set(args.way or ()) - set(WAYS):
        parser.error(f"--way takes {', '.join(map(repr, WAYS))}")
    device = gpu.open_device()
    rows = []
    for tokens in args.tokens:
        ways, inputs, expected, routes = make_ways(args.model, tokens)
        row = {"tokens": tokens, "routes": {"linear": routes.linear, "norm": routes.norm}, "ways": {}}
        with torch.inference_mode():
            for way, fn in ways.items():
                if args.way and way not in args.way:
                    continue
                error = relative_error(fn(*inputs), expected)
                if not error <= TOLERANCE:
                    row["ways"][way] = {"error": f"relative error {error:.3g} > {TOLERANCE}; not profiled"}
                    continue
                row["ways"][way] = {"relative_error_vs_float32": error, **kernels_of(fn, inputs)}
                top = row["ways"][way]["kernels"][:8]
                got = row["ways"][way]
                print(f"{args.model} {tokens} {way}: {got['kernels_per_forward']:.0f} kernels, {got['us_per_forward']:.1f} "
                      f"µs busy in a span of {got['span_us_per_forward']:.1f} a forward; "
                      + "; ".join(f"{r['kernel'][:60]} {r['us_per_forward']:.1f}" for r in top), flush=True)
        rows.append(row)
        torch.cuda.empty_cache()
        doc = {"what": f"a {args.model} layer's kernels, GPU time per forward by name, in each way of "
                       "bench/decoder_layer.py, recorded by bench/probes/decoder_layer_kernels.py",
               "method": f"one forward captured in a CUDA graph after {WARMUP} warm-up forwards, replayed {FORWARDS} "
                         f"times under torch.profiler; each way checked against float32 first (relative norm ≤ "
                         f"{TOLERANCE}); span: the first kernel's start to the last one's end over the replays, a "
                         "forward's share",
               **provenance(device), "rows": rows}
        out = write_result(device, "decoder_layer_kernels.json", json.dumps(doc, indent=1) + "\n")
    print(f"wrote {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
