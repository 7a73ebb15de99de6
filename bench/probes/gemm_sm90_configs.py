"""Which gemm_sm90 configs pass the gate at a shape, and how fast each runs beside cuBLAS and Triton.

Every config is gated (fresh inputs, poisoned output, float64 reference) before it is timed; those that pass are
timed hot and cold in interleaved rounds with the peers, and each one's round-by-round ratio to cuBLAS is
reported. --gate-only checks configs at a shape without timing (tails). --sustain runs every subject back to back
for a window of that many seconds a round as well, with the energy the GPU drew and its clocks (bench/_power.py).

    python -m bench.probes.gemm_sm90_configs --shape 4096x4096x4096 --config bm=128,bn=256 --config bm=128,bn=128
    python -m bench.probes.gemm_sm90_configs --shape 2048x28672x4096 --epilogue gate=silu --config bn=256,epilogue=tma
    python -m bench.probes.gemm_sm90_configs --shape 8192x4096x4096 --config bn=256,group=8 --sustain 1
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time

from mage_gen import gpu
from mage_gen.errors import MageError
from mage_gen.measure import Bench, interleave_rounds, launches_for, pool_rounds
from mage_gen.ops import get_op
from mage_gen.ops.gemm_sm90 import GemmSm90
from mage_gen.peers import make_peers
from mage_gen.timing import round_ratio
from mage_gen.variants import build

from bench import _power


class ClusteredOnly(GemmSm90):
    """Clusters launched and synchronised as configured, but every CTA copies its whole B tile itself: what the
    cluster costs without the multicast (--clustered-only)."""

    name = "gemm_sm90"

    def b_sharers(self, p):
        return 1

    def kernel_name(self, shape, p):
        return super().kernel_name(shape, p) + ("_nomc" if p.cluster > 1 else "")


def parse_config(text: str) -> dict:
    values = {}
    for pair in filter(None, text.split(",")):
        key, _, raw = pair.partition("=")
        values[key] = int(raw) if raw.lstrip("-").isdigit() else {"true": True, "false": False}.get(raw, raw)
    return values


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", action="append", required=True, help="MxNxK[:C] (C's element type, bf16 or fp32)")
    parser.add_argument("--config", action="append", default=[], help="KEY=VALUE,... of one config (repeatable)")
    parser.add_argument("--precision", choices=("bf16", "e4m3", "e4m3_block"), default="bf16",
                        help="A and B: bf16, or e4m3 with per-tensor or block scales (cuBLAS is then torch._scaled_mm)")
    parser.add_argument("--epilogue", default="", help="the shape's epilogue fields, e.g. gate=silu,bias=true,"
                                                        "residual=true (cuBLAS's product is then followed by torch's)")
    parser.add_argument("--gate-only", action="store_true")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--per-round", type=int, default=5)
    parser.add_argument("--order", choices=("alternate", "ours-first", "peers-first"), default="alternate",
                        help="each round's order: the configs then the peers, reversed every other round "
                             "(alternate, as the tuner and the benches time), or one fixed order")
    parser.add_argument("--out", help="write the rows as JSON here")
    parser.add_argument("--clustered-only", action="store_true", help="clusters without multicast: each CTA copies "
                                                                       "its own B tile")
    parser.add_argument("--sustain", type=float, default=0.0, metavar="SECONDS",
                        help="after the rounds, --sustain-rounds rounds of each subject run back to back for this "
                             "long, with its energy per launch and clocks (NVML)")
    parser.add_argument("--sustain-rounds", type=int, default=6)
    args = parser.parse_args()
    if args.sustain < 0 or args.sustain_rounds < 1:
        parser.error("--sustain takes seconds ≥ 0 and --sustain-rounds a count ≥ 1")
    op = ClusteredOnly() if args.clustered_only else get_op("gemm_sm90")
    device = gpu.open_device()
    rows = []
    for text in args.shape:
        dims, _, out = text.partition(":")
        m, n, k = (int(v) for v in dims.split("x"))
        shape = op.shape(m=m, n=n, k=k, c_dtype=out or "bf16", precision=args.precision, **parse_config(args.epilogue))
        bench = Bench(op, shape, {}, seed=m + n + k)
        subjects, labels = [], {}
        for config in args.config or [""]:
            values = parse_config(config)
            if "grid" in values and values["grid"] == "SM":
                values["grid"] = device.sms
            resident = values.get("grid") == "CL"  # as many clusters as the device runs at once
            if resident:
                values["grid"] = 0
            try:
                params = op.params_from_dict(values)
                started = time.perf_counter()
                variant = build(op, shape, params, device.arch)
                built = time.perf_counter() - started
                if resident:
                    launch = op.geometry(shape, params, {})
                    probe = bench.load(variant)
                    clusters = gpu.max_active_clusters(probe, launch.block, launch.dynamic_shared_bytes, params.cluster)
                    probe.unload()
                    values["grid"] = clusters * params.cluster
                    print(f"{text}: {clusters} clusters of {params.cluster} at once", flush=True)
                    params = op.params_from_dict(values)
                    variant = dataclasses.replace(variant, params=params)
            except MageError as exc:
                print(f"{text} {config}: REFUSED {exc}", flush=True)
                rows.append({"shape": text, "config": values, "refused": str(exc)})
                continue
            kernel = bench.load(variant)
            subject, result = bench.checked_subject(variant, kernel, name=params.label())
            census = variant.census
            row = {"shape": text, "config": values, "kernel": variant.source.kernel_name, "gate": result.to_dict(),
                   "registers": census.registers, "spill_bytes": census.spill_bytes, "compile_s": built}
            rows.append(row)
            print(f"{text} {params.label():50} gate {'ok' if result.passed else 'FAILED'} err {result.worst_error:.3g} "
                  f"(tolerance {op.tolerance_of(shape, 'C', op.output_dtypes(shape)['C']):.3g}) "
                  f"regs {census.registers} spill {census.spill_bytes} {result.reason}", flush=True)
            if subject is not None:
                if args.gate_only:
                    subject.close()
                else:
                    subjects.append(subject)
                    labels[subject.name] = row
            if result.fault:
                print("a fault: the context may be lost; stopping this shape", flush=True)
                break
        if args.gate_only or not subjects:
            continue
        peers, missing = make_peers(op, shape, {}, bench.timing_inputs(), None, check=bench.check_tensor,
                                    device_inputs={k: b.ptr for k, b in bench.timing_buffers().items()})
        everyone = [*peers, *subjects] if args.order == "peers-first" else [*subjects, *peers]
        flops = op.flops(shape)
        for method in ("hot", "cold"):
            taken = interleave_rounds([everyone], method, args.rounds, args.per_round,
                                      alternate=args.order == "alternate")
            pooled, _ = pool_rounds(taken, method, 1)
            for name, timing in sorted(pooled.items(), key=lambda item: item[1].median_us):
                ratio = None
                if "cublas" in pooled and name != "cublas":
                    ratio = round_ratio([r[name] for r in taken], [r["cublas"] for r in taken])
                entry = {"median_us": timing.median_us, "spread_us": timing.spread_us,
                         "tflops": flops / timing.median_us / 1e6,
                         "vs_cublas": ratio.to_dict() if ratio else None}
                if name in labels:
                    labels[name][method] = entry
                else:
                    rows.append({"shape": text, "peer": name, method: entry})
                print(f"{text} {method:4} {name:50} {timing.median_us:9.2f} µs ±{timing.spread_us:6.2f} "
                      f"{entry['tflops']:6.1f} TFLOP/s" + (f"  time/cuBLAS {ratio.median:.4f} [{ratio.low:.4f}, "
                                                            f"{ratio.high:.4f}] {ratio.verdict}" if ratio else ""),
                      flush=True)
        if args.sustain:
            rows.append({"shape": text, "sustained": _power.sustained(everyone, args.sustain, args.sustain_rounds,
                                                                      launches_for(everyone), "cublas", text)})
        for s in everyone:
            s.close()
        if missing:
            print(f"peers missing: {missing}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": device.to_dict(), "order": args.order, "rows": rows}, f, indent=1)
    print(f"{len(rows)} rows", file=sys.stderr)


if __name__ == "__main__":
    main()
