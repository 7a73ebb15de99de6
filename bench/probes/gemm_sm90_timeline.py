"""Where a gemm_sm90 launch's time goes, CTA by CTA: each config is built twice, as it is and with `stamps` (every
CTA records the global timer and its SM's clock at its entry, when its threads meet after the setup (the CTA's
barrier, or the cluster's), at the producer's first copy, when consumer 0 first finds a stage full, at the end of
its last main loop and at its end; ops/gemm_sm90.py). Both are gated; the plain one's hot median says what stamping
costs, and the stamped one's records, read after a hot launch (the last of a graph's back-to-back launches, inputs
in L2) and after a cold one (L2 flushed), say how the launch's time divides: how late CTAs start, the setup up to
the threads' meeting and from it to the first copy, the wait for the first stage, the main loops, and what
follows them (the split-K or stream-K sum and the epilogue). Clocks are turned into µs at the rate the global timer
gives over all CTAs together.

    python -m bench.probes.gemm_sm90_timeline --shape 16x4096x4096 \\
        --config bm=64,bn=128,consumers=1,stages=8,split_k=4,grid=SM --served --out gemm_sm90_timeline.json
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import numpy as np

from mage_gen import dispatch, gpu
from mage_gen.errors import MageError
from mage_gen.measure import Bench
from mage_gen.ops import get_op
from mage_gen.ops.gemm_sm90 import STAMP_SLOTS
from mage_gen.store import tuned_shapes
from mage_gen.variants import build

from bench._common import parse_shape, provenance, write_result
from bench.probes.gemm_sm90_configs import parse_config

HOT_REPLAYS = 5
# what each span of a CTA's record runs from and to: (name, slot from, slot to), slots as ops/gemm_sm90.py writes them
SPANS = (("setup: entry to the threads' meeting", 1, 8), ("setup: the meeting to the first copy", 8, 2),
         ("first stage: copy to consumer 0's first full stage", 2, 3),
         ("main loops: first full stage to the last loop's end", 3, 4), ("after the loops: sums and stores", 4, 5),
         ("the CTA: entry to consumer 0's end", 1, 5))


def phases(stamps: np.ndarray, ctas: int) -> dict[str, Any]:
    """The spans of each CTA that ran a unit, in µs (median, min, max over the CTAs), when the CTAs started and
    ended after the first one's start, and the clock rate that turned cycles into µs."""
    rows = stamps[:ctas]
    ran = rows[(rows[:, 2:6] != 0).all(axis=1)]  # pingpong's consumer 0 may have had no unit of its own
    if not len(ran):
        return {"ctas_with_units": 0}
    start = ran[:, 0].astype(np.int64)
    ended = ran[:, 6].astype(np.int64)
    cycles = (ran[:, 5] - ran[:, 1]).astype(np.float64)
    nanoseconds = (ended - start).astype(np.float64)
    per_us = 1000.0 * cycles.sum() / max(nanoseconds.sum(), 1.0)  # cycles a µs, over every CTA at once

    def summary(values: np.ndarray) -> dict[str, float]:
        return {"median": float(np.median(values)), "min": float(values.min()), "max": float(values.max())}

    first = start.min()
    return {
        "ctas_with_units": int(len(ran)), "ctas": ctas, "sm_clock_mhz": per_us,
        "units_per_cta": summary((ran[:, 7] & 0xFFFFFFFF).astype(np.float64)),
        "distinct_sms": int(len(np.unique(ran[:, 7] >> 32))),
        "start_after_first_us": summary((start - first) / 1000.0),
        "end_after_first_start_us": summary((ended - first) / 1000.0),
        **{name: summary((ran[:, b] - ran[:, a]).astype(np.float64) / per_us) for name, a, b in SPANS},
    }


