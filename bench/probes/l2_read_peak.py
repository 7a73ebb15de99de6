"""How fast the SMs read from L2 into shared memory on this GPU, the way the tiled matmuls copy their tiles
(cp.async.cg, 16 bytes, three rounds in flight per block), and how close the tensor-core matmul's winners
come to it.

The probe (templates/probe/l2_read.cu.j2) has each block copy `rounds` chunks of an L2-resident buffer and
xor every word it copied; it is gated first (fresh random buffer, output poisoned, every thread's xor exact
against numpy) and then timed hot (the buffer stays in L2 across the graph's launches), over threads, pieces
per thread, blocks per SM and two buffer sizes. Beside it, each matmul_tc winner at 4096³ in
bench/results/<gpu>/matmul_tc.json read M·N·K·(1/bm + 1/bn) elements of A and B from L2 in its hot time; the
file gives that rate and its share of the probe's. Writes bench/results/<gpu>/l2_read_peak.json.

    python -m bench.probes.l2_read_peak
"""

from __future__ import annotations

import itertools
import json
import sys
from pathlib import Path

import numpy as np
import torch

from mage_gen import gpu
from mage_gen.compile import compile_source
from mage_gen.measure import interleave
from mage_gen.peers import TorchSubject
from mage_gen.render import render
from mage_gen.store import gpu_slug

from bench._common import passing, provenance, timing_method, write_result

THREADS = (128, 256)
PIECES = (2, 4)  # 16-byte copies per thread per round
STAGES = 4  # rounds in flight: STAGES - 1
BLOCKS_PER_SM = (1, 2, 4)
BUFFER_MB = (16, 40)  # both well inside the L2 of the GPUs this was written for; checked against the device
ROUNDS = 600
ROUNDS_PER_BENCH, PER_ROUND = 3, 3
ELEMENT_BYTES = {"bf16": 2, "tf32": 4, "fp32x3": 4}


class Probe:
    def __init__(self, threads: int, pieces: int, blocks: int, buffer: torch.Tensor, device: gpu.DeviceInfo):
        self.round_bytes = threads * pieces * 16
        self.chunks = buffer.numel() * 4 // self.round_bytes
        self.buffer, self.threads, self.pieces, self.blocks = buffer, threads, pieces, blocks
        mb = buffer.numel() * 4 >> 20
        self.name = f"l2_read_t{threads}_p{pieces}_b{blocks}_{mb}mb"
        source = render("probe/l2_read.cu.j2", {"THREADS": threads, "PIECES": pieces, "STAGES": STAGES}, self.name, None)
        self.shared = STAGES * self.round_bytes
        self.kernel = gpu.Kernel(compile_source(source, device.arch).cubin, self.name, self.shared)
        self.grid = (device.sms * blocks, 1, 1)
        self.out = torch.empty(self.grid[0] * threads * 4, dtype=torch.int32, device="cuda")
        self.bytes = self.grid[0] * ROUNDS * self.round_bytes
        self.args = gpu.KernelArgs([("ptr", self.out.data_ptr()), ("ptr", buffer.data_ptr()), ("i32", self.chunks),
                                    ("i32", ROUNDS)])

    def launch(self) -> None:
        self.kernel.launch(self.grid, (self.threads, 1, 1), self.shared, self.args,
                           torch.cuda.current_stream().cuda_stream)

    def gate(self, words: np.ndarray) -> str:
        self.out.fill_(-1)
        self.launch()
        got = self.out.cpu().numpy().view(np.uint32).reshape(self.grid[0], self.threads, 4)
        want = expected_xors(words, self.chunks, self.pieces, self.threads, self.grid[0])
        wrong = [b for b in range(self.grid[0]) if not np.array_equal(got[b], want[b])]
        return f"{len(wrong)} blocks (first {wrong[0]}) differ from the xor of their chunks" if wrong else ""


def expected_xors(words: np.ndarray, chunks: int, pieces: int, threads: int, blocks: int) -> np.ndarray:
    """(blocks, threads, 4): what the probe leaves, block b having copied chunks b·ROUNDS + r mod chunks, each
    once (ROUNDS ≤ chunks): a run of chunks, so a difference of prefix xors (wrapping at the end)."""
    assert ROUNDS <= chunks, "every block copies distinct chunks"
    per_chunk = np.bitwise_xor.reduce(words[:chunks * pieces * threads * 4].reshape(chunks, pieces, threads, 4), axis=1)
    prefix = np.concatenate([np.zeros((1, threads, 4), np.uint32), np.bitwise_xor.accumulate(per_chunk, axis=0)])
    start = np.arange(blocks) * ROUNDS % chunks
    end = start + ROUNDS
    wraps = end > chunks
    return np.where(wraps[:, None, None], prefix[chunks] ^ prefix[start] ^ prefix[np.where(wraps, end - chunks, 0)],
                    prefix[np.minimum(end, chunks)] ^ prefix[start])


