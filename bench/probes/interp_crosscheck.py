"""The CPU PTX interpreter (mage_gen.interp) against this GPU: random layer-norm and matmul variants, each
run on both with the same inputs. Without an approximate instruction (rsqrt.approx, div.full, any .approx)
the two outputs must agree bit for bit; with one, each must lie within the op's tolerance of the other and
of the float64 reference. NaN never passes, nor does a write outside an output.
PTX may leave an add or multiply's rounding open (add.f32 without .rn: ptxas may fuse it into an fma), so
such a variant is checked twice: as built, within tolerance, and compiled with --fmad=false, where every
rounding is in the PTX, bit for bit.
Writes bench/results/<gpu>/interp_crosscheck.json; exits 1 if any pair fails.

    python -m bench.probes.interp_crosscheck [--seed 0] [--pairs 64]
    python -m bench.probes.interp_crosscheck --cpu-only --pairs 8    # interpreter half only, against float64
    python -m bench.probes.interp_crosscheck --self-test             # the comparison, on made-up outputs
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import multiprocessing
import os
import re
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from typing import Any

import numpy as np

from mage_gen import gpu, interp
from mage_gen.census import take_census
from mage_gen.compile import compile_source
from mage_gen.errors import GpuError, MageError
from mage_gen.interp.gate import launch_with
from mage_gen.measure import Bound
from mage_gen.verdict import relative_error
from mage_gen.ops import get_op
from mage_gen.space import expand, load_space
from mage_gen.variants import Variant, build

# fp.py: div.full is as approximate on the GPU as the .approx forms, and the interpreter rounds it exactly.
APPROX_OPCODE = re.compile(r"^\s*(?:@!?%\w+\s+)?\w[\w:.]*?\.(?:approx|full)[.\s;]", re.M)
# add/sub/mul without .rn may be fused into an fma by ptxas: the first suspect when an exact pair differs.
FUSABLE_OPCODE = re.compile(r"^\s*(?:@!?%\w+\s+)?(?:add|sub|mul)\.f32\s", re.M)


@dataclasses.dataclass
class Pair:
    op: str
    shape: Any
    run: dict[str, int]
    params: Any
    inputs: dict[str, np.ndarray]


def draw_pairs(count: int, seed: int, sms: int | None) -> list[Pair]:
    """Alternately layer norm (d in 1..1024, M in 1..3, full space; sized for a GPU of `sms` SMs, or without the
    configs given per SM) and matmul (1..128 each, explore space); a shape without valid params is redrawn. Each
    pair's inputs come from its own (seed, index) stream."""
    rng, pairs = np.random.default_rng(seed), []
    ln, mm = get_op("layernorm"), get_op("matmul")
    ln_space, mm_space = load_space(ln, "full", sms=sms), load_space(mm, "explore")

    def dim(top: int, common: list[int]) -> int:
        return int(rng.choice(common) if rng.random() < 0.25 else rng.integers(1, top + 1))

    while len(pairs) < count:
        if len(pairs) % 2 == 0:
            op, shape, run = ln, ln.shape(d=dim(1024, [768, 1000, 1024])), {"m": int(rng.integers(1, 4))}
            valid, _ = expand(op, shape, ln_space)
        else:
            op, run = mm, {}
            shape = mm.shape(m=dim(128, [64, 128]), n=dim(128, [64, 128]), k=dim(128, [64, 128]))
            valid, _ = expand(op, shape, mm_space)
        if valid:
            params = valid[int(rng.integers(len(valid)))]
            inputs = op.make_inputs(shape, run, np.random.default_rng([seed, len(pairs)]))
            pairs.append(Pair(op.name, shape, run, params, inputs))
    return pairs


def build_pair(pair: Pair, arch: str, fmad: bool = True) -> Variant | str:
    """The variant (fmad=False: compiled with every rounding in the PTX), or why it did not build (a failed
    pair, not a failed run)."""
    try:
        variant = build(get_op(pair.op), pair.shape, pair.params, arch)
        if fmad:
            return variant
        compiled = compile_source(variant.source, arch, fmad=False)
        return dataclasses.replace(variant, compiled=compiled, census=take_census(compiled))
    except MageError as exc:
        return f"build: {type(exc).__name__}: {exc}"


