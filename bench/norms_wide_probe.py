"""RMSNorm d = 8192 bf16: the `wide` template (two passes over the row, the second mostly from L2, nothing held)
against the stored winner and the peers. Inductor's kernel, the one peer still ahead of ours at these rows, has
that shape (bench/NOTES.md, norms §16, §19), and the `long` preset the tuner searches at these rows leaves the
template out. In one process and the same rounds, each gated, every kernel and the Triton and Inductor peers writing
the same y: the stored winner, and `wide` at 128-1024 threads with plain, read-only or streaming loads.
Writes bench/results/<gpu>/norms_wide_probe.json.

    python bench/norms_wide_probe.py              # 4096×8192 and 16384×8192
    python bench/norms_wide_probe.py 16384x8192   # that shape alone
"""
import dataclasses
import json
import sys

sys.path.insert(0, "bench")
from _beside_copy import build_named, named_beside_peers
from _common import provenance, stored_case, write_result

from mage_gen.measure import interleave

SHAPES = ((4096, 8192), (16384, 8192))
THREADS, HINTS = (128, 256, 512, 1024), ("none", "nc", "stream")
ROUNDS, PER_ROUND = 4, 5


def main() -> None:
    doc, device = {"what": __doc__.split("\n\n")[0], "shapes": {}}, None
    shapes = [tuple(int(n) for n in a.split("x")) for a in sys.argv[1:]] or SHAPES
    for m, d in shapes:
        device, op, shape, run, stored = stored_case("rmsnorm", m, d)
        wide = dataclasses.replace(stored, template="wide", rows_per_block=1, grid_cap=0, weights="late",
                                   min_blocks=1, hold="float", l2_ahead=0, ahead_priority="normal",
                                   stats="two_pass", vector=16)
        configs = {"stored": stored, **{f"wide t{t} {h}": dataclasses.replace(wide, threads=t, hint=h)
                                        for t in THREADS for h in HINTS}}
        variants = build_named(op, shape, configs, device.arch, f"{m}x{d}")
        with named_beside_peers(op, shape, run, device, variants) as (bench, subjects, gates, peers, missing):
            everyone = subjects + [p for p in peers if p.name in ("inductor", "triton")]
            row = {"kernels": {n: v.source.kernel_name for n, v in variants.items()}, "gates": gates,
                   "peers_missing": missing}
            for method in ("hot", "cold"):
                table = interleave(everyone, method, ROUNDS, PER_ROUND)
                row[method] = {n: t.to_dict() for n, t in table.items()}
                for n, t in sorted(table.items(), key=lambda kv: kv[1].median_us):
                    print(f"{m}x{d} {method} {n:18} {t.median_us:8.2f} ± {t.spread_us:.2f}", flush=True)
        doc["shapes"][f"{m}x{d}"] = row
    doc.update(provenance(device))
    write_result(device, "norms_wide_probe.json", json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
