"""GEMM where models spend their time: mage-gen's Hopper GEMM (gemm_sm90) against cuBLAS and Triton at the linear layers
of Llama-3-8B and 70B, M ∈ {16, 128, 512, 2048, 8192} tokens, bf16 in (or --precision e4m3: fp8 with per-tensor
scales, against torch._scaled_mm), fp32 sums, C bf16, B given N×K (an nn.Linear weight). Hot and cold in interleaved
rounds paired by round, TFLOP/s and the share of cuBLAS's throughput, every kernel and peer gated first
(bench/gemm_sm90.py's bench_one). Each shape runs this GPU's tuned winner (--tune-missing tunes one first, with
--preset; --classes takes the entry tuned at the nearest M, as the runtime and mage_gen.torch.linear do; --untuned
takes the op's default config). The result file is rewritten after every shape, so a run cut short keeps what it
measured (and the earlier rows of the shapes it did not reach); a shape that nothing tuned serves stops the run with
one line naming the tune to run (exit 2). --resume measures only the shapes it lacks: a row is kept where it was
measured on this GPU with the kernel that would run now (the same params and kernel text), each shape's figures being
paired with its peers within its own process. Writes bench/results/<gpu>/gemm_llm.json.

    python -m bench.gemm_llm --model 8b --m 16 --m 128 --tune-missing
    python -m bench.gemm_llm --classes --resume      (the whole sweep, over as many calls as it takes)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from mage_gen import gpu
from mage_gen.errors import ConfigError, StoreError
from mage_gen.measure import HOT_LAUNCHES_PER_GRAPH, hot_launches
from mage_gen.ops import get_op
from mage_gen.ops.gemm_sm90 import ELEMENTS

from bench._common import (ROUND_ORDER, earlier_result, geomean, product_params, provenance, timing_method,
                           write_result)
from bench.gemm_sm90 import PER_ROUND, ROUNDS, bench_one

TOKENS = (16, 128, 512, 2048, 8192)
# (N, K) of each linear layer: the weight's rows and columns
LAYERS = {
    "8b": {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)},
    "70b": {"qkv": (10240, 8192), "o": (8192, 8192), "gate_up": (57344, 8192), "down": (8192, 28672)},
}
# The figures a bf16 sweep must reach, as shares of cuBLAS's hot throughput (1 / the paired rounds' median time)
GEOMEAN_TARGET, FLOOR_TARGET = 1.05, 0.95
# The peer each precision's rows are paired with (the family cublas: mage_gen/peers.py)
PEERS = {"bf16": "torch.matmul(A, B.t()) with bf16 A, B and C (F.linear's product)",
         "e4m3": "torch._scaled_mm (cuBLASLt) of the same e4m3 A and B and per-tensor scales, C bf16, the faster of "
                 "fast and exact accumulation"}


def share(row: dict, method: str) -> float | None:
    ratio = row.get("time_over_cublas_by_round", {}).get(method, {}).get("mage-gen")
    return 1 / ratio["median"] if ratio else None


def read_floor(rows: list[dict], l2_bytes: int, element_bytes: int) -> dict:
    """Where B (the weight) does not fit in L2, the time a read of its bytes takes at the fastest rate any subject
    reached on such a weight in these rows, hot, and each subject's time over it: an empirical floor of the rows
    whose time is mostly B's stream from DRAM (bench/NOTES.md, Hopper GEMM §11). {} where no row is such."""
    def weight_bytes(row: dict) -> int:
        return row["n"] * row["k"] * element_bytes

    def hot_us(row: dict) -> dict[str, float]:
        return {name: t["hot"]["median_us"] for name, t in row.get("timings", {}).items() if "hot" in t}

    streamed = [r for r in rows if weight_bytes(r) > l2_bytes and hot_us(r)]
    if not streamed:
        return {}
    rate, row, subject = max(((weight_bytes(r) / us, r, name) for r in streamed for name, us in hot_us(r).items()),
                             key=lambda reached: reached[0])
    return {"rate_TBps": rate / 1e6, "reached_by": f"{subject} at {row['model']} {row['layer']} M={row['m']}",
            "rows": {f"{r['model']} {r['layer']} M={r['m']}": {
                "floor_us": weight_bytes(r) / rate,
                **{f"{name} over floor": us * rate / weight_bytes(r) for name, us in hot_us(r).items()}}
                for r in streamed}}


