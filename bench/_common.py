"""What the benches share: this GPU's tuned winner (tuned first where asked), a built variant ready to launch,
where a result came from, and writing it under bench/results/<gpu>/ (the copy floor of the norm benches, which
needs Triton, is bench/_copy_floor.py: this module imports without it)."""

from __future__ import annotations

import argparse
import datetime
import json
import math
import subprocess
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

from mage_gen import __version__, gpu
from mage_gen.compile import nvrtc_version
from mage_gen.dispatch import choose_class
from mage_gen.errors import StoreError
from mage_gen.measure import HOT_LAUNCHES_PER_GRAPH, HOT_REPLAY_US, flush_bytes
from mage_gen.ops import get_op
from mage_gen.ops.base import shape_dict
from mage_gen.ops.rmsnorm import RMSNorm
from mage_gen.runtime import Prepared
from mage_gen.store import gpu_slug, load_winner, tuned_shapes, write_atomic
from mage_gen.timing import round_ratio

TUNE_OUT = "/tmp/mage-gen-bench-kernels"


def winner_params(op, shape, device, tune_missing: bool, tune_flags: list[str], run: dict | None = None):
    """The params of the stored winner that serves a launch of `run` (the size class dispatch picks, on this
    GPU's L2); with tune_missing, `mage-gen tune <op> <tune_flags>` first where the shape has none."""
    try:
        return load_winner(op, shape, device.name, run, l2_bytes=device.l2_bytes).params
    except StoreError:
        if not tune_missing:
            raise
    done = subprocess.run([sys.executable, "-m", "mage_gen", "tune", op.name, *tune_flags, "--out", TUNE_OUT])
    if done.returncode:
        raise StoreError(f"mage-gen tune {op.name} {' '.join(tune_flags)} failed (exit {done.returncode}), as it said "
                         "above")
    return load_winner(op, shape, device.name, run, l2_bytes=device.l2_bytes).params


def parse_shape(text: str) -> tuple[int, int, int]:
    """MxNxK, as the matmul benches take a shape on their command line."""
    try:
        m, n, k = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give a shape as MxNxK, e.g. 4096x4096x4096") from None
    return m, n, k


def product_params(op, shape, device, tune_missing: bool, untuned: bool, tune_flags: list[str],
                   classes: bool = False):
    """A matrix product's (params, how they were chosen): this GPU's tuned winner (tuned first with `tune_flags`
    where asked); else with classes the entry dispatch.CLASS_RULE picks (what the runtime runs); else with untuned
    the op's default config."""
    flags = ["--m", str(shape.m), "--n", str(shape.n), "--k", str(shape.k), *tune_flags]
    try:
        return winner_params(op, shape, device, tune_missing, flags), "tuned"
    except StoreError:
        served = choose_class(op, shape, tuned_shapes(op, device.name)) if classes else None
        if served is not None:
            return served[1], f"class: the entry tuned at {shape_dict(served[0])}"
        if classes and not untuned:
            raise StoreError(f"nothing tuned on {device.name} serves it: no entry of its own, and none of the same "
                             f"fields but M whose params are valid at M={shape.m}; tune it: mage-gen tune {op.name} "
                             + " ".join(flags)) from None
        if not untuned:
            raise
    params = op.params_from_dict(op.defaults(shape))
    op.validate(shape, params)
    return params, "untuned: the op's default config"


def norm_case(text: str) -> tuple[str, bool, int, int]:
    """OP[+res]:MxD, as the norms' probes take a shape on their command line -> (op name, residual, m, d)."""
    op, _, dims = text.partition(":")
    m, _, d = dims.partition("x")
    name, residual = op.removesuffix("+res"), op.endswith("+res")
    if name not in ("rmsnorm", "layernorm") or not (m.isdigit() and d.isdigit()):
        raise SystemExit(f"error: shape {text!r} is not OP[+res]:MxD (rmsnorm or layernorm, "
                         "e.g. rmsnorm+res:4096x4096)")
    return name, residual, int(m), int(d)


def stored_case(op_name: str, m: int, d: int, dtype: str = "bf16", residual: bool = False):
    """(device, op, shape, run, params of the stored winner) of one norm shape, for a probe of it."""
    device = gpu.open_device()
    op = get_op(op_name)
    shape = op.shape(d=d, dtype=dtype, residual=residual)
    run = {"m": m}
    return device, op, shape, run, winner_params(op, shape, device, False, [], run=run)


class ProbeRMSNorm(RMSNorm):
    """RMSNorm rendered with its template context changed by `change` (a probe's variant of a stored kernel: other
    load or store qualifiers), its kernels named with `suffix`, so that they compile and cache apart from the stored
    ones."""

    def __init__(self, change: Callable[[dict], dict], suffix: str):
        super().__init__()
        self.change, self.suffix = change, suffix

    def context(self, shape, p):
        return self.change(super().context(shape, p))

    def kernel_name(self, shape, p):
        return super().kernel_name(shape, p) + self.suffix


