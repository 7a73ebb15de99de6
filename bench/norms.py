"""bf16 layer norm and RMSNorm, with and without the fused residual add, on this GPU: the kernel the runtime
dispatches to against torch (eager), torch.compile (Inductor) of the same eager code and Triton at its best
num_warps, hot and cold, with the device copy of the same bytes timed beside each shape.

Each shape uses this GPU's tuned entry for (op, d, dtypes, residual) of the size class mage_gen.dispatch picks
for its M; with --tune-missing, a shape without one is tuned first with `mage-gen tune --objective both` (ranked
by hot and cold at once, as the shapes are judged). Every kernel and peer is gated at the benched shape before it is
timed, y and residual_out both. Writes bench/results/<gpu>/norms.json.

    python -m bench.norms --tune-missing
    python -m bench.norms --only rmsnorm:4096x8192 layernorm+res:65536x768   # those rows alone, to norms_only.json
"""

from __future__ import annotations

import argparse
import json
import sys

from mage_gen import gpu
from mage_gen.measure import Bench, common_to_every_placement, interleave_rounds, pool_rounds
from mage_gen.ops import get_op
from mage_gen.dtypes import dtype
from mage_gen.peers import make_peers, on_gpu
from mage_gen.timing import round_ratio
from mage_gen.variants import Variant, build

from bench._copy_floor import CANDIDATES as COPY_CANDIDATES
from bench._copy_floor import FLOOR, PICK, picked_copies
from bench._common import (geomean, provenance, report_contenders, stored_case, timing_method,
                           winner_params, write_result)

SHAPES = [(4096, 768), (4096, 4096), (4096, 8192), (65536, 768), (32768, 4096), (16384, 8192)]
OPS = ("layernorm", "rmsnorm")
DTYPE = "bf16"
PEERS = ("torch", "inductor", "triton")
PLACEMENTS = 4  # of the inputs and outputs (mage_gen.measure.Placement)
# round r at placement r % PLACEMENTS: 80 samples a subject and method, 20 at each placement. At 20 (4 rounds) the
# cold ratio of a DRAM-bound row where kernel and peer both stream at the copy's rate moved ±0.5% from run to run,
# landing either side of 1.000 (bench/NOTES.md, norms §23-§24)
ROUNDS, PER_ROUND = 16, 5
DRAM_L2S = 2  # a shape is DRAM-bound where it moves at least this many L2s of bytes


def row_key(op_name: str, residual: bool, m: int, d: int) -> str:
    return f"{op_name}{'+res' if residual else ''}:{m}x{d}"


def tune_flags(shape, m: int) -> list[str]:
    # the acceptance asks hot and cold of every shape: rank by both
    flags = ["--d", str(shape.d), "--dtype", DTYPE, "--m", str(m), "--objective", "both"]
    return flags + (["--config", "residual=true"] if shape.residual else [])