def summarize(rows: list[dict], complete: bool, whole: bool, precision: str = "bf16", l2_bytes: int = 0) -> dict:
    """complete: every case of this run measured; whole: the run's cases are the whole sweep (every model and
    token count), the only run that can meet the targets. A run is of one precision: bf16 rows hold the bf16 targets
    (against cuBLAS), e4m3 rows the fp8 one (against torch._scaled_mm, the cublas family there). l2_bytes: the GPU's
    L2, over which a weight is read from DRAM (read_floor)."""
    hot = [s for s in (share(r, "hot") for r in rows) if s is not None]
    cold = [s for s in (share(r, "cold") for r in rows) if s is not None]
    below = [f"{r['model']} {r['layer']} M={r['m']}" for r in rows if (share(r, "hot") or 0) < FLOOR_TARGET]
    every = whole and complete and bool(rows) and len(hot) == len(rows)  # the whole sweep measured, every shape gated
    if precision == "bf16":
        targets = {f"bf16 geomean >= {GEOMEAN_TARGET}x cuBLAS hot": every and geomean(hot) >= GEOMEAN_TARGET,
                   f"no bf16 shape below {FLOOR_TARGET}x cuBLAS hot": every and not below}
    else:
        targets = {"fp8 geomean >= 1.00x torch._scaled_mm hot": every and geomean(hot) >= 1.0}
    return {"sweep": "whole" if whole else "part (--model or --m)", "complete": complete, "shapes": len(rows),
            "gated": len(hot),
            "hot share of cuBLAS, geomean": geomean(hot), "hot share, lowest": min(hot, default=None),
            "cold share of cuBLAS, geomean": geomean(cold), f"below {FLOOR_TARGET} hot": below,
            "targets": targets, "precision": precision,
            "all_targets_met": all(targets.values()),
            # each row is paired with its own peers in the process that measured it; --resume keeps rows of earlier ones
            "measured": sorted({r["measured"] for r in rows if "measured" in r}),
            "untuned": [f"{r['m']}x{r['n']}x{r['k']}" for r in rows if r["chosen"].startswith("untuned")],
            "served by a class tuned at another M": [f"{r['m']}x{r['n']}x{r['k']}" for r in rows
                                                     if r["chosen"].startswith("class")],
            "B read from DRAM": read_floor(rows, l2_bytes, ELEMENTS[precision].itemsize) if l2_bytes else {}}


def measured_as_now(row: dict) -> bool:
    """Whether a row was timed as the method times now: in rounds of the order it takes now (ROUND_ORDER), with as
    many launches per graph (a row from before the count was recorded took HOT_LAUNCHES_PER_GRAPH, which is what
    the method still takes unless its fastest subject's launch is long: measure.hot_launches)."""
    if row.get("round_order") != ROUND_ORDER:
        return False
    if "hot_launches_per_graph" in row:
        return True
    hot = [t["hot"]["median_us"] for t in row.get("timings", {}).values() if "hot" in t]
    return bool(hot) and hot_launches(min(hot)) == HOT_LAUNCHES_PER_GRAPH


