"""How often the gate sees the tensor-core matmul's planted loose wait on this GPU. A wait_group one too loose
is a race: the multiply reads a stage whose copy may not have landed, and whether it had depends on how long
the copy takes. Each config (bm = bn = 64) is gated once as written, then with the planted bug on fresh inputs
per seed. `--inputs l2`: shapes whose inputs stay in L2; `dram`: 4096×4096×1024, whose C poisoning (64 MB)
pushes the inputs out of L2, beside 2048² for contrast. Writes bench/results/<gpu>/tc_loose_wait_probe_<inputs>.json.

    python bench/tc_loose_wait_probe.py --inputs dram
"""

import argparse
import itertools
import json
import sys

sys.path.insert(0, "tests")
from mage_gen import gpu  # noqa: E402
from mage_gen.errors import ConfigError  # noqa: E402
from mage_gen.ops import get_op  # noqa: E402

from drawn import gate_on_gpu  # noqa: E402  (tests/drawn.py)
from _common import write_result  # noqa: E402  (bench/_common.py)

SWEEPS = {  # shapes, stages, bk, seeds
    "l2": ([(2048, 2048, 1024), (256, 256, 1024)], [2, 3], [16, 32], 3),
    "dram": ([(4096, 4096, 1024), (2048, 2048, 1024)], [2], [16], 5),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--inputs", choices=SWEEPS, default="dram")
    args = parser.parse_args()
    shapes, stage_counts, depths, seeds = SWEEPS[args.inputs]
    op, device, stream = get_op("matmul_tc"), gpu.open_device(), gpu.Stream()
    rows = []
    for (m, n, k), precision, sync, stages, bk in itertools.product(
            shapes, ["bf16", "tf32", "fp32x3"], ["two", "one"], stage_counts, depths):
        shape = op.shape(m=m, n=n, k=k, precision=precision)
        values = {"bm": 64, "bn": 64, "bk": bk, "stages": stages, "sync": sync}
        try:
            clean = gate_on_gpu(op, device, stream, shape, op.params_from_dict(values)).passed
        except ConfigError as e:
            print("refused:", values, e)
            continue
        planted = op.params_from_dict({**values, "plant": "loose_wait"})
        rejected = sum(not gate_on_gpu(op, device, stream, shape, planted, seed=s).passed for s in range(seeds))
        rows.append(dict(m=m, n=n, k=k, precision=precision, **values, clean_passed=clean,
                         **{f"loose_rejected_of_{seeds}": rejected}))
        print(rows[-1], flush=True)
    write_result(device, f"tc_loose_wait_probe_{args.inputs}.json", json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