def bench_shape(op, shape, m: int, params, device, contenders: dict | None = None, rounds: int = ROUNDS,
                keep_samples: bool = False) -> dict:
    """One row: the kernel of `params` (named mage-gen) against the peers and the copy, at every placement.
    contenders (name -> params, or a variant built already, as a probe builds one its op does not render): other
    kernels timed beside it in the same rounds, each gated at every placement (one that fails anywhere is named in
    the result and timed nowhere); the ratios are the named kernel's. keep_samples: every sample too, by method
    and round ({method: [{name: samples}]}, round r at placement r % PLACEMENTS), under "samples"."""
    run = {"m": m}
    variant = build(op, shape, params, device.arch)
    bench = Bench(op, shape, run, seed=m + shape.d)
    kernel = bench.load(variant)
    others = {name: p if isinstance(p, Variant) else build(op, shape, p, device.arch)
              for name, p in (contenders or {}).items()}
    other_kernels = {name: bench.load(v) for name, v in others.items()}
    failed: dict[str, str] = {}
    moved = op.bytes_moved(shape, run)
    head = {"op": op.name, "m": m, "d": shape.d, "residual": shape.residual, "dtype": shape.dtype,
            "kernel": variant.source.kernel_name, "params": op.params_to_dict(params), "bytes_moved": moved,
            "regime": "dram" if moved >= DRAM_L2S * device.l2_bytes else "l2"}
    opened, hot_groups, cold_groups = [], [], []
    peer_configs, copy_configs, missing, checks = {}, {}, {}, {}
    try:
        # At each placement every subject reads one copy of the inputs, and the kernel and the Triton peer write
        # one y (and residual_out): where x and y lie moves a DRAM-bound norm by 2-4% either way and favours one
        # kernel over another (NOTES.md, norms §10, §15); the rounds visit the placements in turn.
        subject, checked = bench.checked_subject(variant, kernel, name="mage-gen", placement=0)
        if subject is None:
            return {**head, "gate": checked.to_dict()}
        opened.append(subject)
        for p in range(PLACEMENTS):
            place = bench.placement(p)
            if p:
                subject, err, reason = bench.checked_at(variant, kernel, "mage-gen", placement=p)
                if subject is None:
                    return {**head, "gate": {**checked.to_dict(), "passed": False,
                                             "reason": f"placement {p}: {reason}"}}
                opened.append(subject)
                checks[f"placement {p}"] = err
            placed = []
            for name, v in others.items():
                if name in failed:
                    continue
                if p:
                    other, _, reason = bench.checked_at(v, other_kernels[name], name, placement=p)
                else:
                    other, gate = bench.checked_subject(v, other_kernels[name], name=name, placement=0)
                    reason = gate.reason
                if other is None:
                    failed[name] = f"placement {p}: {reason}"
                    continue
                opened.append(other)
                placed.append(other)
            peers, lacking = make_peers(op, shape, run, subject.bound.inputs, None, check=bench.check_tensor,
                                        inductor=True, device_inputs=place.input_pointers(),
                                        device_outputs=place.output_pointers())
            opened.extend(peers)
            missing.update({name: f"placement {p}: {why}" for name, why in lacking.items()})
            for peer in peers:
                peer_configs.setdefault(peer.name, []).append(peer.config)
            activations = [on_gpu(place.inputs[k].ptr, subject.bound.inputs[k].shape, dtype(shape.dtype))
                           for k in ("x", "residual") if k in place.inputs]
            picked = picked_copies(moved, tuple(activations))
            for method, copy in picked.items():
                copy_configs.setdefault(method, []).append({"copy": copy.name.removeprefix(FLOOR + "/"),
                                                            **copy.config})
            opened.extend({id(c): c for c in picked.values()}.values())
            hot_groups.append([subject, *placed, *peers, _as_floor(picked["hot"])])
            cold_groups.append([subject, *placed, *peers, _as_floor(picked["cold"])])
        hot_groups, left_out = common_to_every_placement(hot_groups)
        cold_groups, _ = common_to_every_placement(cold_groups)
        missing.update({name: "missing at some placement" for name in left_out
                        if name not in missing and name not in failed})
        taken = {"hot": interleave_rounds(hot_groups, "hot", rounds, PER_ROUND),
                 "cold": interleave_rounds(cold_groups, "cold", rounds, PER_ROUND)}
        hot, hot_at = pool_rounds(taken["hot"], "hot", len(hot_groups))
        cold, cold_at = pool_rounds(taken["cold"], "cold", len(cold_groups))
        changed = bench.inputs_changed()
        if changed:
            raise SystemExit(f"{op.name} {m}x{shape.d}: a kernel or peer wrote into its inputs {changed}; "
                             "every subject reads them in place, so none of this shape's figures can stand")
    finally:
        for s in opened:
            s.close()
        kernel.unload()
        for k in other_kernels.values():
            k.unload()
        bench.free_placements()
    result = {
        **head, "census": {k: variant.census.to_dict()[k] for k in ("registers", "spill_bytes", "bar_sync",
                                                                    "half_widen", "half_narrow")},
        "gate": {**checked.to_dict(), "at the other placements": checks},
        "timings": {name: {"hot": hot[name].to_dict(), "cold": cold[name].to_dict()} for name in hot},
        "by_placement": {name: {"hot": [round(t[name].median_us, 3) for t in hot_at],
                                "cold": [round(t[name].median_us, 3) for t in cold_at]} for name in hot},
        "peer_configs": {name: {**c[0], "at the other placements": c[1:]} for name, c in peer_configs.items()},
        "peers_missing": missing, "copy_configs": copy_configs,
    }
    if keep_samples:
        result["samples"] = taken
    if contenders:
        result["contenders"] = {name: {"kernel": v.source.kernel_name, "params": op.params_to_dict(v.params),
                                       **({"failed": failed[name]} if name in failed else {})}
                                for name, v in others.items()}
    for method, table in (("hot", hot), ("cold", cold)):
        mine = table["mage-gen"]
        present = [name for name in PEERS if name in table]
        best = min(present, key=lambda name: table[name].median_us) if present else None
        result[f"{method}_ratio"] = {name: mine.median_us / table[name].median_us for name in present}
        result[f"{method}_best_peer"] = best
        if best:
            result[f"{method}_ratio_to_best_peer"] = mine.median_us / table[best].median_us
            result[f"{method}_ties_best_peer"] = mine.ties_with(table[best])
            result[f"{method}_round_ratio_to_best_peer"] = round_ratio(
                [by["mage-gen"] for by in taken[method]], [by[best] for by in taken[method]]).to_dict()
        # the copy of the same bytes, timed the same way in the same rounds, over this kernel's time
        result[f"{method}_fraction_of_copy"] = table[FLOOR].median_us / mine.median_us
    return result


