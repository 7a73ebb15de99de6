"""Norms at d = 8192 bf16, where Inductor's two-pass kernel stays ahead of ours (bench/NOTES.md, norms §19): the
`wide` template with its first pass under an L2 evict-last policy and its second at evict-first (hint keep, the
row's lines released after; keep_unreleased, left as Inductor leaves them), and at more blocks per SM (min_blocks),
against the stored winner, the peers, the copy of the same bytes, and a Triton kernel of Inductor's structure (a
program per row, two passes over it in chunks) with and without Inductor's policies: which of structure, policy and
blocks per SM gives Inductor its time. Reads out the configuration Inductor's autotuner chose and the load forms in
its PTX. In one process and the same rounds, each gated, everything writing the same y.
Writes bench/results/<gpu>/norms_keep_probe.json.

    python bench/norms_keep_probe.py                        # the three shapes below
    python bench/norms_keep_probe.py rmsnorm:16384x8192     # that shape alone
    python bench/norms_keep_probe.py rmsnorm+res:4096x4096  # the residual form (pass 2 reads x and residual again
                                                            # and writes their sum, as Inductor's does; no clones)
    python bench/norms_keep_probe.py --as NAME ...          # writes NAME.json instead
"""
import dataclasses
import gc
import json
import re
import sys

sys.path.insert(0, "bench")
import torch
import triton
import triton.language as tl
from _beside_copy import build_named, named_beside_peers
from _common import norm_case, provenance, stored_case, write_result
from _copy import FLOOR, copy_subjects, settle

from mage_gen.dtypes import dtype as element_type
from mage_gen.measure import interleave
from mage_gen.peers import TorchSubject, on_gpu

CASES = (("rmsnorm", 16384, 8192), ("rmsnorm", 4096, 8192), ("layernorm", 4096, 8192))
WIDE_BLOCKS = {256: (1, 6), 512: (1, 4), 1024: (1,)}  # threads -> min_blocks: ptxas free, and more blocks per SM
WIDE_HINTS = ("nc", "keep", "keep_unreleased")
# Inductor's structure: (elements per chunk, num_warps), each with its policies and with none
CLONES = ((2048, 16), (4096, 16), (2048, 8))  # the first as Inductor's autotuner picked it at 16384x8192
INDUCTOR_POLICIES = ("evict_last", "evict_first", "evict_last")  # pass 1, pass 2, w
ROUNDS, PER_ROUND = 4, 5


@triton.jit
def _two_pass_rmsnorm(X, W, Y, eps, N: tl.constexpr, CHUNK: tl.constexpr, FIRST: tl.constexpr,
                      SECOND: tl.constexpr, WEIGHTS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, CHUNK)
    acc = tl.zeros([CHUNK], tl.float32)
    for off in tl.range(0, N, CHUNK):
        x = tl.load(X + row * N + off + cols, eviction_policy=FIRST).to(tl.float32)
        acc += x * x
    rstd = tl.rsqrt(tl.sum(acc, 0) / N + eps)
    for off in tl.range(0, N, CHUNK):
        x = tl.load(X + row * N + off + cols, eviction_policy=SECOND).to(tl.float32)
        w = tl.load(W + off + cols, eviction_policy=WEIGHTS).to(tl.float32)
        tl.store(Y + row * N + off + cols, (x * rstd * w).to(Y.dtype.element_ty))


def clones(bench, op, shape, run) -> tuple[list[TorchSubject], dict]:
    """Inductor's structure in Triton, each gated on the placement's inputs, writing its y."""
    place, bf16 = bench.placement(0), element_type(shape.dtype)
    x = on_gpu(place.input_pointers()["x"], (run["m"], shape.d), bf16)
    w = on_gpu(place.input_pointers()["w"], (shape.d,), element_type(shape.weight_dtype))
    y = on_gpu(place.output_pointers()["y"], (run["m"], shape.d), bf16)
    subjects, gates = [], {}
    for chunk, warps in CLONES:
        for policies in (INDUCTOR_POLICIES, ("", "", "")):
            name = f"clone c{chunk} w{warps} " + ("inductor's policies" if policies[0] else "no policy")

            def go(chunk=chunk, warps=warps, policies=policies):
                _two_pass_rmsnorm[(run["m"],)](x, w, y, op.eps, N=shape.d, CHUNK=chunk, FIRST=policies[0],
                                               SECOND=policies[1], WEIGHTS=policies[2], num_warps=warps)
            y.fill_(float("nan"))
            go()
            torch.cuda.synchronize()
            error, reason = bench.check_tensor("y", y)
            gates[name] = {"error": error, "reason": reason}
            if reason:
                print(f"{name}: failed the gate: {reason}", flush=True)
            else:
                subjects.append(TorchSubject(name, go, {"chunk": chunk, "num_warps": warps, "policies": policies}))
    return subjects, gates


