"""Norms: rows staged through shared memory (template `staged`) against the tuned winners at the DRAM-bound rows.

A winner holds its row in registers, so the rows in flight on an SM are its resident blocks' rows, each loaded,
then reduced while none of its bytes are in flight. Template `staged` keeps `stages` rows per block in flight
by cp.async into shared memory, holding in registers only the row whose turn it is. Here, for the shapes
furthest from the copy (norms.json), the winner and staged configs (the winner's statistics, weights and hold;
threads for 1, 2 or 4 vectors each; 2, 4 or 6 stages; as many blocks per SM as shared memory, threads and
registers allow, up to 4, from the device's SM count) are gated and timed hot and cold, interleaved, on one copy of the inputs beside
the copy of the same bytes. Writes bench/results/<gpu>/norms_staged_probe.json.

    python bench/norms_staged_probe.py
"""
import dataclasses
import json
import sys

sys.path.insert(0, "bench")
from _common import write_result
from _copy import FLOOR, copy_subjects, settle

from mage_gen import gpu
from mage_gen.dtypes import dtype
from mage_gen.errors import ConfigError
from mage_gen.measure import Bench, interleave
from mage_gen.ops import get_op
from mage_gen.peers import on_gpu
from mage_gen.store import load_winner
from mage_gen.variants import build_all

# (op, residual, M, d): the DRAM-bound shapes of norms.json at under 97% of the copy, and two at it
CASES = (("layernorm", False, 4096, 8192), ("rmsnorm", False, 4096, 8192), ("layernorm", False, 16384, 8192),
         ("layernorm", True, 4096, 4096), ("layernorm", False, 65536, 768), ("rmsnorm", False, 32768, 4096))
SHARED_PER_SM = 220 * 1024  # what the probe lets a config's blocks take of an SM's shared memory


def staged_configs(op, shape, winner, device) -> list:
    """The staged configs of a shape, each given as many blocks as fit an SM at once (shared memory, threads and
    the registers ptxas gave it, at most 4): a persistent block that is not resident would start only when a
    resident one has finished all its rows."""
    nvec = shape.d * 2 // 16  # 16-byte vectors of a bf16 row
    row_bytes = shape.d * 2 * (2 if shape.residual else 1)
    configs = []
    for threads in sorted({min(1024, -(-(-(-nvec // slots)) // 32) * 32) for slots in (1, 2, 4)}):
        for stages in (2, 4, 6):
            params = dataclasses.replace(winner, template="staged", threads=threads, vector=16, rows_per_block=1,
                                         stages=stages, grid_cap=device.sms, min_blocks=1,
                                         hint=winner.hint if winner.hint != "none" else "nc")
            try:
                op.validate(shape, params)
            except ConfigError as exc:
                print(f"  left out {params.label()}: {exc}", flush=True)
                continue
            configs.append(params)
    fitted = []
    for variant in build_all(op, shape, configs, device.arch):  # grid_cap is not in a staged kernel's code
        p, registers = variant.params, -(-variant.census.registers // 8) * 8
        per_sm = min(4, SHARED_PER_SM // (p.stages * row_bytes), 2048 // p.threads, 65536 // (registers * p.threads))
        fitted.append(dataclasses.replace(p, grid_cap=max(1, per_sm) * device.sms))
    return fitted


def probe(device, op_name: str, residual: bool, m: int, d: int) -> dict:
    op = get_op(op_name)
    shape, run = op.shape(d=d, dtype="bf16", residual=residual), {"m": m}
    winner = load_winner(op, shape, device.name, run, l2_bytes=device.l2_bytes).params
    variants = build_all(op, shape, [winner, *staged_configs(op, shape, winner, device)], device.arch)
    bench = Bench(op, shape, run, seed=m + d)
    label = f"{op_name}{'+res' if residual else ''} {m}x{d}"
    subjects, kernels, gates = [], [], {}
    try:
        for i, variant in enumerate(variants):
            kernel = bench.load(variant)
            kernels.append(kernel)
            name = ("winner " if i == 0 else "") + variant.source.kernel_name
            subject, checked = bench.checked_subject(variant, kernel, name=name, share_inputs=True)
            gates[name] = checked.to_dict() | {"registers": variant.census.registers,
                                               "spill_bytes": variant.census.spill_bytes}
            if subject is not None:
                subjects.append(subject)
            else:
                print(f"  {name}: failed the gate: {checked.reason}", flush=True)
        sources = tuple(on_gpu(bench.timing_buffers()[t].ptr, (m, d), dtype("bf16"))
                        for t in ("x", "residual") if t in bench.timing_buffers())
        copies = copy_subjects(op.bytes_moved(shape, run), sources)
        hot = interleave([*subjects, *copies], "hot", 4, 5)
        cold = interleave([*subjects, *copies], "cold", 4, 5)
        settle(copies, hot, cold)
    finally:
        for s in subjects:
            s.close()
        for k in kernels:
            k.unload()
    if bench.inputs_changed():
        raise SystemExit(f"{label}: a kernel or a copy wrote into its inputs")
    names = [s.name for s in subjects]
    print(f"{label}: copy {hot[FLOOR].median_us:.2f} / {cold[FLOOR].median_us:.2f} µs", flush=True)
    for n in sorted(names, key=lambda n: cold[n].median_us):
        print(f"  {n:72} hot {hot[n].median_us:8.2f}±{hot[n].spread_us:.2f} ({hot[FLOOR].median_us / hot[n].median_us:.3f})"
              f"  cold {cold[n].median_us:8.2f}±{cold[n].spread_us:.2f} ({cold[FLOOR].median_us / cold[n].median_us:.3f})",
              flush=True)
    return {"op": op_name, "residual": residual, "m": m, "d": d, "gates": gates,
            "timings": {n: {"hot": hot[n].to_dict(), "cold": cold[n].to_dict()} for n in [*names, FLOOR]},
            "fraction_of_copy": {n: {meth: t[FLOOR].median_us / t[n].median_us for meth, t in (("hot", hot), ("cold", cold))}
                                 for n in names}}


def main() -> None:
    device = gpu.open_device()
    rows = [probe(device, *case) for case in CASES]
    doc = {"what": __doc__.split("\n\n")[0], "dtype": "bfloat16", "sms": device.sms, "rows": rows}
    write_result(device, "norms_staged_probe.json", json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":  # build_all compiles in worker processes, which import this module
    main()
