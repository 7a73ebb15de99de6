"""What Inductor generates for the eager norms bench/norms.py times, at the DRAM-bound d = 8192 bf16 shapes
where it is the best peer hot (RMSNorm 16384×8192 under the copy of the same bytes): its Triton source, the
eviction policy of every load, and the launch configs it was given. Writes
bench/results/<gpu>/norms_inductor_code_probe.json and the sources beside it (.txt).

    python bench/norms_inductor_code_probe.py
"""

from __future__ import annotations

import json
import re

import torch
import torch.nn.functional as F
from torch._inductor.utils import run_and_get_code

from mage_gen import gpu

from _common import provenance, write_result  # bench/_common.py, beside this script

SHAPES = [("rmsnorm", 4096, 8192), ("rmsnorm", 16384, 8192), ("layernorm", 16384, 8192)]
EPS = 1e-5


def eager(kind: str):
    def rms(x, w):
        return F.rms_norm(x, (x.shape[-1],), w, EPS)

    def layer(x, w, b):
        return F.layer_norm(x, (x.shape[-1],), w, b, EPS)
    return rms if kind == "rmsnorm" else layer


def main() -> None:
    device = gpu.open_device()
    rows, texts = [], []
    for kind, m, d in SHAPES:
        torch._dynamo.reset()
        x = torch.randn(m, d, device="cuda", dtype=torch.bfloat16)
        weights = [torch.randn(d, device="cuda", dtype=torch.bfloat16) for _ in range(1 if kind == "rmsnorm" else 2)]
        _, sources = run_and_get_code(torch.compile(eager(kind), dynamic=False, fullgraph=True), x, *weights)
        source = "\n".join(sources)
        rows.append({
            "op": kind, "m": m, "d": d,
            "loads": re.findall(r"tl\.load\([^\n]*", source),
            "stores": re.findall(r"tl\.store\([^\n]*", source),
            "eviction_policies": sorted(set(re.findall(r"eviction_policy='(\w+)'", source))),
            "heuristics": re.findall(r"@triton_heuristics\.\w+\([^@]*?\)\n@triton\.jit", source, re.S),
        })
        texts.append(f"===== {kind} {m}x{d} bf16 =====\n{source}\n")
        print(f"{kind} {m}x{d}: eviction policies {rows[-1]['eviction_policies']}", flush=True)
        for line in rows[-1]["loads"] + rows[-1]["stores"]:
            print("   ", line.strip(), flush=True)
    doc = {"what": "Inductor's generated code for the eager bf16 norms of bench/norms.py; recorded by "
                   "bench/norms_inductor_code_probe.py", **provenance(device), "shapes": rows}
    write_result(device, "norms_inductor_code_probe.json", json.dumps(doc, indent=1) + "\n")
    write_result(device, "norms_inductor_code_probe.txt", "".join(texts))


if __name__ == "__main__":
    main()
