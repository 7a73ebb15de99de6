"""Matrix product on this GPU: the tuned mage-gen kernel against cuBLAS (torch.matmul, TF32 off) and Triton
(tl.dot with input_precision="ieee", at its best config), hot and cold, on five shapes, fp32.

Each shape uses this GPU's winner from tuned/; with --tune-missing, a shape without one is tuned first
with `mage-gen tune`. Every kernel and peer is gated before it is timed, and each one's error against the
float64 product of the timing inputs is read back after. Writes bench/results/<gpu>/matmul.json.

    python -m bench.matmul --tune-missing
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np
import torch

from mage_gen import gpu
from mage_gen.measure import Bench, gate, interleave
from mage_gen.verdict import relative_error
from mage_gen.ops import get_op
from mage_gen.peers import make_peers
from mage_gen.variants import build

from bench._common import geomean, provenance, timing_method, winner_params, write_result

SHAPES = [(1024, 1024, 1024), (2048, 2048, 2048), (4096, 4096, 4096), (1000, 1000, 1000), (4096, 512, 1024)]
ROUNDS, PER_ROUND = 5, 6
CUBLAS_TARGETS = {(1024, 1024, 1024): 0.90, (2048, 2048, 2048): 1.00, (4096, 4096, 4096): 1.10}  # hot, × cuBLAS
TRITON_TILE_KEYS = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "num_warps", "num_stages")


def accuracy(out: np.ndarray, ref: np.ndarray) -> dict:
    return {"max_abs_error": float(np.max(np.abs(out.astype(np.float64) - ref))),
            "relative_error": relative_error(out, ref)}


def bench_shape(op, m: int, n: int, k: int, params, device) -> dict:
    shape, run = op.shape(m=m, n=n, k=k), {}
    variant = build(op, shape, params, device.arch)
    bench = Bench(op, shape, run, seed=m + n + k)
    kernel = bench.load(variant)
    try:
        checked = gate(op, shape, params, kernel, run, bench.rng, bench.stream)
        if not checked.passed:
            return {"m": m, "n": n, "k": k, "kernel": variant.source.kernel_name, "gate": checked.to_dict()}
        subject = bench.subject(variant, kernel, name="mage-gen")
        inputs = subject.bound.inputs
        ref = op.reference(shape, inputs, op.scalars(shape, run))["C"]
        peers, missing = make_peers(op, shape, run, inputs, {"C": ref})
        everyone = [subject, *peers]
        hot = interleave(everyone, "hot", ROUNDS, PER_ROUND)
        cold = interleave(everyone, "cold", ROUNDS, PER_ROUND)
        # What each computed from the timing inputs, as left by its last timed launch (peers: one more run).
        bench.stream.synchronize()
        outputs, complaints = subject.bound.outputs()
        errors = {"mage-gen": {**accuracy(outputs["C"], ref), "fence": complaints}}
        for p in peers:
            out = p.run()
            torch.cuda.synchronize()
            errors[p.name] = accuracy(out.cpu().numpy(), ref)
        subject.close()
    finally:
        kernel.unload()
    flops = op.flops(shape)
    result = {
        "m": m, "n": n, "k": k, "kernel": variant.source.kernel_name, "params": op.params_to_dict(params),
        "census": {key: variant.census.to_dict()[key] for key in ("registers", "spill_bytes", "bar_sync")}
                  | {"dynamic_shared_bytes": op.geometry(shape, params, run).dynamic_shared_bytes},
        "gate": checked.to_dict(), "flops": flops,
        "timings": {name: {"hot": hot[name].to_dict(), "cold": cold[name].to_dict(), **errors[name],
                           "hot_tflops": flops / hot[name].median_us / 1e6,
                           "cold_tflops": flops / cold[name].median_us / 1e6} for name in hot},
        "peer_configs": {p.name: p.config for p in peers}, "peers_missing": missing,
        "triton_config": {key: v for key, v in next((p.config for p in peers if p.name == "triton"), {}).items()
                          if key in TRITON_TILE_KEYS},
    }
    for method, table in (("hot", hot), ("cold", cold)):
        mine = table["mage-gen"].median_us
        result[f"{method}_ratio"] = {p.name: mine / table[p.name].median_us for p in peers}
    return result


def label(m: int, n: int, k: int) -> str:
    return f"{m}x{n}x{k}"


def ratio_text(ratio: float | None) -> str:
    return "–" if ratio is None else f"{ratio:.3f}"


def summarize(rows: list[dict]) -> dict:
    """The issue's targets on hot medians, each with its figure; a shape not timed or a peer missing fails."""
    by_shape = {(r["m"], r["n"], r["k"]): r.get("hot_ratio", {}) for r in rows}
    targets = {}
    for dims, limit in CUBLAS_TARGETS.items():
        ratio = by_shape[dims].get("cublas")
        targets[f"{label(*dims)} <= {limit:.2f}x cublas"] = {"hot_ratio": ratio, "limit": limit,
                                                            "met": ratio is not None and ratio <= limit}
    to_triton = {label(*dims): ratios.get("triton") for dims, ratios in by_shape.items()}
    targets["faster than triton-ieee on every shape"] = {
        "hot_ratios": to_triton, "met": all(r is not None and r < 1.0 for r in to_triton.values())}
    ratios = [r for r in to_triton.values() if r is not None]
    return {"targets": targets, "all_targets_met": all(t["met"] for t in targets.values()),
            "geomean_hot_ratio_to_triton": geomean(ratios),
            "all_gated": all("timings" in r for r in rows)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tune-missing", action="store_true", help="tune a shape that has no winner in tuned/")
    args = parser.parse_args()
    op = get_op("matmul")
    device = gpu.open_device()
    params = {(m, n, k): winner_params(op, op.shape(m=m, n=n, k=k), device, args.tune_missing,
                                       ["--m", str(m), "--n", str(n), "--k", str(k)]) for m, n, k in SHAPES}
    rows = [bench_shape(op, m, n, k, params[m, n, k], device) for m, n, k in SHAPES]
    summary = summarize(rows)
    doc = {
        "what": "tuned mage-gen matmul vs cuBLAS (TF32 off) and Triton (ieee, best config), fp32, "
                "recorded by bench/matmul.py",
        "method": {
            "gate": f"fresh inputs, NaN-poisoned fenced output, one run (every size is fixed at generation), "
                    f"relative norm vs float64 ≤ {op.tolerance:g}; peers gated on the timing inputs",
            **timing_method(ROUNDS, PER_ROUND),
            "error": "max |C − C64| and ‖C − C64‖ / ‖C64‖ on the timing inputs, C64 their float64 product; "
                     "mage-gen's C as its last timed launch left it, each peer's from one more run; fence: "
                     "mage-gen's output is fenced by guard regions poisoned before its first timed launch, and "
                     "any element of them written by then is counted",
            "tflops": "2·M·N·K / median",
            "ratio": "mage-gen median / peer median",
            "cublas": "torch.matmul(A, B, out=C) with allow_tf32 off for cuBLAS and cuDNN and float32 matmul "
                      "precision 'highest': fp32 FMAs, as mage-gen's kernels do",
            "triton": "the Triton kernel in mage_gen/peers.py (tl.dot input_precision='ieee', fp32 accumulator), "
                      "the fastest hot of its configs (TRITON_MATMUL_CONFIGS) at each shape",
            "targets": "hot median ratios: 1024³ ≤ 0.90× cuBLAS, 2048³ ≤ 1.00×, 4096³ ≤ 1.10×, "
                       "every shape < 1.00× Triton",
        },
        **provenance(device),
        "shapes": rows, "summary": summary,
    }
    out = write_result(device, "matmul.json", json.dumps(doc, indent=1) + "\n")
    print(f"wrote {out}", file=sys.stderr)
    nan = float("nan")
    print(f"{'M×N×K':>14} {'hot µs':>9} {'cublas':>9} {'triton':>9} {'TFLOP/s':>7} {'cuBLAS':>7} {'triton':>7} "
          f"{'×cuBLAS':>7} {'×triton':>7} {'max|err|':>8}  triton config")
    for r in rows:
        if "timings" not in r:
            print(f"{label(r['m'], r['n'], r['k']):>14} FAILED GATE: {r['gate']['reason']}")
            continue
        t, c = r["timings"], r["triton_config"]
        hot = {name: t.get(name, {}).get("hot", {}).get("median_us", nan) for name in ("mage-gen", "cublas", "triton")}
        tflops = {name: t.get(name, {}).get("hot_tflops", nan) for name in hot}
        config = (f"{c['BLOCK_M']}x{c['BLOCK_N']}x{c['BLOCK_K']} w{c['num_warps']} s{c['num_stages']}" if c else "–")
        print(f"{label(r['m'], r['n'], r['k']):>14} {hot['mage-gen']:9.1f} {hot['cublas']:9.1f} {hot['triton']:9.1f} "
              f"{tflops['mage-gen']:7.2f} {tflops['cublas']:7.2f} {tflops['triton']:7.2f} "
              f"{r['hot_ratio'].get('cublas', nan):7.3f} {r['hot_ratio'].get('triton', nan):7.3f} "
              f"{t['mage-gen']['max_abs_error']:8.1e}  {config}")
    for name, target in summary["targets"].items():
        figure = (ratio_text(target["hot_ratio"]) if "hot_ratio" in target else
                  ", ".join(f"{shape} {ratio_text(r)}" for shape, r in target["hot_ratios"].items()))
        print(f"{'met ' if target['met'] else 'MISS'} {name}: {figure}")


if __name__ == "__main__":
    main()