def probe_contenders(doc: dict, filename: str, cases, contenders_of) -> None:
    """A probe's run: at each (op, residual, m, d) of `cases` the stored kernel beside contenders_of(op, shape,
    stored params, device) (name -> params or a built variant) in bench_shape's rounds, each contender's time over
    the stored kernel's paired round by round and printed (row["paired"]); rows into doc["rows"] by label, doc
    written to bench/results/<gpu>/<filename>."""
    device = None
    for op_name, residual, m, d in cases:
        device, op, shape, _, stored = stored_case(op_name, m, d, residual=residual)
        label = f"{op_name}{'+res' if residual else ''}:{m}x{d}"
        contenders = contenders_of(op, shape, stored, device)
        row = bench_shape(op, shape, m, stored, device, contenders=contenders, keep_samples=True)
        row["paired"] = report_contenders(label, row, contenders, row.pop("samples", {}))
        doc.setdefault("rows", {})[label] = row
    doc.update(provenance(device))
    write_result(device, filename, json.dumps(doc, indent=1) + "\n")


def _against_best(r: dict, method: str) -> str:
    rounds = r[f"{method}_round_ratio_to_best_peer"]
    return (f"{method} {r['timings']['mage-gen'][method]['median_us']:7.2f} ({r[f'{method}_ratio_to_best_peer']:.3f}× "
            f"{r[f'{method}_best_peer']}, rounds {rounds['low']:.4f}-{rounds['high']:.4f})")


