"""Where a decoder layer's GPU time goes, kernel by kernel, in each of bench/decoder_layer.py's ways (eager, two
torch.compile modes, the patched layer compiled): each way's output is checked against the layer in float32 first,
then the way runs FORWARDS times under torch.profiler and its kernels' GPU time is summed by name, per forward.
The question it answers: which kernels make a patched layer slower or faster than the best compiled mode. Writes
bench/results/<gpu>/decoder_layer_kernels.json.

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
from bench.decoder_layer import MODELS, TOLERANCE, make_ways, relative_error

FORWARDS = 20
WARMUP = 3


def kernels_of(fn, args: tuple) -> dict:
    """GPU time per forward of each kernel `fn` launches, the longest first, and their sum."""
    for _ in range(WARMUP):
        fn(*args)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(FORWARDS):
            fn(*args)
        torch.cuda.synchronize()
    rows = []
    for event in prof.key_averages():
        total = getattr(event, "self_device_time_total", None)
        total = event.self_cuda_time_total if total is None else total
        if total > 0:
            rows.append({"kernel": event.key, "us_per_forward": total / FORWARDS, "launches_per_forward":
                         event.count / FORWARDS})
    rows.sort(key=lambda r: -r["us_per_forward"])
    return {"us_per_forward": sum(r["us_per_forward"] for r in rows), "kernels": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=list(MODELS), default="llama3-8b")
    parser.add_argument("--tokens", type=int, action="append", required=True)
    args = parser.parse_args()
    device = gpu.open_device()
    rows = []
    for tokens in args.tokens:
        ways, inputs, expected, routes = make_ways(args.model, tokens)
        row = {"tokens": tokens, "routes": {"linear": routes.linear, "norm": routes.norm}, "ways": {}}
        with torch.inference_mode():
            for way, fn in ways.items():
                error = relative_error(fn(*inputs), expected)
                if not error <= TOLERANCE:
                    row["ways"][way] = {"error": f"relative error {error:.3g} > {TOLERANCE}; not profiled"}
                    continue
                row["ways"][way] = {"relative_error_vs_float32": error, **kernels_of(fn, inputs)}
                top = row["ways"][way]["kernels"][:8]
                print(f"{args.model} {tokens} {way}: {row['ways'][way]['us_per_forward']:.1f} µs of kernels a forward; "
                      + "; ".join(f"{r['kernel'][:60]} {r['us_per_forward']:.1f}" for r in top), flush=True)
        rows.append(row)
        torch.cuda.empty_cache()
        doc = {"what": f"a {args.model} layer's kernels, GPU time per forward by name, in each way of "
                       "bench/decoder_layer.py, recorded by bench/probes/decoder_layer_kernels.py",
               "method": f"torch.profiler over {FORWARDS} forwards after {WARMUP}, each way checked against float32 "
                         f"first (relative norm ≤ {TOLERANCE})",
               **provenance(device), "rows": rows}
        out = write_result(device, "decoder_layer_kernels.json", json.dumps(doc, indent=1) + "\n")
    print(f"wrote {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