def report_contenders(label: str, row: dict, contenders: Iterable[str], samples: dict | None = None) -> dict:
    """Prints a probe's row of bench_shape: each contender's, Inductor's and the copy's time over the stored kernel's,
    round by round, where `samples` (bench_shape's keep_samples) has them, then every subject's hot and cold times.
    Returns the paired ratios by 'method: name / stored'."""
    names = [*contenders, "inductor", "floor:copy"]
    paired = {}
    for method, rounds in (samples or {}).items():
        for name in names:
            if rounds and name in rounds[0]:
                ratio = round_ratio([r[name] for r in rounds], [r["mage-gen"] for r in rounds])
                paired[f"{method}: {name} / stored"] = ratio.to_dict()
                print(f"{label:22} {method:4} {name:26} / stored: {ratio.median:.4f} "
                      f"({ratio.low:.4f}-{ratio.high:.4f}) {ratio.verdict}", flush=True)
    timings = row.get("timings", {})
    for name in ("mage-gen", *names):
        if name in timings:
            h, c = timings[name]["hot"], timings[name]["cold"]
            print(f"{label:22} {name:26} hot {h['median_us']:7.2f}±{h['spread_us']:.2f} cold "
                  f"{c['median_us']:7.2f}±{c['spread_us']:.2f} cold−hot {c['median_us'] - h['median_us']:+.2f}",
                  flush=True)
    for name, why in row.get("failed", {}).items():
        print(f"{label:22} {name}: FAILED {why}", flush=True)
    return paired


def prepared(op, shape, variant, run: dict) -> Prepared:
    """A built variant loaded and launched as the runtime launches it: argument kinds from the op, addresses held
    to its contract."""
    kernel = gpu.Kernel(variant.compiled.cubin, variant.compiled.kernel_name,
                        op.geometry(shape, variant.params, run).dynamic_shared_bytes)
    return Prepared(op, shape, variant.params, run, kernel, variant.census)


def passing(checked: Iterable[tuple[Any, str]]) -> tuple[list, dict[str, str]]:
    """From (probe, its gate's reason, empty when it passed) pairs: the probes that passed, to be timed, and
    each failed one's reason by its name (printed as it comes); a probe that failed is never timed."""
    passed, failed = [], {}
    for probe, reason in checked:
        if reason:
            failed[probe.name] = reason
            print(f"{probe.name}: FAILED GATE {reason}", flush=True)
        else:
            passed.append(probe)
    return passed, failed


def geomean(values: list[float]) -> float | None:
    return math.exp(sum(map(math.log, values)) / len(values)) if values else None


# What a row records of the order its rounds were timed in (measure.round_order), so that a row timed in another
# order (a fixed one favours whatever runs first at the power limit: bench/NOTES.md, Hopper GEMM §16) is told from
# one timed as the benches time now
ROUND_ORDER = "alternating"


def timing_method(rounds: int, per_round: int) -> dict[str, str]:
    """How a bench's hot and cold figures were taken, from the constants that took them."""
    most, replay_ms = HOT_LAUNCHES_PER_GRAPH, HOT_REPLAY_US / 1000
    order = "each round's order reversed on every other round (measure.round_order)"
    return {"hot": f"{most} launches per CUDA graph (fewer where {most} would last over {replay_ms:g} ms: as many as "
                   f"last {replay_ms:g} ms, at least one, by a launch of the fastest subject; the same count for every "
                   f"subject), {rounds} rounds × {per_round} replays "
                   f"interleaved with the peers, {order}, each round after L2's persisting lines were reset and one "
                   "warm-up replay, median per launch, spread = interquartile range",
            "cold": f"L2's persisting lines reset and {flush_bytes() >> 20} MB written before each launch, {rounds} "
                    f"rounds × {per_round} launches interleaved, {order}"}


def cuda_kernels_of(call) -> list[str]:
    """The names of the CUDA kernels one call launches, in order (torch's profiler)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        call()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


def _triton_version() -> str | None:
    try:
        import triton
    except ImportError:  # a machine without the Triton peer: the benches' pure parts and their tests
        return None
    return triton.__version__


def provenance(device) -> dict:
    return {
        "gpu": device.to_dict(), "nvrtc": nvrtc_version(), "mage_gen": __version__,
        "torch": torch.__version__, "triton": _triton_version(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def earlier_result(device, filename: str) -> dict:
    """The result file a bench wrote earlier on this GPU (write_result's), or {} where there is none."""
    try:
        doc = json.loads((Path("bench/results") / gpu_slug(device.name) / filename).read_text())
    except (OSError, ValueError):
        return {}
    return doc if isinstance(doc, dict) and doc.get("gpu", {}).get("name") == device.name else {}


def write_result(device, filename: str, text: str) -> Path:
    out = Path("bench/results") / gpu_slug(device.name) / filename
    out.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(out, text.encode())
    return out