def is_approx(variant: Variant) -> bool:
    return bool(APPROX_OPCODE.search(variant.compiled.ptx))  # rsqrt.approx among them


def needs_twin(variant: Variant | str) -> bool:
    """Exact but for roundings left to ptxas: worth a second, --fmad=false build."""
    return (isinstance(variant, Variant) and not is_approx(variant)
            and bool(FUSABLE_OPCODE.search(variant.compiled.ptx)))


def interp_half(pair: Pair, variant: Variant) -> dict:
    """The interpreter on the pair's inputs: {'outputs', 'seconds'} or {'error', 'seconds'}."""
    start = time.perf_counter()
    try:
        outputs = launch_with(get_op(pair.op), pair.shape, variant, pair.run, pair.inputs)
    except interp.InterpError as exc:
        return {"error": f"interpreter: {type(exc).__name__}: {exc}", "seconds": time.perf_counter() - start}
    return {"outputs": outputs, "seconds": time.perf_counter() - start}


def gpu_half(pair: Pair, variant: Variant, stream: Any) -> dict:
    """One launch into NaN-poisoned, fenced outputs, as measure.gate runs it: {'outputs', 'fence'} or {'error'}."""
    op = get_op(pair.op)
    kernel = bound = None
    try:
        launch = op.geometry(pair.shape, pair.params, pair.run)
        kernel = gpu.Kernel(variant.compiled.cubin, variant.source.kernel_name, launch.dynamic_shared_bytes)
        bound = Bound(op, pair.shape, pair.params, kernel, pair.run, pair.inputs)
        bound.poison(stream)
        bound.enqueue(stream.handle)
        stream.synchronize()
        outputs, fence = bound.outputs()
        return {"outputs": outputs, "fence": fence}
    except GpuError as exc:
        return {"error": f"gpu: {exc}"}
    finally:
        with contextlib.suppress(GpuError):  # after a launch fault the context refuses even these; already recorded
            if bound is not None:
                bound.free()
            if kernel is not None:
                kernel.unload()


def ulp_order(x: np.ndarray) -> np.ndarray:
    """float32 bits as integers that count ulps across zero (±0 alike)."""
    i = x.view(np.int32).astype(np.int64)
    return np.where(i < 0, -(2**31) - i, i)


def compare(op: Any, pair: Pair, approx: bool, mine: dict, theirs: dict | None) -> dict:
    """The verdict on one pair; `theirs` (the GPU's half) None compares the interpreter with float64 only."""
    reference = op.reference(pair.shape, pair.inputs, op.scalars(pair.shape, pair.run))
    halves = {"interp": mine} if theirs is None else {"interp": mine, "gpu": theirs}
    rec: dict[str, Any] = {"fence": theirs.get("fence", []) if theirs else [], "bit_exact": None,
                           "differing": None, "max_ulp": None, "rel_interp_gpu": None}
    errors = [h["error"] for h in halves.values() if "error" in h] + rec["fence"]
    if errors:
        return {**rec, "passed": False, "reason": "; ".join(errors)}
    reasons = []
    for side, half in halves.items():
        worst = 0.0
        for name, ref in reference.items():
            if (nans := int(np.isnan(half["outputs"][name]).sum())):
                reasons.append(f"{side} {name} has {nans} NaN")
            worst = max(worst, relative_error(half["outputs"][name], ref))
        rec[f"rel_{side}_ref"] = worst if math.isfinite(worst) else None
        if (approx or theirs is None) and not worst <= op.tolerance:
            reasons.append(f"{side} vs float64 {worst:.3g} > {op.tolerance:g}")
    if theirs is not None:
        a = np.concatenate([mine["outputs"][n].ravel() for n in reference])
        b = np.concatenate([theirs["outputs"][n].ravel() for n in reference])
        rec["differing"] = int(np.count_nonzero(a.view(np.uint32) != b.view(np.uint32)))
        rec["bit_exact"] = rec["differing"] == 0
        rec["max_ulp"] = int(np.abs(ulp_order(a) - ulp_order(b)).max(initial=0))
        rel = relative_error(b, a.astype(np.float64))
        rec["rel_interp_gpu"] = rel if math.isfinite(rel) else None
        if not approx and not rec["bit_exact"]:
            reasons.append(f"{rec['differing']} elements differ (max {rec['max_ulp']} ulp)")
        if approx and not rel <= op.tolerance:
            reasons.append(f"interp vs gpu {rel:.3g} > {op.tolerance:g}")
    return {**rec, "passed": not reasons, "reason": "; ".join(reasons)}


