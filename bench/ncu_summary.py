"""Print the figures that say what binds a kernel from an Nsight Compute `--csv --page details` report:
DRAM and memory throughput, duration, occupancy (achieved, theoretical, what limits it), registers, issue
activity and the warp stall reasons, one block per profiled launch.

    python3 bench/ncu_summary.py ncu.csv
"""

from __future__ import annotations

import csv
import sys

KEEP = (
    "DRAM Throughput",
    "Memory Throughput",
    "Duration",
    "Achieved Occupancy",
    "Theoretical Occupancy",
    "Block Limit",
    "Registers Per Thread",
    "Grid Size",
    "Waves Per SM",
    "Warp Cycles Per Issued Instruction",
    "Issue Slots Busy",
    "Issued Warp",
    "Stall",
    "L2 Hit Rate",
    "Mem Busy",
    "Max Bandwidth",
    "smsp__average_warps_issue_stalled",  # the stall reasons (--metrics), warps per issued instruction
    "smsp__inst_executed",
    "smsp__issue_active",
    "dram__bytes_read",
)


def main(path: str) -> int:
    with open(path) as f:
        rows = list(csv.DictReader(line for line in f if line.startswith('"')))
    launches = sorted({(r["ID"], r["Kernel Name"]) for r in rows}, key=lambda launch: int(launch[0]))
    for launch in launches:
        print(f"launch {launch[0]} {launch[1][:60]}")
        for r in rows:
            if (r["ID"], r["Kernel Name"]) == launch and r["Metric Name"].startswith(KEEP):
                print(f"    {r['Metric Name']:45s} {r['Metric Value']:>14s} {r['Metric Unit']}")
    if not launches:
        print(f"{path}: no profiled launches")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
