"""Latency-vs-rate and goodput-vs-rate curves from splitserve bench serve sweep JSON files.

    python -m splitserve.bench.serve_plot disagg.json coloc.json --out docs/img/serve_cpu

draws every file's sweep on the same axes (labelled by its mode), writing
<out>_latency.png (TTFT p50/p99, ITL p99) and <out>_goodput.png (share of requests meeting the
SLO, and goodput in req/s). matplotlib is imported only here, and only when plotting.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence


def _points(sweep: dict, path: Sequence[str]) -> tuple[list[float], list[float]]:
    rates, values = [], []
    for run in sweep["runs"]:
        value = run["summary"]
        for key in path:
            value = value[key]
        rates.append(run["request_rate"])
        values.append(value)
    return rates, values


def plot_sweeps(sweeps: Sequence[dict], out_prefix: str) -> list[str] | str:
    """Write the two PNGs; their paths, or a message saying why nothing was drawn."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install matplotlib); skipping the plots"
    if any(r["request_rate"] in (None, float("inf")) for s in sweeps for r in s["runs"]):
        return "a sweep rate is inf (no Poisson arrivals); curves need finite rates, skipping the plots"
    styles = ("-o", "--s", ":^", "-.d")
    paths = []
    panels = {
        "latency": [
            ("TTFT (ms)", [(("ttft_ms", "p50"), "TTFT p50"), (("ttft_ms", "p99"), "TTFT p99")]),
            ("ITL (ms)", [(("itl_ms", "p50"), "ITL p50"), (("itl_ms", "p99"), "ITL p99")]),
        ],
        "goodput": [
            ("requests meeting the SLO (%)", [(("goodput", "share"), "share")]),
            ("goodput (req/s)", [(("goodput", "rate"), "goodput")]),
        ],
    }
    for name, axes_spec in panels.items():
        fig, axes = plt.subplots(1, len(axes_spec), figsize=(5.5 * len(axes_spec), 4))
        for ax, (ylabel, series) in zip(axes, axes_spec):
            for i, sweep in enumerate(sweeps):
                for j, (path, label) in enumerate(series):
                    rates, values = _points(sweep, path)
                    if path == ("goodput", "share"):
                        values = [100 * v for v in values]
                    ax.plot(
                        rates,
                        values,
                        styles[j % len(styles)],
                        color=f"C{i}",
                        label=f"{sweep.get('label') or sweep.get('mode') or f'run {i}'}: {label}",
                    )
            if name == "goodput" and ylabel.startswith("goodput"):
                top = max(r["request_rate"] for s in sweeps for r in s["runs"])
                ax.plot([0, top], [0, top], color="0.7", linewidth=0.8, label="offered rate")
            ax.set_xlabel("request rate (req/s)")
            ax.set_ylabel(ylabel)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
        fig.suptitle(_title(sweeps[0], name))
        fig.tight_layout()
        path = f"{out_prefix}_{name}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


def _title(sweep: dict, name: str) -> str:
    slo = sweep["runs"][0]["summary"]["goodput"]
    targets = [
        f"TTFT ≤ {slo['slo_ttft_ms']:g} ms" if slo["slo_ttft_ms"] is not None else "",
        f"ITL p99 ≤ {slo['slo_itl_ms']:g} ms" if slo["slo_itl_ms"] is not None else "",
        f"TPOT ≤ {slo['slo_tpot_ms']:g} ms" if slo["slo_tpot_ms"] is not None else "",
    ]
    what = "latency vs request rate" if name == "latency" else "goodput vs request rate"
    return f"{what} ({', '.join(t for t in targets if t) or 'no SLO'})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m splitserve.bench.serve_plot", description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="+", help="JSON files written by splitserve bench serve --sweep ... --json")
    parser.add_argument("--out", required=True, help="output path prefix (writes <out>_latency.png, <out>_goodput.png)")
    ns = parser.parse_args(argv)
    sweeps = []
    for path in ns.files:
        with open(path) as f:
            sweeps.append(json.load(f))
    modes = [s.get("mode") for s in sweeps]
    for path, sweep in zip(ns.files, sweeps):  # the file name tells apart sweeps of one mode
        if modes.count(sweep.get("mode")) > 1:
            sweep["label"] = f"{sweep.get('mode')} ({os.path.splitext(os.path.basename(path))[0]})"
    result = plot_sweeps(sweeps, ns.out)
    if isinstance(result, str):
        print(result, file=sys.stderr)
        return 1
    print("\n".join(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