def self_test() -> None:
    """compare() on made-up outputs: equal, one ulp apart, NaN, and a written fence."""
    op, shape = get_op("matmul"), get_op("matmul").shape(m=3, n=4, k=5)
    pair = Pair("matmul", shape, {}, None, op.make_inputs(shape, {}, np.random.default_rng(0)))
    c = (pair.inputs["A"].astype(np.float64) @ pair.inputs["B"]).astype(np.float32)
    off, nan = c.copy(), c.copy()
    off[1, 2], nan[0, 0] = np.nextafter(c[1, 2], np.float32(np.inf)), np.nan

    def check(approx: bool, theirs: np.ndarray, fence: tuple[str, ...] = ()) -> dict:
        return compare(op, pair, approx, {"outputs": {"C": c}}, {"outputs": {"C": theirs}, "fence": list(fence)})

    same, one = check(False, c.copy()), check(False, off)
    assert same["passed"] and same["bit_exact"] and same["max_ulp"] == 0, same
    assert not one["passed"] and one["differing"] == 1 and one["max_ulp"] == 1, one
    assert check(True, off)["passed"] and not check(True, nan)["passed"] and not check(False, nan)["passed"]
    assert not check(False, c.copy(), ("wrote 1 floats outside C",))["passed"]
    assert not compare(op, pair, False, {"error": "interpreter: RaceError"}, None)["passed"]
    assert not compare(op, pair, False, {"outputs": {"C": -c}}, None)["passed"]  # cpu-only: against float64
    assert ulp_order(np.array([-0.0, 0.0, np.float32(1e-45), -np.float32(1e-45)], np.float32)).tolist() == [0, 0, 1, -1]
    print("self-test passed")


def record(i: int, pair: Pair, variant: Variant | str, fmad: bool, mine: dict, theirs: dict | None) -> dict:
    """One check's entry in the results, printed as one line. approx: compared within tolerance."""
    built = isinstance(variant, Variant)
    fusable = len(FUSABLE_OPCODE.findall(variant.compiled.ptx)) if built else None
    approx = built and (is_approx(variant) or bool(fusable))
    rec = {"op": pair.op, "shape": dataclasses.asdict(pair.shape), "run": pair.run, "params": pair.params.label(),
           "kernel": variant.source.kernel_name if built else None, "build": "as built" if fmad else "fmad off",
           "approx": approx, "approx_instructions": built and is_approx(variant), "fusable_fp_ops": fusable,
           **compare(get_op(pair.op), pair, approx, mine, theirs), "interp_seconds": round(mine["seconds"], 3)}
    shape = "x".join(str(v) for v in [*rec["shape"].values(), *rec["run"].values()])
    print(f"{i:3} {pair.op:9} {shape:12} {rec['params'][:52]:52} {rec['build']:8} {'approx' if approx else 'exact':6} "
          f"{'ok  ' if rec['passed'] else 'FAIL'} diff={rec['differing']} ulp={rec['max_ulp']} "
          f"{rec['interp_seconds']:6.2f}s {rec['reason']}", flush=True)
    return rec


