"""What Inductor generates for the eager norms bench/norms.py times, at the DRAM-bound d = 8192 bf16 shapes
where it is the best peer hot (RMSNorm 16384×8192 under the copy of the same bytes): its Triton source, the
eviction policy of every load, and the launch configs it was given. Writes
bench/results/<gpu>/norms_inductor_code_probe.json and the sources beside it (.txt).

    python bench/norms_inductor_code_probe.py                           # the three shapes below
    python bench/norms_inductor_code_probe.py rmsnorm+res:4096x4096 --as NAME   # those shapes, to NAME.json/.txt

Each is compiled from the bench's Inductor peer's own code (mage_gen.peers.eager_norm_into): the norm of x, or
h = x + r and the norm of h, copied into outputs given.
"""

from __future__ import annotations

import argparse
import json
import re

import torch
from torch._inductor.utils import run_and_get_code

from mage_gen import gpu
from mage_gen.peers import eager_norm, eager_norm_into

from _common import norm_case, provenance, write_result  # bench/_common.py, beside this script
from norms_keep_probe import inductor_configs

SHAPES = [("rmsnorm", 4096, 8192), ("rmsnorm", 16384, 8192), ("layernorm", 16384, 8192)]
EPS = 1e-5


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("shapes", nargs="*", type=norm_case, help="OP[+res]:MxD (default: the three of SHAPES)")
    parser.add_argument("--as", dest="name", default="norms_inductor_code_probe", help="result file name, no suffix")
    args = parser.parse_args()
    device = gpu.open_device()
    rows, texts, seen = [], [], set()
    for kind, residual, m, d in args.shapes or [(kind, False, m, d) for kind, m, d in SHAPES]:
        torch._dynamo.reset()
        x, y = (torch.randn(m, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        # (x, residual, y, residual_out) as the Inductor peer is called
        rows_in = [x, torch.randn_like(x), y, torch.empty_like(x)] if residual else [x, None, y, None]
        weights = [torch.randn(d, device="cuda", dtype=torch.bfloat16) for _ in range(1 if kind == "rmsnorm" else 2)]
        eager = eager_norm("F.rms_norm" if kind == "rmsnorm" else "F.layer_norm", d, EPS)
        compiled = torch.compile(eager_norm_into(eager), dynamic=False, fullgraph=True)
        _, sources = run_and_get_code(compiled, *rows_in, *weights)
        compiled(*rows_in, *weights)  # once more, autotuned: inductor_configs reads the launcher it kept
        torch.cuda.synchronize()
        source = "\n".join(sources)
        name = f"{kind}{'+res' if residual else ''} {m}x{d}"
        rows.append({
            "op": kind, "residual": residual, "m": m, "d": d,
            "loads": re.findall(r"tl\.load\([^\n]*", source),
            "stores": re.findall(r"tl\.store\([^\n]*", source),
            "eviction_policies": sorted(set(re.findall(r"eviction_policy='(\w+)'", source))),
            "heuristics": re.findall(r"@triton_heuristics\.\w+\([^@]*?\)\n@triton\.jit", source, re.S),
            # what its autotuner picked on the first call, and the load forms of the PTX
            "autotuned": inductor_configs(seen),
        })
        texts.append(f"===== {name} bf16 =====\n{source}\n")
        print(f"{name}: eviction policies {rows[-1]['eviction_policies']}; autotuned {rows[-1]['autotuned']}",
              flush=True)
        for line in rows[-1]["loads"] + rows[-1]["stores"]:
            print("   ", line.strip(), flush=True)
    doc = {"what": "Inductor's generated code for the eager bf16 norms of bench/norms.py; recorded by "
                   "bench/norms_inductor_code_probe.py", **provenance(device), "shapes": rows}
    write_result(device, f"{args.name}.json", json.dumps(doc, indent=1) + "\n")
    write_result(device, f"{args.name}.txt", "".join(texts))


if __name__ == "__main__":
    main()
