"""Plain-text tables of splitserve bench serve results (one run, and one row per rate of a sweep)."""

from __future__ import annotations

import math

METRICS = (("TTFT", "ttft_ms"), ("ITL", "itl_ms"), ("TPOT", "tpot_ms"), ("E2E", "e2e_ms"))


def _rate(rate: float | None) -> str:
    return "inf" if rate is None or math.isinf(rate) else f"{rate:g}"


def _ms(value: float) -> str:
    return "-" if value is None or math.isnan(value) else f"{value:.1f}"


def slo_text(goodput: dict) -> str:
    parts = [
        f"TTFT <= {goodput['slo_ttft_ms']:g} ms" if goodput["slo_ttft_ms"] is not None else "",
        f"ITL p99 <= {goodput['slo_itl_ms']:g} ms" if goodput["slo_itl_ms"] is not None else "",
        f"TPOT <= {goodput['slo_tpot_ms']:g} ms" if goodput["slo_tpot_ms"] is not None else "",
    ]
    return ", ".join(p for p in parts if p) or "no latency SLO: every complete request counts"


def format_run(run: dict, mode: str, api: str) -> str:
    """A run's accounting, throughput, goodput and latency table."""
    s, g = run["summary"], run["summary"]["goodput"]
    arrivals = "all at once" if run["request_rate"] is None or math.isinf(run["request_rate"]) else "Poisson"
    lines = [
        f"== mode {mode}, api {api}, rate {_rate(run['request_rate'])} req/s ({arrivals}), "
        f"concurrency {run['concurrency'] or '-'}",
        f"requests    planned {s['num_planned']}, sent {s['num_sent']}: completed {s['num_completed']}, "
        f"failed {s['num_failed']}, cancelled {s['num_cancelled']}, not sent {s['num_not_sent']}",
        f"tokens      output asked {s['output_tokens_asked']}, received {s['output_tokens_received']} "
        f"({s['num_token_mismatch']} completed requests short or long); prompt {s['completed_prompt_tokens']} "
        f"({s['cached_prompt_tokens']} from a prefix cache)",
        f"duration    {s['duration_s']:.2f} s",
        f"throughput  {s['request_throughput']:.3f} req/s, {s['output_token_throughput']:.1f} output tok/s, "
        f"{s['total_token_throughput']:.1f} total tok/s",
        f"goodput     {g['num_met']}/{s['num_sent']} = {100 * g['share']:.1f}% ({slo_text(g)}): {g['rate']:.3f} req/s",
        f"{'(ms)':<6}{'mean':>9}{'p50':>9}{'p90':>9}{'p99':>9}{'max':>9}{'count':>8}",
    ]
    for name, key in METRICS:
        d = s[key]
        lines.append(
            f"{name:<6}" + "".join(f"{_ms(d[k]):>9}" for k in ("mean", "p50", "p90", "p99", "max")) + f"{d['count']:>8}"
        )
    for message, count in s["errors"].items():
        lines.append(f"error x{count}: {message}")
    return "\n".join(lines)


def format_sweep(result: dict) -> str:
    """One row per rate (markdown, so it pastes into docs/performance.md)."""
    head = (
        "| rate (req/s) | done/sent | req/s | out tok/s | TTFT p50 | TTFT p99 | ITL p50 | ITL p99 "
        "| TPOT p50 | E2E p50 | goodput | goodput req/s |"
    )
    lines = [
        f"mode {result['mode'] or '-'}, api {result['api']}; latencies in ms; "
        f"SLO: {slo_text(result['runs'][0]['summary']['goodput'])}",
        head,
        "|" + "---|" * 12,
    ]
    for run in result["runs"]:
        s = run["summary"]
        lines.append(
            f"| {_rate(run['request_rate'])} | {s['num_completed']}/{s['num_sent']} "
            f"| {s['request_throughput']:.2f} | {s['output_token_throughput']:.1f} "
            f"| {_ms(s['ttft_ms']['p50'])} | {_ms(s['ttft_ms']['p99'])} | {_ms(s['itl_ms']['p50'])} "
            f"| {_ms(s['itl_ms']['p99'])} | {_ms(s['tpot_ms']['p50'])} | {_ms(s['e2e_ms']['p50'])} "
            f"| {100 * s['goodput']['share']:.0f}% | {s['goodput']['rate']:.2f} |"
        )
    return "\n".join(lines)
