"""What limits a matmul kernel, from the raw CSVs bench/ncu_matmul.sh wrote: launch shape, occupancy, issue
and FMA-pipe utilisation, shared-memory bank conflicts and the leading stall reasons per issued instruction.

    python bench/ncu_summary.py bench/results/h200/ncu/*.csv > bench/results/h200/ncu/summary.txt
"""
import csv, sys
KEYS = ["gpu__time_duration.sum", "launch__grid_size", "launch__block_size", "launch__registers_per_thread",
        "launch__shared_mem_per_block_dynamic", "launch__shared_mem_per_block_static", "launch__occupancy_limit_registers",
        "launch__occupancy_limit_shared_mem", "sm__warps_active.avg.pct_of_peak_sustained_active",
        "smsp__issue_active.avg.pct_of_peak_sustained_active", "sm__inst_executed_pipe_fma.avg.pct_of_peak_sustained_active",
        "smsp__inst_executed.sum", "l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum",
        "l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ldgsts.sum", "smsp__inst_executed_op_shared_ld.sum",
        "sm__sass_inst_executed_op_shared_ld.sum", "smsp__sass_inst_executed_op_shared_ld.sum"]
for path in sys.argv[1:]:
    rows = list(csv.reader(open(path)))
    hdr, units, vals = rows[0], rows[1], rows[2]
    d = dict(zip(hdr, vals)); u = dict(zip(hdr, units))
    print("==", path.split("/")[-1], d.get("Kernel Name", "")[:90])
    for k in KEYS:
        if k in d: print(f"  {k} = {d[k]} {u[k]}")
    st = sorted(((float(v.replace(",", "")), h) for h, v in d.items()
                 if "average_warps_issue_stalled" in h and h.endswith("per_issue_active.ratio") and v not in ("", "n/a")), reverse=True)
    print("  stalls per issued instruction: " + ", ".join(f"{h.split('stalled_')[1].split('_per_issue')[0]} {v:.2f}" for v, h in st[:8]))
