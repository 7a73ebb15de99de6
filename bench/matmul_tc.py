"""Matrix product on the tensor cores on this GPU: mage-gen's mma.sync kernels (matmul_tc) at each precision
against cuBLAS (torch) and Triton (tl.dot) at the same precision, hot and cold, with TFLOP/s and each one's
error against the float64 product of the timing inputs.

Precisions: bf16 (bf16 A and B, fp32 C), tf32 (fp32 A and B rounded to tf32), fp32x3 (three tf32 products:
FP32-accurate). For fp32x3 the cuBLAS peer is SGEMM with TF32 off, whose error on the same inputs is the
bound the issue sets. Each (shape, precision) uses this GPU's tuned winner; with --tune-missing one without
is tuned first (`mage-gen tune matmul_tc`), with --untuned the op's default config is benched instead (and
recorded as untuned). Every kernel and peer is gated before it is timed. Writes
bench/results/<gpu>/matmul_tc.json.

    python -m bench.matmul_tc --tune-missing
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

from mage_gen import gpu
from mage_gen.measure import Bench, interleave
from mage_gen.verdict import relative_error
from mage_gen.ops import get_op
from mage_gen.peers import make_peers
from mage_gen.store import gpu_slug
from mage_gen.variants import build

from bench._common import parse_shape, product_params, provenance, timing_method, write_result

SHAPES = [(1024, 1024, 1024), (2048, 2048, 2048), (4096, 4096, 4096), (8192, 8192, 8192), (4096, 512, 1024),
          (1000, 1000, 1000)]
PRECISIONS = ("bf16", "tf32", "fp32x3")
ROUNDS, PER_ROUND = 4, 5
# hot time over cuBLAS's at the same precision, at most (fp32x3: over SGEMM)
FP32X3_TARGETS = {(1024, 1024, 1024): 0.90, (2048, 2048, 2048): 0.70, (4096, 4096, 4096): 0.70}
THROUGHPUT_TARGET = 0.60  # bf16 and tf32 at 4096³: at least this share of cuBLAS's TFLOP/s
ERROR_TARGET = 2.0  # fp32x3's relative error over SGEMM's, at most


def error_of(out: np.ndarray, ref: np.ndarray) -> dict:
    return {"max_abs_error": float(np.max(np.abs(out.astype(np.float64) - ref))),
            "relative_error": relative_error(out.astype(np.float32), ref)}


def bench_one(op, shape, params, chosen: str, device) -> dict:
    variant = build(op, shape, params, device.arch)
    bench = Bench(op, shape, {}, seed=shape.m + shape.n + shape.k)
    kernel = bench.load(variant)
    head = {"m": shape.m, "n": shape.n, "k": shape.k, "precision": shape.precision,
            "kernel": variant.source.kernel_name, "params": op.params_to_dict(params), "chosen": chosen}
    try:
        subject, checked = bench.checked_subject(variant, kernel, name="mage-gen")
        if subject is None:
            return {**head, "gate": checked.to_dict()}
        inputs = subject.bound.inputs
        peers, missing = make_peers(op, shape, {}, inputs, None, check=bench.check_tensor)
        everyone = [subject, *peers]
        hot = interleave(everyone, "hot", ROUNDS, PER_ROUND)
        cold = interleave(everyone, "cold", ROUNDS, PER_ROUND)
        bench.stream.synchronize()
        ref = op.reference(shape, inputs, {})["C"]
        outputs, complaints = subject.bound.outputs()
        errors = {"mage-gen": {**error_of(outputs["C"], ref), "fence": complaints}}
        for p in peers:
            out = p.run()
            torch.cuda.synchronize()
            errors[p.name] = error_of(out.float().cpu().numpy(), ref)
        subject.close()
    finally:
        kernel.unload()
    flops = op.flops(shape)
    result = {
        **head, "census": {key: variant.census.to_dict()[key] for key in ("registers", "spill_bytes", "bar_sync",
                                                                          "mma", "ldmatrix")},
        "gate": checked.to_dict(), "flops": flops,
        "timings": {name: {"hot": hot[name].to_dict(), "cold": cold[name].to_dict(), **errors[name],
                           "hot_tflops": flops / hot[name].median_us / 1e6,
                           "cold_tflops": flops / cold[name].median_us / 1e6} for name in hot},
        "peer_configs": {p.name: p.config for p in peers}, "peers_missing": missing,
    }
    for method, table in (("hot", hot), ("cold", cold)):
        result[f"{method}_ratio"] = {p.name: table["mage-gen"].median_us / table[p.name].median_us for p in peers}
    if "cublas" in errors and errors["cublas"]["relative_error"] > 0:
        result["error_over_cublas"] = errors["mage-gen"]["relative_error"] / errors["cublas"]["relative_error"]
    return result


def against_the_ceiling(rows: list[dict], device) -> dict | None:
    """Each precision's TFLOP/s at 4096³ as a share of mma.sync's own ceiling on this GPU, where
    bench/probes/mma_peak.py has measured it (3xTF32 counted as three tf32 products): how far the kernel is from what
    its instruction gives, beside how far the instruction is from cuBLAS."""
    path = Path("bench/results") / gpu_slug(device.name) / "mma_peak.json"
    if not path.is_file():
        return None
    peak = json.loads(path.read_text())
    shares = {}
    for r in rows:
        if (r["m"], r["n"], r["k"]) == (4096, 4096, 4096) and "timings" in r:
            kind, products = ("bf16", 1) if r["precision"] == "bf16" else ("tf32", 3 if r["precision"] == "fp32x3" else 1)
            shares[r["precision"]] = products * r["timings"]["mage-gen"]["hot_tflops"] / peak["ceiling"][kind]["tflops"]
    return {"from": str(path), "date": peak.get("date"), "ceiling_tflops": {k: v["tflops"] for k, v in peak["ceiling"].items()},
            "share_of_ceiling_at_4096": shares, "instruction_bounds": peak["bounds"]}


def summarize(rows: list[dict]) -> dict:
    """The issue's figures, each with its value; a shape not timed or a peer missing fails its target."""
    at = {(r["m"], r["n"], r["k"], r["precision"]): r for r in rows}
    targets = {}
    for dims, limit in FP32X3_TARGETS.items():
        ratio = at.get((*dims, "fp32x3"), {}).get("hot_ratio", {}).get("cublas")
        targets[f"fp32x3 {'x'.join(map(str, dims))} <= {limit:.2f}x cuBLAS SGEMM"] = {
            "hot_ratio": ratio, "met": ratio is not None and ratio <= limit}
    errors = {f"{r['m']}x{r['n']}x{r['k']}": r.get("error_over_cublas") for r in rows if r["precision"] == "fp32x3"}
    targets[f"fp32x3 relative error <= {ERROR_TARGET:g}x SGEMM's at every shape"] = {
        "ratios": errors, "met": all(e is not None and e <= ERROR_TARGET for e in errors.values())}
    for precision in ("bf16", "tf32"):
        ratio = at.get((4096, 4096, 4096, precision), {}).get("hot_ratio", {}).get("cublas")
        share = 1 / ratio if ratio else None
        targets[f"{precision} 4096^3 >= {THROUGHPUT_TARGET:.2f}x cuBLAS throughput"] = {
            "throughput_share": share, "met": share is not None and share >= THROUGHPUT_TARGET}
    return {"targets": targets, "all_targets_met": all(t["met"] for t in targets.values()),
            "all_gated": all("timings" in r for r in rows),
            "untuned": [f"{r['precision']} {r['m']}x{r['n']}x{r['k']}" for r in rows if r["chosen"] != "tuned"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tune-missing", action="store_true", help="tune a shape that has no winner in tuned/")
    parser.add_argument("--untuned", action="store_true", help="bench the default config where nothing is tuned")
    parser.add_argument("--precision", choices=PRECISIONS, action="append", help="only these (default: all)")
    parser.add_argument("--shape", type=parse_shape, action="append", help="only these MxNxK (default: the sweep)")
    parser.add_argument("--out", default="matmul_tc.json", help="result file name under bench/results/<gpu>/")
    args = parser.parse_args()
    op = get_op("matmul_tc")
    device = gpu.open_device()
    rows = []
    for precision in args.precision or PRECISIONS:
        for m, n, k in args.shape or SHAPES:
            shape = op.shape(m=m, n=n, k=k, precision=precision)
            params, chosen = product_params(op, shape, device, args.tune_missing, args.untuned,
                                            ["--config", f"precision={shape.precision}"])
            rows.append(bench_one(op, shape, params, chosen, device))
            r = rows[-1]
            if "timings" not in r:
                print(f"{precision:6} {m}x{n}x{k}: FAILED GATE {r['gate']['reason']}", flush=True)
                continue
            t = r["timings"]
            print(f"{precision:6} {m:>5}x{n}x{k:<5} {r['kernel']:60} {t['mage-gen']['hot']['median_us']:9.1f} µs "
                  f"{t['mage-gen']['hot_tflops']:6.1f} TFLOP/s  × cuBLAS {r['hot_ratio'].get('cublas', float('nan')):.3f}"
                  f"  × Triton {r['hot_ratio'].get('triton', float('nan')):.3f}  rel.err {t['mage-gen']['relative_error']:.2e}"
                  f" (cuBLAS {t.get('cublas', {}).get('relative_error', float('nan')):.2e})", flush=True)
    summary = summarize(rows)
    summary["mma_sync_ceiling"] = against_the_ceiling(rows, device)
    doc = {
        "what": "mage-gen tensor-core matmul (mma.sync from PTX) vs cuBLAS and Triton at each precision, "
                "recorded by bench/matmul_tc.py",
        "method": {
            "gate": "fresh inputs, NaN-poisoned fenced output at the full size against float64 of the exact inputs, "
                    "at the op's tolerance per precision (mage_gen/ops/matmul_tc.py); peers gated on the timing "
                    "inputs the same way (a bf16 C one bf16 ulp looser)",
            **timing_method(ROUNDS, PER_ROUND),
            "error": "max |C − C64| and ‖C − C64‖ / ‖C64‖ on the timing inputs, C64 their float64 product; "
                     "mage-gen's C as its last timed launch left it, each peer's from one more run",
            "cublas": "bf16: torch.mm(A, B, torch.float32) (fp32 C) and torch.matmul (bf16 C), the faster; tf32: "
                      "torch.matmul with allow_tf32; fp32x3: torch.matmul with TF32 off (SGEMM)",
            "triton": "tl.dot with input_precision None (bf16), 'tf32' or 'tf32x3', fp32 accumulator and C, the "
                      "fastest hot of TRITON_TC_CONFIGS (mage_gen/peers.py)",
            "ratio": "mage-gen median / peer median; throughput share = 1 / ratio",
        },
        **provenance(device), "shapes": rows, "summary": summary,
    }
    out = write_result(device, args.out, json.dumps(doc, indent=1) + "\n")
    print(json.dumps(summary, indent=1))
    print(f"wrote {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
