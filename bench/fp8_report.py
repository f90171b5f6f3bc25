"""The end of bench/fp8_gpu.sh: one run's fp8 tables side by side, read back from the JSON its steps wrote.

    python -m bench.fp8_report OUT_DIR

OUT_DIR/kernels_fp8.json (step 2: the projections bf16 / W8A8 / W8A16), OUT_DIR/fixed_fp8.json (step 3: the
8B decode step bf16 beside fp8 weights + KV, with issue 19's goals), OUT_DIR/quality.json (step 5); a missing
file (a step not run or cut short) is named and skipped.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

# issue 19: 8B-shape decode step with fp8 weights + fp8 KV, by batch
DECODE_GOAL_MS = {1: 2.8, 128: 6.5}


def decode_table(rows: list[dict]) -> list[str]:
    lines = [
        "| engine | batch | decode step ms (p10-p90) | floor ms | x floor | goal |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        goal = DECODE_GOAL_MS.get(r["batch"]) if r["engine"].startswith("splitserve:fp8") else None
        verdict = "" if goal is None else f"<= {goal}: {'met' if r['decode_step_ms'] <= goal else '**missed**'}"
        lines.append(
            f"| {r['engine']} | {r['batch']} | {r['decode_step_ms']:.2f} ({r['decode_step_p10_ms']:.2f}-"
            f"{r['decode_step_p90_ms']:.2f}) | {r['floor_ms']:.2f} | {r['decode_step_ms'] / r['floor_ms']:.2f} | "
            f"{verdict} |"
        )
    return lines


def _load(path: Path) -> dict | None:
    if not path.exists():
        print(f"\n({path.name}: not written; its step did not run or did not finish)")
        return None
    return json.loads(path.read_text())


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        raise SystemExit("usage: python -m bench.fp8_report OUT_DIR")
    from bench.fp8_linear import fp8_linear_table
    from bench.fp8_quality import quality_table

    out = Path(argv[0])
    kernels = _load(out / "kernels_fp8.json")
    if kernels and kernels.get("fp8_linear"):
        print(f"\n8B projections, graphed, on {kernels['device']} (copy {kernels['copy_gbps']:.0f} GB/s):")
        print("\n".join(fp8_linear_table(kernels["fp8_linear"])))
    fixed = _load(out / "fixed_fp8.json")
    if fixed:
        print(f"\n8B-shape decode step (prompt {fixed['args']['prompt_len']}, {fixed['args']['output_len']} outputs):")
        print("\n".join(decode_table(fixed["results"])))
    quality = _load(out / "quality.json")
    if quality:
        print(f"\nquality, default model on {quality['args']['device']}:")
        print("\n".join(quality_table(quality["results"])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
