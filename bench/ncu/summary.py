"""What limits a matmul kernel, from the raw CSVs bench/ncu/matmul.sh wrote: launch shape, occupancy, issue
FMA- and tensor-pipe utilisation, shared-memory bank conflicts and the leading stall reasons per issued instruction.

    python -m bench.ncu.summary bench/results/h200/ncu/*.csv > bench/results/h200/ncu/summary.txt
"""

from __future__ import annotations

import csv
import sys
from pathlib import Path

METRICS = [
    "gpu__time_duration.sum", "launch__grid_size", "launch__block_size", "launch__registers_per_thread",
    "launch__shared_mem_per_block_dynamic", "launch__shared_mem_per_block_static",
    "launch__occupancy_limit_registers", "launch__occupancy_limit_shared_mem",
    "sm__warps_active.avg.pct_of_peak_sustained_active", "smsp__issue_active.avg.pct_of_peak_sustained_active",
    "sm__inst_executed_pipe_fma.avg.pct_of_peak_sustained_active", "smsp__inst_executed.sum",
    "l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum",
    "l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ldgsts.sum", "smsp__sass_inst_executed_op_shared_ld.sum",
    # how much of the launch the SMs were busy (a short kernel's fill and tail), and what its bytes came from
    "sm__cycles_active.avg", "gpc__cycles_elapsed.max", "sm__throughput.avg.pct_of_peak_sustained_elapsed",
    "lts__throughput.avg.pct_of_peak_sustained_elapsed", "dram__bytes_read.sum",
]
STALL_PREFIX, STALL_SUFFIX = "smsp__average_warps_issue_stalled_", "_per_issue_active.ratio"
STALLS_SHOWN = 8


def summarize(path: Path) -> str:
    # ncu --page raw --csv: a row of metric names, a row of units, then one row per profiled kernel.
    names, units, *kernels = list(csv.reader(path.open()))
    return "\n".join(_kernel(path, names, units, values) for values in kernels)


def _kernel(path: Path, names: list[str], units: list[str], values: list[str]) -> str:
    value, unit = dict(zip(names, values)), dict(zip(names, units))
    lines = [f"== {path.name} {value.get('Kernel Name', '')[:90]}"]
    lines += [f"  {name} = {value[name]} {unit[name]}" for name in METRICS if name in value]
    # the tensor pipes go by several names across GPUs and ncu versions: every utilisation of one
    lines += [f"  {name} = {value[name]} {unit[name]}" for name in sorted(value)
              if "pipe_tensor" in name and name.endswith("pct_of_peak_sustained_active") and value[name] not in ("", "n/a")]
    stalls = sorted(((float(v.replace(",", "")), name[len(STALL_PREFIX):-len(STALL_SUFFIX)])
                     for name, v in value.items()
                     if name.startswith(STALL_PREFIX) and name.endswith(STALL_SUFFIX) and v not in ("", "n/a")),
                    reverse=True)
    lines.append("  stalls per issued instruction: "
                 + ", ".join(f"{reason} {ratio:.2f}" for ratio, reason in stalls[:STALLS_SHOWN]))
    return "\n".join(lines)


if __name__ == "__main__":
    print("\n".join(summarize(Path(p)) for p in sys.argv[1:]))