def probe(op, shape, params, device) -> dict[str, Any]:
    bench = Bench(op, shape, {}, seed=shape.m + shape.n + shape.k)
    row: dict[str, Any] = {"kernel": op.kernel_name(shape, params), "config": op.params_to_dict(params)}
    launch = op.geometry(shape, params, {})
    row["grid"] = launch.grid[0]
    for stamped in (False, True):
        p = op.params_from_dict({**op.params_to_dict(params), "stamps": stamped})
        variant = build(op, shape, p, device.arch)
        kernel = bench.load(variant)
        subject, result = bench.checked_subject(variant, kernel)
        label = "stamped" if stamped else "plain"
        row[f"{label}_gate"] = result.to_dict()
        if subject is None:
            kernel.unload()
            row[f"{label}_failed"] = result.reason
            return row
        try:
            hot = subject.hot(HOT_REPLAYS)
            row[f"{label}_hot_us"] = float(np.median(hot))
            if stamped:
                gpu.synchronize()
                row["hot"] = phases(kernel.read_global("mg_stamps", np.uint64).reshape(-1, STAMP_SLOTS), row["grid"])
                row["stamped_cold_us"] = subject.cold(1)[0]
                gpu.synchronize()
                row["cold"] = phases(kernel.read_global("mg_stamps", np.uint64).reshape(-1, STAMP_SLOTS), row["grid"])
        finally:
            subject.close()
            kernel.unload()
    return row


def show(shape_text: str, row: dict[str, Any]) -> None:
    print(f"{shape_text} {row['kernel']} grid {row['grid']}: hot {row.get('plain_hot_us', float('nan')):.2f} µs plain, "
          f"{row.get('stamped_hot_us', float('nan')):.2f} stamped", flush=True)
    for method in ("hot", "cold"):
        got = row.get(method)
        if not got or not got.get("ctas_with_units"):
            continue
        print(f"  {method}: {got['ctas_with_units']} CTAs on {got['distinct_sms']} SMs at {got['sm_clock_mhz']:.0f} MHz, "
              f"units a CTA {got['units_per_cta']['median']:.0f}", flush=True)
        for name in ("start_after_first_us", *(span for span, _, _ in SPANS), "end_after_first_start_us"):
            s = got[name]
            print(f"    {name:60} median {s['median']:7.2f}  [{s['min']:7.2f}, {s['max']:7.2f}] µs", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", action="append", required=True, type=parse_shape, help="MxNxK")
    parser.add_argument("--config", action="append", default=[], help="KEY=VALUE,... of one config (repeatable); "
                                                                        "grid=SM: one CTA per SM")
    parser.add_argument("--served", action="store_true", help="also the params of the tuned entry serving each shape "
                                                               "(dispatch.CLASS_RULE)")
    parser.add_argument("--out", help="a file name under bench/results/<gpu>/ for the rows as JSON")
    args = parser.parse_args()
    op = get_op("gemm_sm90")
    device = gpu.open_device()
    rows = []
    for m, n, k in args.shape:
        shape = op.shape(m=m, n=n, k=k)
        text = f"{m}x{n}x{k}"
        configs = []
        for config in args.config:
            values = parse_config(config)
            if values.get("grid") == "SM":
                values["grid"] = device.sms
            configs.append(values)
        if args.served:
            served = dispatch.choose_class(op, shape, tuned_shapes(op, device.name))
            if served is None:
                print(f"{text}: no tuned entry serves it", flush=True)
            else:
                configs.append(op.params_to_dict(served[1]))
        for values in configs:
            try:
                params = op.params_from_dict(values)
                op.validate(shape, params)
                row = probe(op, shape, params, device)
            except MageError as exc:
                print(f"{text} {values}: REFUSED {exc}", flush=True)
                rows.append({"shape": text, "config": values, "refused": str(exc)})
                continue
            rows.append({"shape": text, **row})
            show(text, row)
    if args.out:
        doc = {"what": "gemm_sm90 launches divided by per-CTA clocks (bench/probes/gemm_sm90_timeline.py)",
               "method": {"hot": f"the last launch of a CUDA graph of back-to-back launches, after {HOT_REPLAYS} "
                                 "replays; inputs L2-warm",
                          "cold": "one launch after L2 is flushed",
                          "clocks": "SM clock cycles turned into µs at the rate the global timer gives over all CTAs"},
               **provenance(device), "rows": rows}
        print(f"wrote {write_result(device, args.out, json.dumps(doc, indent=1))}")


if __name__ == "__main__":
    main()