def crosscheck(pairs: list[Pair], arch: str, stream: Any, workers: int) -> list[dict]:
    # spawn: the workers must not inherit this process's CUDA context
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        as_built = list(pool.map(build_pair, pairs, [arch] * len(pairs)))
        twin_of = [i for i, v in enumerate(as_built) if needs_twin(v)]
        twins = list(pool.map(build_pair, [pairs[i] for i in twin_of], [arch] * len(twin_of), [False] * len(twin_of)))
        checks = [(i, pairs[i], v, True) for i, v in enumerate(as_built)]
        checks += [(i, pairs[i], v, False) for i, v in zip(twin_of, twins)]
        built = [isinstance(v, Variant) for _, _, v, _ in checks]
        futures = [pool.submit(interp_half, p, v) if ok else None for (_, p, v, _), ok in zip(checks, built)]
        # the GPU halves run here while the pool interprets
        theirs = [gpu_half(p, v, stream) if ok and stream else None for (_, p, v, _), ok in zip(checks, built)]
        return [record(i, p, v, fmad, f.result() if f else {"error": v, "seconds": 0.0}, g)
                for (i, p, v, fmad), f, g in zip(checks, futures, theirs)]


def summarize(records: list[dict], wall_seconds: float) -> dict:
    exact = [r for r in records if not r["approx"]]
    compared = any(r["bit_exact"] is not None for r in records)  # not with --cpu-only
    return {"pairs": sum(r["build"] == "as built" for r in records), "checks": len(records),
            "fmad_off_twins": sum(r["build"] == "fmad off" for r in records), "exact_eligible": len(exact),
            "bit_exact": sum(bool(r["bit_exact"]) for r in exact) if compared else None,
            "approx": len(records) - len(exact),
            "approx_within_tolerance": sum(r["passed"] for r in records if r["approx"]),
            "interp_seconds_total": round(sum(r["interp_seconds"] for r in records), 1),
            "wall_seconds": round(wall_seconds, 1),
            "failures": [{"index": i, "op": r["op"], "shape": r["shape"], "run": r["run"], "params": r["params"],
                          "reason": r["reason"]} for i, r in enumerate(records) if not r["passed"]]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--pairs", type=int, default=64)
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--cpu-only", action="store_true", help="interpreter only, vs float64; writes nothing")
    parser.add_argument("--self-test", action="store_true", help="check the comparison on made-up outputs")
    args = parser.parse_args()
    if args.self_test:
        self_test()
        return 0
    device = stream = None
    if not args.cpu_only:
        from bench._common import provenance, write_result  # bench/_common.py; imports torch, so not in --cpu-only
        device, stream = gpu.open_device(), gpu.Stream()
        prov = provenance(device)  # before the long part: a missing package fails at once
    start = time.perf_counter()
    pairs = draw_pairs(args.pairs, args.seed, device.sms if device else None)
    records = crosscheck(pairs, device.arch if device else "sm_90", stream, args.workers)
    summary = summarize(records, time.perf_counter() - start)
    print(json.dumps({k: v for k, v in summary.items() if k != "failures"}), f"{len(summary['failures'])} failed")
    if device is not None:
        doc = {"what": "CPU PTX interpreter vs this GPU on the same inputs, recorded by "
                       "bench/probes/interp_crosscheck.py",
               "method": {"exact": "no approximate instruction and no rounding left to ptxas: GPU and interpreter "
                                   "outputs equal bit for bit",
                          "approx": "rsqrt.approx / div.full / .approx, or add/sub/mul.f32 without a rounding mode "
                                    "(ptxas may fuse them): relative norm of each vs the other and vs float64 "
                                    "within the op's tolerance",
                          "fmad off": "a variant exact but for fusable add/mul is also compiled with --fmad=false "
                                      "(every rounding in the PTX) and that build compared bit for bit",
                          "draw": "layernorm d 1..1024, M 1..3, full space; matmul m, n, k 1..128, explore space",
                          "seed": args.seed},
               **prov, "pairs": records, "summary": summary, "passed": not summary["failures"]}
        out = write_result(device, "interp_crosscheck.json", json.dumps(doc, indent=1) + "\n")
        print(f"wrote {out}", file=sys.stderr)
    return 1 if summary["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
