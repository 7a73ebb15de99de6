"""What the norms probes share: named variants of one shape, each gated, then timed hot and cold, interleaved,
on one copy of the inputs beside the copy of the same bytes (_copy.py) and, if asked, the op's peers, the inputs
checked intact after."""

from __future__ import annotations

import contextlib

from _common import winner_params
from _copy import FLOOR, copy_subjects, settle

from mage_gen.dtypes import dtype
from mage_gen.errors import ConfigError
from mage_gen.measure import Bench, interleave
from mage_gen.peers import make_peers, on_gpu
from mage_gen.variants import build

ROUNDS, PER_ROUND = 4, 5


def build_named(op, shape, configs: dict, arch: str, label: str) -> dict:
    """Each named config built; one the op refuses is reported (a line) and left out, not timed."""
    variants = {}
    for name, params in configs.items():
        try:
            variants[name] = build(op, shape, params, arch)
        except ConfigError as e:
            print(f"{label} {name}: {e}", flush=True)
    return variants


def time_beside_copy(op, shape, run: dict, variants: dict, label: str, seed: int, peers: bool = False,
                     share_outputs: bool = False) -> dict:
    """{"gates": each variant's gate, "timings": hot and cold of each that passed, of FLOOR and, with peers,
    of each peer (gated on the same inputs), "fraction_of_copy": each one's share of the copy's time, per
    method}; prints one line per variant and peer. share_outputs: the Triton peer writes the first variant's
    outputs, as in bench/norms.py (each variant writes its own)."""
    bench = Bench(op, shape, run, seed=seed)
    subjects, kernels, gates = [], [], {}
    try:
        for name, variant in variants.items():
            kernel = bench.load(variant)
            kernels.append(kernel)
            subject, checked = bench.checked_subject(variant, kernel, name=name, share_inputs=True)
            gates[name] = checked.to_dict()
            if subject is None:
                print(f"{label} {name}: failed the gate: {checked.reason}", flush=True)
            else:
                subjects.append(subject)
        others = []
        if peers and subjects:
            buffers = bench.timing_buffers()
            others, missing = make_peers(op, shape, run, subjects[0].bound.inputs, None, check=bench.check_tensor,
                                         inductor=True, device_inputs={k: b.ptr for k, b in buffers.items()},
                                         device_outputs=subjects[0].bound.output_pointers() if share_outputs else None)
            for name, why in missing.items():
                print(f"{label} {name}: missing: {why}", flush=True)
        m = run["m"]
        sources = tuple(on_gpu(bench.timing_buffers()[t].ptr, (m, shape.d), dtype(shape.dtype))
                        for t in ("x", "residual") if t in bench.timing_buffers())
        copies = copy_subjects(op.bytes_moved(shape, run), sources)
        hot = interleave([*subjects, *others, *copies], "hot", ROUNDS, PER_ROUND)
        cold = interleave([*subjects, *others, *copies], "cold", ROUNDS, PER_ROUND)
        settle(copies, hot, cold)
    finally:
        for s in subjects:
            s.close()
        for k in kernels:
            k.unload()
    if bench.inputs_changed():
        raise SystemExit(f"{label}: a kernel or a copy wrote into its inputs")
    names = [s.name for s in (*subjects, *others)]
    for n in names:
        print(f"{label:24} {n:10} hot {hot[n].median_us:8.2f}±{hot[n].spread_us:.2f}  cold {cold[n].median_us:8.2f}"
              f"±{cold[n].spread_us:.2f} µs  copy {hot[FLOOR].median_us:8.2f} / {cold[FLOOR].median_us:8.2f}", flush=True)
    return {"gates": gates, **({"peer_configs": {p.name: p.config for p in others}} if peers else {}),
            "timings": {n: {"hot": hot[n].to_dict(), "cold": cold[n].to_dict()} for n in [*names, FLOOR]},
            "fraction_of_copy": {n: {meth: t[FLOOR].median_us / t[n].median_us for meth, t in (("hot", hot), ("cold", cold))}
                                 for n in names}}


@contextlib.contextmanager
def named_beside_peers(op, shape, run: dict, device, variants: dict):
    """(bench, the subject of each named variant that passed its gate, {name: its gate}, the op's peers, {peer: why
    missing}): every variant and the peers (torch, Inductor and Triton on the variants' y) gated at placement 0 of
    one Bench, all writing the same outputs there; a variant that fails is printed and never timed. All closed
    after."""
    bench = Bench(op, shape, run, seed=run["m"] + shape.d)
    subjects, kernels, gates, peers = [], [], {}, []
    try:
        for name, variant in variants.items():
            kernel = bench.load(variant)
            kernels.append(kernel)
            subject, checked = bench.checked_subject(variant, kernel, name=name, placement=0)
            gates[name] = checked.to_dict()
            if subject is None:
                print(f"{op.name} {run} {name} {variant.source.kernel_name}: failed the gate: {checked.reason}",
                      flush=True)
            else:
                subjects.append(subject)
        missing = {}
        if subjects:  # peers beside nothing are not compiled
            place = bench.placement(0)
            peers, missing = make_peers(op, shape, run, bench.timing_inputs(), None, check=bench.check_tensor,
                                        inductor=True, device_inputs=place.input_pointers(),
                                        device_outputs=place.output_pointers())
        yield bench, list(subjects), gates, peers, missing
    finally:
        for s in subjects + peers:
            s.close()
        for k in kernels:
            k.unload()
        bench.free_placements()


@contextlib.contextmanager
def winner_beside_peers(op, shape, run: dict, device):
    """(bench, the stored winner's subject "mage-gen", its peers, {peer: why missing}), as named_beside_peers."""
    variant = build(op, shape, winner_params(op, shape, device, False, [], run=run), device.arch)
    with named_beside_peers(op, shape, run, device, {"mage-gen": variant}) as (bench, subjects, gates, peers, missing):
        if not subjects:
            raise SystemExit(f"{op.name} {run} {variant.source.kernel_name}: failed the gate: "
                             f"{gates['mage-gen']['reason']}")
        yield bench, subjects[0], peers, missing
