"""Layer norm on this GPU: the tuned mage-gen kernel against torch and Triton at its best num_warps,
hot and cold, on the seven shapes of the sweep, with the device-to-device copy bandwidth of the same run.
Beside each shape, timed the same way and interleaved: floors no layer norm can beat by much: torch copying
an M×d x into y (the same bytes moved), and empty kernels on one block per row and on 528 blocks (the
fixed cost of a launch in a graph).

Each shape uses the kernel the runtime dispatches to: this GPU's tuned entry for d of the size class
mage_gen.dispatch picks for M; with --tune-missing, a d without one is tuned first with `mage-gen tune`. Every kernel and peer is gated at the benched shape before it is timed.
Writes bench/results/<gpu>/layernorm.json.

    python -m bench.layernorm --tune-missing
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
import triton

from mage_gen import gpu
from mage_gen.measure import Bench, interleave
from mage_gen.ops import get_op
from mage_gen.peers import TorchSubject, make_peers
from mage_gen.timing import Timing
from mage_gen.variants import build

from bench._copy_floor import FLOOR, copy_subjects, settle
from bench._copy_floor import METHOD as COPY_METHOD
from bench._common import geomean, provenance, timing_method, winner_params, write_result

SHAPES = [(4096, 768), (4096, 1024), (4096, 2048), (4096, 4096), (4096, 8192), (65536, 768), (32768, 4096)]
ROUNDS, PER_ROUND = 5, 6
COPY_BYTES = 2 << 30
TIE_FRACTION_OF_COPY = 0.97


def copy_bandwidth() -> Timing:
    """Device-to-device copy, bytes read plus bytes written per second, as bytes/µs samples."""
    src = torch.empty(COPY_BYTES // 4, dtype=torch.float32, device="cuda").normal_()
    dst = torch.empty_like(src)
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    samples = []
    for i in range(13):
        begin.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        if i >= 3:
            samples.append(2 * COPY_BYTES / (begin.elapsed_time(end) * 1000.0))
    return Timing.from_samples("copy", samples)


@triton.jit
def _empty_kernel(X):
    pass


def floor_subjects(m: int, d: int) -> list[TorchSubject]:
    """The copies of the bytes a layer norm moves (bench/_copy_floor.py) and empty kernels on M blocks and on 4 per SM."""
    x = torch.empty(1, device="cuda")
    blocks = 4 * gpu.open_device().sms
    return [*copy_subjects(2 * m * d * 4),
            TorchSubject("floor:empty_grid_m", lambda: _empty_kernel[(m,)](x, num_warps=4)),
            TorchSubject(f"floor:empty_grid_{blocks}", lambda: _empty_kernel[(blocks,)](x, num_warps=4))]


def bench_shape(op, m: int, d: int, params, device, copy_bytes_per_us: float) -> dict:
    shape, run = op.shape(d=d), {"m": m}
    variant = build(op, shape, params, device.arch)
    bench = Bench(op, shape, run, seed=m + d)
    kernel = bench.load(variant)
    try:
        subject, checked = bench.checked_subject(variant, kernel, name="mage-gen")
        if subject is None:
            return {"m": m, "d": d, "kernel": variant.source.kernel_name, "gate": checked.to_dict()}
        inputs = subject.bound.inputs
        peers, missing = make_peers(op, shape, run, inputs, None, check=bench.check_tensor)
        floors = floor_subjects(m, d)
        everyone = [subject, *peers, *floors]
        hot = interleave(everyone, "hot", ROUNDS, PER_ROUND)
        cold = interleave(everyone, "cold", ROUNDS, PER_ROUND)
        subject.close()
        copy_is = settle(floors, hot, cold)
    finally:
        kernel.unload()
    moved = op.bytes_moved(shape, run)
    floor_us = moved / copy_bytes_per_us
    result = {
        "m": m, "d": d, "kernel": variant.source.kernel_name, "params": op.params_to_dict(params),
        "census": {k: variant.census.to_dict()[k] for k in ("registers", "shared_bytes", "spill_bytes", "bar_sync")},
        "gate": checked.to_dict(), "bytes_moved": moved, "copy_floor_us": floor_us,
        "timings": {name: {"hot": hot[name].to_dict(), "cold": cold[name].to_dict()} for name in hot},
        "peer_configs": {p.name: p.config for p in peers}, "peers_missing": missing,
        "copy_configs": {f.name: f.config for f in floors if f.name.startswith(FLOOR)}, "copy_floor_is": copy_is,
    }
    for method, table in (("hot", hot), ("cold", cold)):
        mine = table["mage-gen"].median_us
        result[f"{method}_ratio"] = {p.name: mine / table[p.name].median_us for p in peers}
        if "triton" in table:
            result[f"{method}_copy_floor_ratio_to_triton"] = table["floor:copy"].median_us / table["triton"].median_us
        result[f"{method}_bandwidth_fraction"] = floor_us / mine
        # the copy of the same bytes, timed the same way in the same rounds, over this kernel's time
        result[f"{method}_fraction_of_copy"] = table["floor:copy"].median_us / mine
        if "triton" in table:
            # a tie within the spread counts only where both sit at ≥ TIE_FRACTION_OF_COPY of the copy: there
            # neither can gain much
            ours, theirs, copy = table["mage-gen"], table["triton"], table[FLOOR].median_us
            both_near_copy = min(copy / ours.median_us, copy / theirs.median_us) >= TIE_FRACTION_OF_COPY
            result[f"{method}_at_most_triton"] = (ours.median_us <= theirs.median_us
                                                   or (ours.ties_with(theirs) and both_near_copy))
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tune-missing", action="store_true", help="tune a d that has no winner in tuned/")
    args = parser.parse_args()
    op = get_op("layernorm")
    device = gpu.open_device()
    # each shape runs the kernel the runtime dispatches to: the size class picked for its M on this GPU's L2
    params = {(m, d): winner_params(op, op.shape(d=d), device, args.tune_missing, ["--d", str(d), "--m", "4096"],
                                    run={"m": m}) for m, d in SHAPES}
    copy = copy_bandwidth()
    rows = [bench_shape(op, m, d, params[m, d], device, copy.median_us) for m, d in SHAPES]
    timed = [r for r in rows if "timings" in r]
    ratios = [r["hot_ratio"]["triton"] for r in timed if "triton" in r["hot_ratio"]]
    copy_ratios = [r["hot_copy_floor_ratio_to_triton"] for r in timed if "hot_copy_floor_ratio_to_triton" in r]
    summary = {
        "geomean_hot_ratio_to_triton": geomean(ratios),
        "max_hot_ratio_to_triton": max(ratios) if ratios else None,
        # What the geomean would be for a layer norm exactly as fast as copying x into y at every shape.
        "geomean_hot_copy_floor_ratio_to_triton": geomean(copy_ratios),
        "hot_bandwidth_fraction": {f"{r['m']}x{r['d']}": r["hot_bandwidth_fraction"] for r in timed},
        "all_gated": len(timed) == len(rows),
        # at most Triton hot and cold (a tie within spread counts where both sit at ≥ 97% of the copy), and the
        # copy of the same bytes over the
        # kernel's time, cold, in the same run
        "at_most_triton_hot_and_cold": {f"{r['m']}x{r['d']}": bool(r.get("hot_at_most_triton") and
                                                                   r.get("cold_at_most_triton")) for r in timed},
        "cold_fraction_of_copy": {f"{r['m']}x{r['d']}": r["cold_fraction_of_copy"] for r in timed},
    }
    doc = {
        "what": "tuned mage-gen layer norm vs torch and Triton (best num_warps), fp32, recorded by bench/layernorm.py",
        "method": {
            "gate": f"fresh inputs, NaN-poisoned fenced output, rows 1, 37 and min(M, the op's cap), relative norm "
                    f"vs float64 ≤ {op.tolerance:g}; then M rows of the timing inputs, compared on the GPU; peers "
                    "gated on the timing inputs the same way",
            "dispatch": "each shape's kernel is the tuned size class mage_gen.dispatch picks for its M",
            **timing_method(ROUNDS, PER_ROUND),
            "copy_bandwidth": "torch device-to-device copy of 2 GiB, (read + write bytes) / time, median of 10",
            "bandwidth_fraction": "bytes a layer norm must move (x read, y written once) / copy bandwidth / time",
            "floors": "timed like the kernels, interleaved with them: floor:copy is " + COPY_METHOD + ", of an "
                      "M×d fp32 x into y (the bytes a layer norm moves, nothing computed); floor:empty_grid_* is an "
                      "empty Triton kernel of 4 warps per block on M blocks and on 528 (4 per SM)",
        },
        **provenance(device),
        "copy_bandwidth_bytes_per_us": copy.to_dict(), "shapes": rows, "summary": summary,
    }
    out = write_result(device, "layernorm.json", json.dumps(doc, indent=1) + "\n")
    print(f"copy bandwidth {copy.median_us / 1e6:.3f} TB/s")
    print(f"{'M×d':>11} {'kernel':48} {'hot':>7} {'triton':>7} {'torch':>7} {'ratio':>6} {'BW%':>5} {'cold':>7} {'tr.cold':>7}"
          f" {'copy':>7} {'empty M':>7}")
    for r in rows:
        if "timings" not in r:
            print(f"{r['m']}x{r['d']:<6} {r['kernel']:48} FAILED GATE: {r['gate']['reason']}")
            continue
        t = r["timings"]
        print(f"{r['m']:>5}x{r['d']:<5} {r['kernel']:48} {t['mage-gen']['hot']['median_us']:7.2f} "
              f"{t.get('triton', {}).get('hot', {}).get('median_us', float('nan')):7.2f} "
              f"{t.get('torch', {}).get('hot', {}).get('median_us', float('nan')):7.2f} "
              f"{r['hot_ratio'].get('triton', float('nan')):6.3f} {100 * r['hot_bandwidth_fraction']:5.1f} "
              f"{t['mage-gen']['cold']['median_us']:7.2f} {t.get('triton', {}).get('cold', {}).get('median_us', float('nan')):7.2f}"
              f" {t['floor:copy']['hot']['median_us']:7.2f} {t['floor:empty_grid_m']['hot']['median_us']:7.2f}")
    print(json.dumps(summary))
    print(f"wrote {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