def _earlier_rows(device, name: str, precision: str) -> dict[tuple[str, str, int], dict]:
    """The rows of an earlier run's result file on this GPU at this precision, by (model, layer, M)."""
    doc = earlier_result(device, name)
    if doc.get("precision", "bf16") != precision:
        return {}
    return {(r["model"], r["layer"], r["m"]): r for r in doc.get("shapes", []) if "model" in r and "measured" in r}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=[*LAYERS, "all"], default="all")
    parser.add_argument("--m", type=int, action="append", help=f"tokens (default: {', '.join(map(str, TOKENS))})")
    parser.add_argument("--tune-missing", action="store_true", help="tune a shape that has no winner in tuned/")
    parser.add_argument("--preset", help="the search preset --tune-missing tunes over (default: the one the op "
                                         "gives the shape's M: search/gemm_sm90.toml's default_by_size)")
    parser.add_argument("--trials", type=int, default=64, help="configs each --tune-missing study measures")
    parser.add_argument("--classes", action="store_true",
                        help="where M is not tuned, bench the params tuned at the nearest M of the same N, K")
    parser.add_argument("--untuned", action="store_true", help="bench the default config where nothing is tuned")
    parser.add_argument("--precision", choices=("bf16", "e4m3"), default="bf16",
                        help="A and B: bf16 against cuBLAS, or e4m3 with per-tensor scales against torch._scaled_mm")
    parser.add_argument("--out", help="result file name under bench/results/<gpu>/ (default: gemm_llm.json, "
                                      "gemm_llm_e4m3.json)")
    parser.add_argument("--resume", action="store_true", help="keep the result file's rows of the kernels that would "
                                                              "run now, timed as the method times them now, and "
                                                              "measure the rest")
    parser.add_argument("--budget-s", type=float, help="start no shape once this many seconds have passed less the "
                                                       "longest shape so far (a call with a time limit ends between "
                                                       "shapes; --resume goes on)")
    args = parser.parse_args()
    if any(m < 1 for m in args.m or ()):
        parser.error("--m takes a positive number of tokens")
    if args.budget_s is not None and args.budget_s <= 0:
        parser.error("--budget-s takes a positive number of seconds")
    op = get_op("gemm_sm90")
    device = gpu.open_device()
    models = list(LAYERS) if args.model == "all" else [args.model]
    cases = [(model, layer, m, n, k) for model in models for m in args.m or TOKENS
             for layer, (n, k) in LAYERS[model].items()]
    name = args.out or ("gemm_llm.json" if args.precision == "bf16" else "gemm_llm_e4m3.json")
    earlier = _earlier_rows(device, name, args.precision) if args.resume else {}
    whole = args.model == "all" and not args.m
    rows: list[dict] = []
    began, longest = time.monotonic(), 0.0

    def save(reached: int) -> tuple[Path, dict]:
        """The file as it stands (its path, its summary): the rows measured or kept so far, then the earlier rows of
        the shapes not reached (kept for the next --resume to check, so that a run cut short loses none of them)."""
        later = [earlier[(mo, la, mm)] for mo, la, mm, _, _ in cases[reached:] if (mo, la, mm) in earlier]
        doc = {"what": "mage-gen's Hopper GEMM against cuBLAS and Triton at Llama-3's linear layers, recorded by "
                       "bench/gemm_llm.py",
               "method": {**timing_method(ROUNDS, PER_ROUND),
                          "gate": "bench/gemm_sm90.py's: fresh inputs, a NaN-poisoned fenced output against float64",
                          "share": "cuBLAS's time over ours by round, the median of the rounds (paired)",
                          "cublas": PEERS[args.precision]},
               **provenance(device), "precision": args.precision, "shapes": rows + later,
               "summary": summarize(rows + later, reached == len(cases), whole, args.precision, device.l2_bytes)}
        return write_result(device, name, json.dumps(doc, indent=1) + "\n"), doc["summary"]

    for done, (model, layer, m, n, k) in enumerate(cases, 1):
        if args.budget_s is not None and time.monotonic() - began + longest > args.budget_s:
            save(done - 1)
            print(f"stopping before {model} {layer} M={m}: the budget of {args.budget_s:.0f} s would not hold another "
                  "shape; --resume goes on", flush=True)
            return
        started = time.monotonic()
        shape = op.shape(m=m, n=n, k=k, precision=args.precision)
        tune_flags = ["--precision", args.precision, "--objective", "both", "--trials", str(args.trials),
                      *(["--preset", args.preset] if args.preset else [])]
        try:
            params, chosen = product_params(op, shape, device, args.tune_missing, args.untuned, tune_flags,
                                            args.classes)
        except (StoreError, ConfigError) as exc:
            save(done - 1)
            print(f"error: {model} {layer} {m}x{n}x{k}: {exc}", file=sys.stderr)
            raise SystemExit(2) from None
        row = earlier.get((model, layer, m))
        if row is not None and (row.get("params"), row.get("source_hash")) == (
                op.params_to_dict(params), op.source(shape, params).source_hash) and share(row, "hot") \
                and measured_as_now(row):
            how = f"kept, measured {row['measured']}"
        else:
            row = {"model": model, "layer": layer, **bench_one(op, shape, params, chosen, device),
                   "measured": provenance(device)["date"]}
            how = chosen
        rows.append(row)
        hot, cold = share(row, "hot"), share(row, "cold")
        print(f"[{done}/{len(cases)}] {model} {layer:7} {m}x{n}x{k}: "
              + (f"share of cuBLAS hot {hot:.4f} cold {cold:.4f} ({how})" if hot and cold
                 else f"FAILED GATE {row['gate']['reason']}"), flush=True)
        out, summary = save(done)
        longest = max(longest, time.monotonic() - started)
    print(json.dumps(summary, indent=1))
    print(f"wrote {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
