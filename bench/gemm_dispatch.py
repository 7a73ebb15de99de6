"""The Hopper GEMM's size classes over M: the regret of dispatch.CLASS_RULE. At an (N, K) tuned at several M (by
default every one in tuned/), for M from 1 to 8192 tokens, every stored class's params compiled for that M (each
distinct set once) are gated, then timed beside cuBLAS, hot and cold, in interleaved rounds. regret = the time of
the class the rule picks over the fastest class's, by paired rounds (the median of the rounds' ratios, with its
interval: an interval that holds 1 is a tie). Writes bench/results/<gpu>/gemm_dispatch.json, rewritten after each M.

    python -m bench.gemm_dispatch --nk 4096x4096
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict

from mage_gen import gpu
from mage_gen.dispatch import CLASS_RULE, choose_class
from mage_gen.errors import ConfigError
from mage_gen.measure import Bench, interleave_rounds, pool_rounds
from mage_gen.ops import get_op
from mage_gen.peers import make_peers
from mage_gen.store import tuned_shapes
from mage_gen.timing import round_ratio
from mage_gen.variants import build

from bench._common import provenance, timing_method, write_result
from bench.gemm_sm90 import PER_ROUND, ROUNDS

TOKENS = (1, 16, 32, 48, 64, 96, 128, 192, 256, 384, 512, 1024, 2048, 4096, 8192)
REGRET_TARGET = 1.05


def classes_at(op, device, n: int, k: int) -> dict[int, object]:
    """M -> params of every entry stored for (N, K) in bf16 with C bf16 and B N×K."""
    return {shape.m: params for shape, params in tuned_shapes(op, device.name).items()
            if (shape.n, shape.k, shape.c_dtype, shape.b_layout) == (n, k, "bf16", "nk")}


def bench_m(op, device, n: int, k: int, m: int, classes: dict[int, object]) -> dict:
    shape = op.shape(m=m, n=n, k=k)
    served, _ = choose_class(op, shape, {op.shape(m=c, n=n, k=k): p for c, p in classes.items()})
    by_params = defaultdict(list)  # classes whose params are one kernel are timed once, as that kernel
    for tuned_m, params in classes.items():
        by_params[params].append(tuned_m)
    bench = Bench(op, shape, {}, seed=m + n + k)
    subjects, kernels, failed, names = [], [], {}, {}
    try:
        for params, tuned_ms in by_params.items():
            name = "class m=" + "/".join(map(str, sorted(tuned_ms)))
            try:
                op.validate(shape, params)
            except ConfigError as exc:  # a class the rule passes over at this M
                failed[name] = f"invalid at M={m}: {exc}"
                continue
            variant = build(op, shape, params, device.arch)
            kernel = bench.load(variant)
            kernels.append(kernel)
            subject, checked = bench.checked_subject(variant, kernel, name=name)
            if subject is None:
                failed[name] = checked.reason
                continue
            subjects.append(subject)
            names.update({tuned_m: name for tuned_m in tuned_ms})
        peers, missing = make_peers(op, shape, {}, bench.timing_inputs(), None, check=bench.check_tensor,
                                    device_inputs={nm: buf.ptr for nm, buf in bench.timing_buffers().items()})
        cublas = [p for p in peers if p.name == "cublas"]
        everyone = [*subjects, *cublas]
        dispatched = names.get(served.m)
        row = {"m": m, "n": n, "k": k, "dispatched": f"class m={served.m}", "timed_as": dispatched,
               "failed": failed, "peers_missing": missing, "timings": {}, "regret": {}, "time_over_cublas_by_round": {}}
        if dispatched is None:
            return {**row, "error": "the dispatched class failed its gate"}
        for method in ("hot", "cold"):
            taken = interleave_rounds([everyone], method, ROUNDS, PER_ROUND)
            pooled, _ = pool_rounds(taken, method, 1)
            row["timings"][method] = {nm: t.to_dict() for nm, t in pooled.items()}
            versus = {s.name: round_ratio([r[dispatched] for r in taken], [r[s.name] for r in taken])
                      for s in subjects if s.name != dispatched}
            worst = max(versus.items(), key=lambda kv: kv[1].median, default=None)
            regret = max(1.0, worst[1].median) if worst else 1.0
            row["regret"][method] = {"regret": regret, "against": worst[0] if worst else None,
                                     "ratio": worst[1].to_dict() if worst else None,
                                     "tie": bool(worst and worst[1].low <= 1 <= worst[1].high)}
            if cublas:
                row["time_over_cublas_by_round"][method] = round_ratio(
                    [r[dispatched] for r in taken], [r["cublas"] for r in taken]).to_dict()
        return row
    finally:
        for s in subjects:
            s.close()
        for kernel in kernels:
            kernel.unload()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nk", action="append", help="NxK of a weight tuned at two or more M (default: every one)")
    parser.add_argument("--m", type=int, action="append", help=f"tokens (default: {', '.join(map(str, TOKENS))})")
    args = parser.parse_args()
    op = get_op("gemm_sm90")
    device = gpu.open_device()
    stored = defaultdict(set)
    for shape in tuned_shapes(op, device.name):
        stored[(shape.n, shape.k)].add(shape.m)
    try:
        wanted = [tuple(int(v) for v in text.lower().split("x")) for text in args.nk] if args.nk else \
            [nk for nk, ms in sorted(stored.items()) if len(ms) > 1]
    except ValueError:
        parser.error("--nk takes NxK, e.g. 4096x4096")
    rows = []
    for n, k in wanted:
        classes = classes_at(op, device, n, k)
        if not classes:
            raise SystemExit(f"error: nothing is tuned for N={n}, K={k} on {device.name}; tune it first")
        for m in args.m or TOKENS:
            row = bench_m(op, device, n, k, m, classes)
            rows.append(row)
            hot, cold = (row["regret"].get(x, {}).get("regret") for x in ("hot", "cold"))
            print(f"{m}x{n}x{k}: {row['dispatched']} regret hot {hot} cold {cold}", flush=True)
            regrets = [r["regret"][x]["regret"] for r in rows for x in ("hot", "cold") if x in r["regret"]]
            doc = {"what": "the regret of the Hopper GEMM's dispatch over M, recorded by bench/gemm_dispatch.py",
                   "rule": CLASS_RULE,
                   "method": {**timing_method(ROUNDS, PER_ROUND),
                              "regret": "the dispatched class's time over the fastest class's at that M, the median "
                                        "of the paired rounds' ratios (1 where it is the fastest)",
                              "gate": "every class's kernel at that M, before any timing"},
                   **provenance(device), "points": rows,
                   "summary": {"points": len(rows), "worst regret": max(regrets, default=None),
                               f"regret <= {REGRET_TARGET} at every point, hot and cold":
                                   bool(regrets) and max(regrets) <= REGRET_TARGET
                                   and all("error" not in r for r in rows)}}
            out = write_result(device, "gemm_dispatch.json", json.dumps(doc, indent=1) + "\n")
    print(json.dumps(doc["summary"], indent=1))
    print(f"wrote {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
