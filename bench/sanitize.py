"""Every committed winner in tuned/<gpu>/ through the gate once, for compute-sanitizer to watch:

    compute-sanitizer --tool memcheck python -m bench.sanitize
    compute-sanitizer --tool racecheck python -m bench.sanitize      (bench/sanitize.sh runs each tool)

The gate launches each kernel at every run size op.gate_runs gives (layer norm: m = 1, 37 and 4096;
matmul: its one fixed shape) on fresh inputs, outputs fenced, and checks it against the float64
reference. Nothing is timed and torch and Triton are never imported: the sanitizer sees the gate's
launches and little else. One line per kernel; exits 1 if any gate fails or any winner cannot be
built, 2 where nothing could be run (no GPU, no tuned/ folder for it, bad arguments).

    python -m bench.sanitize --op layernorm --limit 2
    python -m bench.sanitize --op matmul_tc --grid 512,512     (racecheck at a 4096³ winner's full grid takes minutes)
    python -m bench.sanitize --gpu 'NVIDIA H200' --list      (compiles, launches nothing: no GPU needed)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from mage_gen import gpu
from mage_gen.compile import DEFAULT_ARCH
from mage_gen.errors import CompileError, ConfigError, GpuError, MageError, StoreError
from mage_gen.measure import Bench, gate
from mage_gen.verdict import GateResult
from mage_gen.ops import OPS, Op
from mage_gen.store import load_entry, load_winner, store_file
from mage_gen.variants import Variant, build

SEED = 0


@dataclass(frozen=True)
class Stored:
    """One committed winner: where it is, and what to build (or why it cannot be built)."""

    op: Op
    shape_key: str
    shape: Any = None
    params: Any = None
    unusable: str = ""  # why the entry cannot be built as committed; empty when it can


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--op", choices=sorted(OPS), help="only this op family's winners")
    parser.add_argument("--limit", type=int, metavar="N", help="at most N kernels in all")
    parser.add_argument("--shape", metavar="TEXT", help="only winners whose shape key contains TEXT (m=4096,n=512)")
    parser.add_argument("--gpu", metavar="NAME",
                        help="read tuned/<this GPU>/ (default: the GPU's own name, e.g. 'NVIDIA H200')")
    parser.add_argument("--list", action="store_true",
                        help="load and compile the winners, print what would be launched, launch nothing")
    parser.add_argument("--arch", default=DEFAULT_ARCH, help=f"with --list and --gpu: compile for this "
                        f"architecture (default {DEFAULT_ARCH}); otherwise the GPU's own is used")
    parser.add_argument("--grid", metavar="M,N", type=grid_size,
                        help="matmul winners gated at M×N instead, K as tuned: the same blocks' code (every K tile, "
                             "copies unguarded where the tiles divide M and N) over fewer blocks, for a tool too slow "
                             "for the full grid")
    args = parser.parse_args(argv)
    if args.limit is not None and args.limit < 1:
        parser.error(f"--limit must be 1 or more, got {args.limit}")
    return args


def grid_size(text: str) -> tuple[int, int]:
    try:
        m, n = (int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give M,N, e.g. 512,512") from None
    if m < 1 or n < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: M and N must be 1 or more")
    return m, n


def on_grid(stored: Stored, grid: tuple[int, int]) -> Stored:
    """The winner at M×N = grid where its tiles divide them (so its copies are the same unguarded ones);
    otherwise unusable, with the reason."""
    if stored.unusable or not hasattr(stored.params, "bm"):
        return stored
    m, n = grid
    if m % stored.params.bm or n % stored.params.bn:
        return dataclasses.replace(stored, unusable=f"--grid {m},{n}: its {stored.params.bm}×{stored.params.bn} "
                                                    "tiles do not divide it (the copies would be guarded: other code)")
    return dataclasses.replace(stored, shape=dataclasses.replace(stored.shape, m=m, n=n),
                               shape_key=f"{stored.shape_key} at m={m},n={n}")


def stored_winners(ops: list[Op], gpu_name: str) -> list[Stored]:
    """Every entry of tuned/<gpu>/<op>.json for each op that has a file, in shape-key order."""
    winners = []
    for op in ops:
        path = store_file(op.name, gpu_name)
        if not path.exists():
            continue
        try:
            keys = shape_keys(path)
        except StoreError as exc:  # the other files may still be fine: their kernels still run
            winners.append(Stored(op, "(whole file)", unusable=str(exc)))
            continue
        winners.extend(stored_winner(op, key, gpu_name) for key in keys)
    return winners


def shape_keys(path: Path) -> list[str]:
    """The shape keys of a tuned/ file; each entry is then read (and checked) by the store itself."""
    try:
        entries = json.loads(path.read_text())["entries"]
        return sorted(entries)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise StoreError(f"cannot list the entries of {path} ({type(exc).__name__}: {exc})") from None


def stored_winner(op: Op, key: str, gpu_name: str) -> Stored:
    try:
        shape = op.shape(**load_entry(op.name, gpu_name, key)["shape"])
        return Stored(op, key, shape, load_winner(op, shape, gpu_name).params)
    except (StoreError, ConfigError, TypeError) as exc:
        return Stored(op, key, unusable=" ".join(str(exc).split()))


def report(status: str, stored: Stored, kernel: str, detail: str) -> None:
    print(f"{status:5} {stored.op.name:10} {stored.shape_key:24} {kernel}  {detail}", flush=True)


def build_one(stored: Stored, arch: str) -> Variant | None:
    """The winner's variant, or None after reporting why it cannot be built."""
    if stored.unusable:
        report("FAIL", stored, "-", stored.unusable)
        return None
    try:
        return build(stored.op, stored.shape, stored.params, arch)
    except (CompileError, ConfigError) as exc:
        report("FAIL", stored, "-", f"compile: {str(exc).splitlines()[0]}")
        return None


