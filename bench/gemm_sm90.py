"""Hopper GEMM on this GPU: mage-gen's wgmma kernel (gemm_sm90) against cuBLAS, Triton's tl.dot over its Hopper
tiles and mage-gen's mma.sync kernel (matmul_tc), bf16 in and fp32 sums, C bf16, at the squares 2048³, 4096³
and 8192³. Hot and cold, in interleaved rounds paired by round, with TFLOP/s, the share of cuBLAS's throughput,
and (with --ncu) Nsight Compute's tensor-pipe utilization of ours and of cuBLAS's kernel. Every kernel and
peer is gated before it is timed. Each shape runs this GPU's tuned winner (--tune-missing tunes one first;
--untuned takes the op's default config). Writes bench/results/<gpu>/gemm_sm90.json.

    python bench/gemm_sm90.py --tune-missing --ncu
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import subprocess
import sys

import numpy as np

from mage_gen import gpu
from mage_gen.errors import StoreError
from mage_gen.measure import Bench, interleave_rounds, launches_for, pool_rounds
from mage_gen.ops import get_op
from mage_gen.peers import make_peers
from mage_gen.timing import round_ratio
from mage_gen.variants import build

from bench._common import (ROUND_ORDER, parse_shape, product_params, provenance, timing_method, winner_params,
                           write_result)

SHAPES = [(2048, 2048, 2048), (4096, 4096, 4096), (8192, 8192, 8192)]
ROUNDS, PER_ROUND = 8, 5
# The least share of cuBLAS's hot throughput each square must reach; a tie by the paired rounds counts where
# the share is at least TIE_FLOOR
TARGETS = {(2048, 2048, 2048): 0.95, (4096, 4096, 4096): 1.00, (8192, 8192, 8192): 1.00}
TIE_FLOOR = 0.99
# Nsight Compute's utilization of the tensor pipes, by whatever name this ncu gives them
NCU_METRICS = "regex:sm__pipe_tensor_op.*pct_of_peak_sustained_active"
NCU_KEPT = "sm__pipe_tensor_op_hmma_cycles_active."  # HMMA, HGMMA and QGMMA: the pipe bf16 wgmma runs on


def mma_sync_subject(shape, inputs: dict[str, np.ndarray], device):
    """matmul_tc's tuned bf16 winner at the same M, N, K (B as K×N, C fp32), gated on these A and B, or the reason
    it is missing."""
    if shape.precision != "bf16":
        return None, f"matmul_tc has no {shape.precision} kernel"
    op = get_op("matmul_tc")
    tc_shape = op.shape(m=shape.m, n=shape.n, k=shape.k, precision="bf16")
    try:
        params = winner_params(op, tc_shape, device, False, [])
    except StoreError as exc:
        return None, f"no tuned matmul_tc winner: {exc}"
    bench = Bench(op, tc_shape, {}, seed=shape.m, inputs={"A": np.ascontiguousarray(inputs["A"][:, :shape.k]),
                                                          "B": np.ascontiguousarray(inputs["B"][:, :shape.k].T)})
    variant = build(op, tc_shape, params, device.arch)
    subject, gate = bench.checked_subject(variant, bench.load(variant), name="mma.sync")
    return subject, ("" if subject else f"failed the gate: {gate.reason}")


def bench_one(op, shape, params, chosen: str, device) -> dict:
    variant = build(op, shape, params, device.arch)
    bench = Bench(op, shape, {}, seed=shape.m + shape.n + shape.k)
    kernel = bench.load(variant)
    head = {"m": shape.m, "n": shape.n, "k": shape.k, "c_dtype": shape.c_dtype, "kernel": variant.source.kernel_name,
            "source_hash": variant.source.source_hash, "params": op.params_to_dict(params), "chosen": chosen}
    subject, checked = bench.checked_subject(variant, kernel, name="mage-gen")
    if subject is None:
        kernel.unload()
        return {**head, "gate": checked.to_dict()}
    inputs = bench.timing_inputs()
    peers, missing = make_peers(op, shape, {}, inputs, None, check=bench.check_tensor,
                                device_inputs={name: buf.ptr for name, buf in bench.timing_buffers().items()})
    tc, why = mma_sync_subject(shape, inputs, device)
    if tc is None:
        missing["mma.sync"] = why
    everyone = [subject, *peers, *([tc] if tc else [])]
    flops = op.flops(shape)
    timings, paired = {}, {}
    launches = launches_for(everyone)
    for method in ("hot", "cold"):
        taken = interleave_rounds([everyone], method, ROUNDS, PER_ROUND, launches)
        pooled, _ = pool_rounds(taken, method, 1)
        for name, timing in pooled.items():
            timings.setdefault(name, {})[method] = {**timing.to_dict(), "tflops": flops / timing.median_us / 1e6}
        if "cublas" in pooled:
            paired[method] = {name: round_ratio([r[name] for r in taken], [r["cublas"] for r in taken]).to_dict()
                              for name in pooled if name != "cublas"}
    for s in everyone:
        s.close()
    kernel.unload()
    return {**head, "census": {key: variant.census.to_dict()[key] for key in ("registers", "spill_bytes", "hopper")},
            "gate": checked.to_dict(), "flops": flops, "hot_launches_per_graph": launches, "round_order": ROUND_ORDER,
            "timings": timings,
            "time_over_cublas_by_round": paired,
            "peer_configs": {p.name: p.config for p in peers}, "peers_missing": missing}


def tensor_pipe(shape, params: dict | None) -> dict:
    """ncu's tensor-pipe metrics of one launch of ours (params) or of cuBLAS's kernel (None), in a process of its own."""
    target = ["--profile", json.dumps(params) if params is not None else "cublas",
              "--shape", f"{shape.m}x{shape.n}x{shape.k}"]
    kernels = "regex:gemm_sm90" if params is not None else "regex:nvjet|gemm|sm90"
    command = ["ncu", "--clock-control", "none", "--metrics", NCU_METRICS, "-k", kernels, "-s", "2", "-c", "1",
               "--csv", "--page", "raw", sys.executable, "-m", "bench.gemm_sm90", *target]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    rows = [line for line in done.stdout.splitlines() if line.startswith('"')]
    if done.returncode != 0 or len(rows) < 3:
        return {"error": (done.stderr.strip().splitlines() or done.stdout.strip().splitlines() or ["no output"])[-1]}
    table = list(csv.reader(io.StringIO("\n".join(rows))))
    names, units, values = table[0], table[1], table[2]
    return {"kernel": values[names.index("Kernel Name")] if "Kernel Name" in names else None,
            **{name: f"{value} {unit}".strip() for name, unit, value in zip(names, units, values)
               if name.startswith(NCU_KEPT)}}


def profile_target(text: str, shape) -> None:
    """What ncu profiles: three launches of ours (params as JSON) or of cuBLAS at the shape."""
    import torch

    op = get_op("gemm_sm90")
    device = gpu.open_device()
    if text == "cublas":
        a = torch.randn(shape.m, shape.k, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(shape.n, shape.k, device="cuda", dtype=torch.bfloat16)
        for _ in range(3):
            a @ b.t()
        torch.cuda.synchronize()
        return
    params = op.params_from_dict(json.loads(text))
    variant = build(op, shape, params, device.arch)
    bench = Bench(op, shape, {}, seed=1)
    subject, _, reason = bench.checked_at(variant, bench.load(variant))
    if subject is None:
        raise SystemExit(f"the kernel failed its check: {reason}")
    for _ in range(2):
        subject.bound.enqueue(bench.stream.handle)
    bench.stream.synchronize()


def summarize(rows: list[dict]) -> dict:
    """The issue's figures, each with its value: hot throughput share of cuBLAS by the paired rounds' median."""
    targets = {}
    for row in rows:
        dims = (row["m"], row["n"], row["k"])
        ratio = row.get("time_over_cublas_by_round", {}).get("hot", {}).get("mage-gen")
        share = 1 / ratio["median"] if ratio else None
        floor = TARGETS.get(dims)
        if floor is None:
            continue
        tie = ratio is not None and ratio["verdict"] == "tie" and share >= TIE_FLOOR
        targets[f"{'x'.join(map(str, dims))} hot >= {floor:.2f}x cuBLAS throughput"] = {
            "share": share, "verdict": ratio["verdict"] if ratio else None,
            "met": share is not None and (share >= floor or (floor == 1.0 and tie))}
    return {"targets": targets, "all_targets_met": bool(targets) and all(t["met"] for t in targets.values()),
            "all_gated": all("timings" in r for r in rows),
            "untuned": [f"{r['m']}x{r['n']}x{r['k']}" for r in rows if r["chosen"] != "tuned"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tune-missing", action="store_true", help="tune a shape that has no winner in tuned/")
    parser.add_argument("--untuned", action="store_true", help="bench the default config where nothing is tuned")
    parser.add_argument("--shape", type=parse_shape, action="append", help="only these MxNxK (default: the squares)")
    parser.add_argument("--ncu", action="store_true", help="also read the tensor pipes' utilization with ncu")
    parser.add_argument("--out", default="gemm_sm90.json", help="result file name under bench/results/<gpu>/")
    parser.add_argument("--profile", help=argparse.SUPPRESS)  # the target ncu profiles (tensor_pipe)
    args = parser.parse_args()
    op = get_op("gemm_sm90")
    if args.profile:
        profile_target(args.profile, op.shape(*args.shape[0]))
        return
    device = gpu.open_device()
    rows = []
    for m, n, k in args.shape or SHAPES:
        shape = op.shape(m=m, n=n, k=k)
        params, chosen = product_params(op, shape, device, args.tune_missing, args.untuned,
                                        ["--precision", shape.precision])
        row = bench_one(op, shape, params, chosen, device)
        if args.ncu and "timings" in row:
            row["ncu_tensor_pipe"] = {"mage-gen": tensor_pipe(shape, op.params_to_dict(params)),
                                      "cublas": tensor_pipe(shape, None)}
        rows.append(row)
        if "timings" not in row:
            print(f"{m}x{n}x{k}: FAILED GATE {row['gate']['reason']}", flush=True)
            continue
        for method in ("hot", "cold"):
            for name, t in sorted(row["timings"].items(), key=lambda item: item[1][method]["median_us"]):
                r = row["time_over_cublas_by_round"].get(method, {}).get(name)
                print(f"{m}x{n}x{k} {method:4} {name:10} {t[method]['median_us']:9.2f} µs ±{t[method]['spread_us']:6.2f} "
                      f"{t[method]['tflops']:6.1f} TFLOP/s" + (f"  time/cuBLAS {r['median']:.4f} [{r['low']:.4f}, "
                                                              f"{r['high']:.4f}] {r['verdict']}" if r else ""),
                      flush=True)
    summary = summarize(rows)
    doc = {
        "what": "mage-gen's Hopper GEMM (wgmma, TMA, mbarriers) against cuBLAS, Triton and mage-gen's mma.sync kernel, "
                "recorded by bench/gemm_sm90.py",
        "method": {
            "gate": "fresh inputs, NaN-poisoned fenced output at the full size against float64 of the exact inputs "
                    "(mage_gen/ops/gemm_sm90.py's tolerance); peers gated on the timing inputs the same way",
            **timing_method(ROUNDS, PER_ROUND),
            "paired": "each round's median of a subject over cuBLAS's in the same round; the median of the rounds' "
                      "ratios with a distribution-free interval (mage_gen.timing.round_ratio): faster, slower or a tie "
                      "where the interval holds 1",
            "cublas": "torch.matmul(A, B.t()) with bf16 A, B and C (F.linear's product)",
            "triton": "tl.dot over TRITON_SM90_CONFIGS (mage_gen/peers.py), the fastest hot, C bf16",
            "mma.sync": "matmul_tc's tuned bf16 winner at the same M, N, K: B given K×N, C fp32",
            "target": f"hot throughput share of cuBLAS = 1 / the paired rounds' median; a tie counts at >= {TIE_FLOOR}",
            "ncu": f"ncu --clock-control none --metrics {NCU_METRICS}, the third launch of each",
        },
        **provenance(device), "shapes": rows, "summary": summary,
    }
    out = write_result(device, args.out, json.dumps(doc, indent=1) + "\n")
    print(json.dumps(summary, indent=1))
    print(f"wrote {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