def _as_floor(copy):
    """A placement's pick of the copies, timed under the one name the floor has at every placement."""
    copy.name = FLOOR
    return copy


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tune-missing", action="store_true", help="tune a shape that has no winner in tuned/")
    parser.add_argument("--only", nargs="+", metavar="OP[+res]:MxD",
                        help="bench these rows alone and write norms_only.json (norms.json is the whole sweep)")
    args = parser.parse_args()
    keys = {row_key(name, residual, m, d) for name in OPS for residual in (False, True) for m, d in SHAPES}
    unknown = sorted(set(args.only or ()) - keys)
    if unknown:
        parser.error(f"--only: no row {', '.join(unknown)}; rows are {', '.join(sorted(keys))}")
    device = gpu.open_device()
    plan = []
    for name in OPS:
        op = get_op(name)
        for residual in (False, True):
            for m, d in SHAPES:
                if args.only and row_key(name, residual, m, d) not in args.only:
                    continue
                shape = op.shape(d=d, dtype=DTYPE, residual=residual)
                params = winner_params(op, shape, device, args.tune_missing,
                                       tune_flags(shape, m), run={"m": m})
                plan.append((op, shape, m, params))
    rows = []
    for op, shape, m, params in plan:
        rows.append(bench_shape(op, shape, m, params, device))
        r = rows[-1]
        if "timings" in r:
            print(f"{op.name:9} {'res' if shape.residual else '   '} {m:>5}x{shape.d:<5} {r['kernel']:54} "
                  f"{_against_best(r, 'hot')} {_against_best(r, 'cold')} copy {r['cold_fraction_of_copy']:.3f}",
                  flush=True)
        else:
            print(f"{op.name} {m}x{shape.d} residual={shape.residual}: FAILED GATE {r['gate']['reason']}", flush=True)
    timed = [r for r in rows if "timings" in r]
    label = [f"{r['op']}{'+res' if r['residual'] else ''} {r['m']}x{r['d']}" for r in timed]
    summary = {
        "all_gated": len(timed) == len(rows),
        "geomean_hot_ratio_to_best_peer": geomean([r["hot_ratio_to_best_peer"] for r in timed]),
        "max_hot_ratio_to_best_peer": max(r["hot_ratio_to_best_peer"] for r in timed) if timed else None,
        "max_cold_ratio_to_best_peer": max(r["cold_ratio_to_best_peer"] for r in timed) if timed else None,
        "at_most_best_peer_hot_and_cold": {key: r["hot_ratio_to_best_peer"] <= 1.0 and r["cold_ratio_to_best_peer"] <= 1.0
                                           for key, r in zip(label, timed)},
        "tied_where_slower": {key: [m for m in ("hot", "cold") if r[f"{m}_ratio_to_best_peer"] > 1.0
                                    and r[f"{m}_ties_best_peer"]] for key, r in zip(label, timed)},
        # where a ratio is over 1.00: the rounds' paired ratios either lie above it (slower) or hold it (a tie)
        "round_verdicts_where_over": {key: {m: r[f"{m}_round_ratio_to_best_peer"]["verdict"] for m in ("hot", "cold")
                                            if r[f"{m}_ratio_to_best_peer"] > 1.0}
                                      for key, r in zip(label, timed) if any(r[f"{m}_ratio_to_best_peer"] > 1.0
                                                                             for m in ("hot", "cold"))},
        "slower_than_best_peer_by_rounds": [f"{key} {m}" for key, r in zip(label, timed) for m in ("hot", "cold")
                                            if r[f"{m}_round_ratio_to_best_peer"]["verdict"] == "slower"],
        "dram_cold_fraction_of_copy": {key: r["cold_fraction_of_copy"] for key, r in zip(label, timed)
                                       if r["regime"] == "dram"},
    }
    doc = {
        "what": "tuned mage-gen bf16 norms vs torch, Inductor and Triton (best num_warps), with and without the "
                "fused residual add; recorded by bench/norms.py",
        "method": {
            "gate": "fresh inputs, NaN-poisoned fenced outputs at the op's gate sizes against the float64 reference "
                    "rounded to bf16 (y within one bf16 ulp in relative norm, residual_out bit for bit); then M rows "
                    "of the timing inputs, compared on the GPU; peers gated on the timing inputs the same way",
            "dispatch": "each shape's kernel is the tuned size class mage_gen.dispatch picks for its M",
            "inputs": f"{PLACEMENTS} copies of each shape's inputs on the GPU (placements: the second and later "
                      "each after a spacer 3 MB longer than the last), each read in place by the kernel, every peer "
                      "and the copies of the floor that read the kernel's activations, and checked bit for bit "
                      "after the rounds; the kernel is checked again on each placement's inputs, and every peer "
                      "gated there",
            "placements": f"round r is taken at placement r % {PLACEMENTS}; medians and spreads are of the samples "
                          "pooled over the placements (by_placement: each placement's median)",
            "peers": "torch: F.layer_norm / F.rms_norm (of x + residual, computed first, in the residual form); "
                     "inductor: torch.compile(fullgraph=True, dynamic=False) of that eager code, its results "
                     "copied into the shared outputs (one fused kernel stores them there); triton: one "
                     "program per row, bf16 loads, fp32 math, best num_warps of 2/4/8/16 by hot time",
            "outputs": "at each placement the kernel writes y (and residual_out) into that placement's fenced "
                       "buffers; the Triton and Inductor peers write into the same memory (each gated after a "
                       "NaN fill of it); torch allocates its own",
            **timing_method(ROUNDS, PER_ROUND),
            "floor:copy": "bytes_moved / 2 bytes read and as many written (what the norm moves): the fastest "
                          f"hot, and the fastest cold, of {COPY_CANDIDATES}, picked at each placement by {PICK}; "
                          "each timed in its method's rounds as the floor at that placement",
            "regime": f"dram where bytes moved ≥ {DRAM_L2S}× the GPU's L2",
            "round_ratio": "the kernel's median over the best peer's in each round (the two interleaved there, at the "
                           "round's placement), the median of those and the interval from the k-th smallest to the "
                           "k-th largest, k as large as keeps its coverage of the median ≥ 95% (binomial; 97.9% at "
                           "16 rounds): verdict slower where it lies above 1, faster below, a tie where it holds 1",
        },
        **provenance(device), "shapes": rows, "summary": summary,
    }
    out = write_result(device, "norms_only.json" if args.only else "norms.json", json.dumps(doc, indent=1) + "\n")
    print(json.dumps(summary, indent=1))
    print(f"wrote {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
