"""Norms: does where y starts, within its allocation, move RMSNorm 4096×8192's time?

norms_placement_peer_probe.json: on one copy of x and w, at four placements of the inputs, Triton ran 33.7–33.8 µs
hot, the stored winner 34.3–34.6 and a config of ours with Triton's shape and near-identical SASS (256 threads,
four 16-byte plain loads a thread, no prefetch) 33.6 at one placement and 35.0–35.3 at the three others. The
subjects share x and w but not y: a peer writes a tensor of torch's (its allocation's first byte), a kernel of
ours the timing output, which starts 4 KB into its allocation, after the fence. Here every kernel writes a y
at several offsets into one allocation (0, 4 KB, 64 KB, 1 MB + 4 KB) and reads one x, gated once per offset
against a float64 rms_norm, then timed hot (a CUDA graph of launches, per launch) and cold (L2 flushed before
each), interleaved. Writes bench/results/<gpu>/norms_output_offset_probe.json.

    python bench/norms_output_offset_probe.py
"""
import json
import statistics
import sys

import torch
from cuda.bindings import driver as cu

sys.path.insert(0, "bench")
from _common import prepared, winner_params, write_result

from mage_gen import gpu
from mage_gen.measure import flush_buffer
from mage_gen.ops import get_op
from mage_gen.peers import triton_rmsnorm
from mage_gen.variants import build

OFFSETS = (0, 4096, 65536, 2 ** 20 + 4096)
ROUNDS, GRAPH_LAUNCHES, REPLAYS, COLD = 5, 20, 5, 5
M, D, EPS = 4096, 8192, 1e-6


def main() -> None:
    device = gpu.open_device()
    op = get_op("rmsnorm")
    shape, run = op.shape(d=D, dtype="bf16"), {"m": M}
    configs = {"stored": winner_params(op, shape, device, False, [], run=run),
               "t256 plain": op.params_from_dict({"template": "row", "threads": 256, "vector": 16, "hint": "none"})}
    x = torch.randn(M, D, device="cuda", dtype=torch.bfloat16)
    w = (1 + 0.1 * torch.randn(D, device="cuda")).to(torch.bfloat16)
    pool = torch.empty(M * D * 2 + max(OFFSETS), dtype=torch.uint8, device="cuda")
    ys = {o: pool[o:o + M * D * 2].view(torch.bfloat16).view(M, D) for o in OFFSETS}
    want = torch.nn.functional.rms_norm(x.double(), (D,), w.double(), EPS)
    launchers, kernels = {}, {}
    for name, params in configs.items():
        variant = build(op, shape, params, device.arch)
        fixed = prepared(op, shape, variant, run)
        kernels[name] = variant.source.kernel_name
        launchers[name] = (lambda y, f=fixed: f.launch([y.data_ptr(), x.data_ptr(), w.data_ptr(), M, EPS],
                                                       torch.cuda.current_stream().cuda_stream))
    launchers["triton w8"] = lambda y: triton_rmsnorm[(M,)](x, y, w, D, EPS, x, y, BLOCK=D, RESIDUAL=False,
                                                             num_warps=8)
    for name, launch in launchers.items():
        for offset, y in ys.items():
            y.fill_(float("nan"))
            launch(y)
            error = float(torch.linalg.norm(y.double() - want) / torch.linalg.norm(want))
            if not error < 2 ** -8:  # NaN fails too
                raise SystemExit(f"{name} y+{offset}: off by {error:.3g} in relative norm; nothing timed")
    torch.cuda.synchronize()
    graphs = {}
    for name, launch in launchers.items():
        for offset, y in ys.items():
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                for _ in range(GRAPH_LAUNCHES):
                    launch(y)
            graphs[name, offset] = g
    flush = flush_buffer()
    hot = {key: [] for key in graphs}
    cold = {key: [] for key in graphs}
    for _ in range(ROUNDS):
        for (name, offset), g in graphs.items():
            for _ in range(REPLAYS):
                start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                g.replay()
                stop.record()
                torch.cuda.synchronize()
                hot[name, offset].append(start.elapsed_time(stop) * 1e3 / GRAPH_LAUNCHES)
            for _ in range(COLD):
                flush.fill32(0x1234, cu.CUstream(torch.cuda.current_stream().cuda_stream))
                start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                launchers[name](ys[offset])
                stop.record()
                torch.cuda.synchronize()
                cold[name, offset].append(start.elapsed_time(stop) * 1e3)
    rows = []
    for name, offset in graphs:
        h, c = hot[name, offset], cold[name, offset]
        rows.append({"subject": name, "y_offset_bytes": offset, "hot_median_us": statistics.median(h),
                     "hot_spread_us": (max(h) - min(h)) / 2, "cold_median_us": statistics.median(c),
                     "cold_spread_us": (max(c) - min(c)) / 2})
        r = rows[-1]
        print(f"{name:11} y+{offset:<8} hot {r['hot_median_us']:7.2f}±{r['hot_spread_us']:.2f}  "
              f"cold {r['cold_median_us']:7.2f}±{r['cold_spread_us']:.2f} µs", flush=True)
    doc = {"what": __doc__.split("\n\n")[0], "shape": f"rmsnorm {M}x{D} bf16", "kernels": kernels,
           "method": {"hot": f"a CUDA graph of {GRAPH_LAUNCHES} launches, {REPLAYS} replays a round, per launch",
                      "cold": f"the L2 flushed before each of {COLD} launches a round", "rounds": ROUNDS,
                      "spread": "half the range of the samples"},
           "x_ptr_mod_2mb": x.data_ptr() % 2 ** 21, "pool_ptr_mod_2mb": pool.data_ptr() % 2 ** 21, "rows": rows}
    write_result(device, "norms_output_offset_probe.json", json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