def inductor_configs(seen: set) -> dict:
    """Each Inductor kernel compiled since `seen` (ids): the configs its autotuner kept, and its global load and
    store forms and cache policies as they appear in the PTX."""
    try:
        from torch._inductor.runtime.triton_heuristics import CachingAutotuner
    except ImportError as e:
        return {"unavailable": str(e)}
    found, objects = {}, gc.get_objects()
    for o in objects:
        if issubclass(type(o), CachingAutotuner) and id(o) not in seen:  # type(): gc holds weak proxies too
            seen.add(id(o))
            try:
                name = (getattr(o, "inductor_meta", None) or {}).get("kernel_name") or f"autotuner {id(o):x}"
                found[name] = [{"kwargs": dict(launcher.config.kwargs), "num_warps": launcher.config.num_warps,
                                "num_stages": launcher.config.num_stages,
                                "registers": getattr(launcher, "n_regs", None)}
                               for launcher in getattr(o, "launchers", None) or []]
            except Exception as e:  # noqa: BLE001  (a readout, not a measurement: say what failed and go on)
                found[f"autotuner {id(o):x}"] = f"not read: {type(e).__name__}: {e}"
    for o in objects:  # the compiled kernels themselves, for their PTX
        if issubclass(type(o), triton.compiler.CompiledKernel) and id(o) not in seen:
            seen.add(id(o))
            try:
                name = str(getattr(o, "name", ""))
                if not name.startswith("triton_"):
                    continue
                ptx = o.asm.get("ptx", "")
                ptx = ptx.decode() if isinstance(ptx, bytes) else ptx
                found.setdefault("ptx_memory_forms", {})[f"{name} {id(o):x}"] = sorted(
                    {line.strip().split()[0] for line in ptx.splitlines()
                     if re.match(r"\s*(ld\.global|st\.global|createpolicy)", line)})
            except Exception as e:  # noqa: BLE001
                found.setdefault("ptx_memory_forms", {})[f"kernel {id(o):x}"] = f"not read: {type(e).__name__}: {e}"
    return found


def main() -> None:
    doc, device, seen = {"what": __doc__.split("\n\n")[0], "cases": {}}, None, set()
    args, name = sys.argv[1:], "norms_keep_probe"
    if args[:1] == ["--as"]:
        name, args = args[1], args[2:]
    cases = [norm_case(a) for a in args] or [(op_name, False, m, d) for op_name, m, d in CASES]
    for op_name, residual, m, d in cases:
        label = f"{op_name}{'+res' if residual else ''} {m}x{d}"
        device, op, shape, run, stored = stored_case(op_name, m, d, residual=residual)
        vectors = d * element_type(shape.dtype).itemsize // 16
        wide = dataclasses.replace(stored, template="wide", rows_per_block=1, grid_cap=0, weights="late",
                                   min_blocks=1, hold="float", l2_ahead=0, ahead_priority="normal",
                                   stats="two_pass", vector=16)
        configs = {"stored": stored, **{f"stored t{t}": dataclasses.replace(stored, threads=t) for t in (256, 512)
                                        if t != stored.threads},
                   **{f"wide t{t} b{b} {h}": dataclasses.replace(wide, threads=t, min_blocks=b, hint=h)
                      for t, blocks in WIDE_BLOCKS.items() if t <= vectors for b in blocks for h in WIDE_HINTS}}
        variants = build_named(op, shape, configs, device.arch, label)
        with named_beside_peers(op, shape, run, device, variants) as (bench, subjects, gates, peers, missing):
            row = {"kernels": {n: v.source.kernel_name for n, v in variants.items()},
                   "census": {n: {k: getattr(v.census, k) for k in ("registers", "spill_store_bytes",
                                                                     "spill_load_bytes", "global_loads_hinted",
                                                                     "l2_released")}
                              for n, v in variants.items()},
                   "gates": gates, "peers_missing": missing,
                   "peer_configs": {p.name: p.config for p in peers},
                   "inductor_kernels": inductor_configs(seen)}
            extra = []
            if op_name == "rmsnorm" and not residual:
                extra, row["clone_gates"] = clones(bench, op, shape, run)
            sources = tuple(on_gpu(buffer.ptr, (m, d), element_type(shape.dtype))
                            for k, buffer in bench.timing_buffers().items() if k in ("x", "residual"))
            copies = copy_subjects(op.bytes_moved(shape, run), sources)
            everyone = subjects + [p for p in peers if p.name in ("inductor", "triton")] + extra + copies
            tables = {method: interleave(everyone, method, ROUNDS, PER_ROUND) for method in ("hot", "cold")}
            row["floor_from"] = settle(copies, *tables.values())
            for s in extra:
                s.close()
            for method, table in tables.items():
                table = {n: t for n, t in table.items() if not n.startswith(FLOOR + "/")}
                row[method] = {n: t.to_dict() for n, t in table.items()}
                for n, t in sorted(table.items(), key=lambda kv: kv[1].median_us):
                    print(f"{label} {method} {n:36} {t.median_us:8.2f} ± {t.spread_us:.2f}", flush=True)
            if bench.inputs_changed():
                raise SystemExit(f"{label}: a kernel or a copy wrote into its inputs")
        doc["cases"][label] = row
    doc.update(provenance(device))
    write_result(device, name + ".json", json.dumps(doc, indent=1, default=str) + "\n")


if __name__ == "__main__":
    main()