def list_one(stored: Stored, arch: str) -> bool:
    """Compile the winner without a GPU; True when it builds."""
    if (variant := build_one(stored, arch)) is None:
        return False
    runs = stored.op.gate_runs(stored.shape, dict(stored.op.run_defaults), stored.params)
    report("LIST", stored, variant.source.kernel_name, f"{stored.params.label()}; runs {runs}")
    return True


def gate_one(stored: Stored, arch: str) -> bool:
    """Build, load and gate one winner at every gate run size; True when it passes."""
    if (variant := build_one(stored, arch)) is None:
        return False
    result = gate_variant(stored, variant)
    name = variant.source.kernel_name
    if result.passed:
        runs = ", ".join(result.errors)
        report("PASS", stored, name, f"worst error {result.worst_error:.2e} ({runs})")
    else:
        report("FAIL", stored, name, result.reason)
    return result.passed


def gate_variant(stored: Stored, variant: Variant) -> GateResult:
    """The tuner's load and gate; a GpuError that escapes them (the context lost) propagates."""
    run = dict(stored.op.run_defaults)
    bench = Bench(stored.op, stored.shape, run, SEED)
    try:
        kernel = bench.load(variant)
    except GpuError as exc:
        return GateResult(False, f"load: {exc}", float("inf"))
    try:
        return gate(stored.op, stored.shape, variant.params, kernel, run, np.random.default_rng(SEED), bench.stream)
    finally:
        kernel.unload()


def run_all(winners: list[Stored], arch: str, launch: bool) -> int:
    """One line per winner, then a summary; the exit code."""
    passed = 0
    for done, stored in enumerate(winners):
        try:
            passed += gate_one(stored, arch) if launch else list_one(stored, arch)
        except GpuError as exc:  # a launch left the context unusable: nothing after it can be trusted
            report("FAIL", stored, "-", f"{exc}; the CUDA context is lost: the {len(winners) - done - 1} "
                                        "kernel(s) after it were not run")
            break
    verb = "gated" if launch else "built"
    print(f"sanitize: {len(winners)} kernel(s), {passed} {verb}, {len(winners) - passed} failed or not run",
          flush=True)
    return 0 if passed == len(winners) else 1


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        device = None if args.list and args.gpu else gpu.open_device()
        gpu_name = args.gpu or device.name
        ops = [OPS[args.op]] if args.op else list(OPS.values())
        winners = [w for w in stored_winners(ops, gpu_name) if not args.shape or args.shape in w.shape_key]
        winners = winners[:args.limit]
        if args.grid:
            winners = [on_grid(w, args.grid) for w in winners]
        if not winners:
            folder = store_file(ops[0].name, gpu_name).parent
            raise MageError(f"no tuned winners of {', '.join(op.name for op in ops)} in {folder}; "
                            "run from the repository root, or set MAGE_GEN_TUNED")
        return run_all(winners, device.arch if device else args.arch, launch=not args.list)
    except MageError as exc:
        print(f"sanitize: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