def matmul_reads(device: gpu.DeviceInfo) -> list[dict]:
    """The L2 read rate of each 4096³ row of this GPU's matmul_tc.json."""
    path = Path("bench/results") / gpu_slug(device.name) / "matmul_tc.json"
    if not path.is_file():
        return []
    rows = []
    for r in json.loads(path.read_text())["shapes"]:
        if (r["m"], r["n"], r["k"]) != (4096, 4096, 4096) or "timings" not in r:
            continue
        p, us = r["params"], r["timings"]["mage-gen"]["hot"]["median_us"]
        read = ELEMENT_BYTES[r["precision"]] * r["m"] * r["n"] * r["k"] * (1 / p["bm"] + 1 / p["bn"])
        rows.append({"precision": r["precision"], "kernel": r["kernel"], "hot_us": us, "l2_read_bytes": read,
                     "tb_per_s": read / us / 1e6, "from": str(path)})
    return rows


def main() -> None:
    device = gpu.open_device()
    rng = np.random.default_rng()

    def checked():
        for mb in BUFFER_MB:
            if mb << 20 > device.l2_bytes // 1.4:
                print(f"{mb} MB is not well inside this GPU's {device.l2_bytes >> 20} MB of L2: skipped", flush=True)
                continue
            words = rng.integers(0, 2**32, size=(mb << 20) // 4, dtype=np.uint64).astype(np.uint32)
            buffer = torch.from_numpy(words.view(np.int32)).cuda()
            for threads, pieces, blocks in itertools.product(THREADS, PIECES, BLOCKS_PER_SM):
                if blocks * STAGES * threads * pieces * 16 > device.max_shared_per_block:
                    continue  # cannot be resident `blocks` at a time
                probe = Probe(threads, pieces, blocks, buffer, device)
                yield probe, probe.gate(words)
    probes, failed = passing(checked())
    subjects = [TorchSubject(p.name, p.launch, {"threads": p.threads, "pieces": p.pieces,
                                                "blocks_per_sm": p.blocks}) for p in probes]
    hot = interleave(subjects, "hot", ROUNDS_PER_BENCH, PER_ROUND)
    rows = []
    for p in probes:
        t = hot[p.name]
        rows.append({"kernel": p.name, "threads": p.threads, "pieces": p.pieces, "blocks_per_sm": p.blocks,
                     "buffer_mb": p.buffer.numel() * 4 >> 20, "hot": t.to_dict(), "tb_per_s": p.bytes / t.median_us / 1e6})
        print(f"{p.name:28} {t.median_us:9.1f} µs ± {t.spread_us:5.1f}  {rows[-1]['tb_per_s']:6.2f} TB/s", flush=True)
    best = max(rows, key=lambda r: r["tb_per_s"]) if rows else None
    reads = matmul_reads(device)
    for r in reads:
        r["share_of_probe"] = r["tb_per_s"] / best["tb_per_s"] if best else None
        print(f"matmul_tc {r['precision']:6} 4096^3 reads {r['tb_per_s']:.2f} TB/s from L2"
              + (f": {r['share_of_probe']:.2f} of the probe's best" if best else ""))
    doc = {
        "what": "L2 -> shared memory read rate by cp.async.cg (a probe) and the tensor-core matmul winners' L2 reads "
                "at 4096^3, recorded by bench/probes/l2_read_peak.py",
        "method": {"probe": f"{STAGES - 1} rounds in flight per block, {ROUNDS} rounds of threads x pieces x 16 bytes "
                            "per block, chunks of an L2-resident buffer, every word xor-checked",
                   "gate": "fresh random buffer, output poisoned, every thread's xor against numpy",
                   "matmul": "bytes = element size x M*N*K*(1/bm + 1/bn), the A and B tiles every block copies; "
                             "rate = bytes / the hot median in matmul_tc.json",
                   **timing_method(ROUNDS_PER_BENCH, PER_ROUND)},
        **provenance(device), "probes": rows, "failed": failed, "best": best, "matmul_tc_4096": reads,
    }
    for p in probes:
        p.kernel.unload()
    out = write_result(device, "l2_read_peak.json", json.dumps(doc, indent=1) + "\n")
    print(f"wrote {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
