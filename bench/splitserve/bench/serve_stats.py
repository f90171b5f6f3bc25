"""Statistics of a serving run: per-request latencies, percentiles, throughput, goodput.

Definitions (all times in seconds inside records, milliseconds in summaries):

    send ──────── first token ─── token 2 ── ... ── token n ── final message
      │◀── TTFT ──▶│◀─ ITL ─▶│                          │
      │◀──────────────────────── e2e ─────────────────────────────▶│
    TPOT = (e2e - TTFT) / (n - 1)

A streamed message (gRPC) or SSE chunk (REST) may carry k > 1 tokens when the gateway merged
deltas; its gap to the previous message is spread evenly over its k tokens (k entries of
gap / k), so a request with n tokens has exactly n - 1 ITLs, and tokens that came in the first
message after the first token count as ITLs of 0. Percentiles interpolate linearly between
closest ranks (numpy's default).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

PERCENTILES = (50, 90, 99)
COMPLETED, FAILED, CANCELLED, NOT_SENT = "completed", "failed", "cancelled", "not_sent"


def percentile(values: Sequence[float], q: float) -> float:
    """q-th percentile (0..100) with linear interpolation between closest ranks; NaN when empty."""
    if not 0 <= q <= 100:
        raise ValueError(f"percentile q must be in [0, 100], got {q}")
    if not values:
        return math.nan
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    lo = math.floor(position)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (position - lo)


def describe(values_s: Sequence[float]) -> dict:
    """count, mean, p50/p90/p99 and max of values in seconds, reported in milliseconds."""
    out = {"count": len(values_s)}
    if not values_s:
        return {**out, "mean": math.nan, **{f"p{q}": math.nan for q in PERCENTILES}, "max": math.nan}
    out["mean"] = 1000 * sum(values_s) / len(values_s)
    for q in PERCENTILES:
        out[f"p{q}"] = 1000 * percentile(values_s, q)
    out["max"] = 1000 * max(values_s)
    return out


def token_gaps(sent_s: float, events: Iterable[tuple[float, int]]) -> tuple[float | None, list[float]]:
    """(TTFT, ITLs) from (arrival time, tokens in that message) events; k = 0 events are skipped."""
    ttft, itls, previous = None, [], None
    for arrived, k in events:
        if k <= 0:
            continue
        if previous is None:
            ttft = arrived - sent_s
            itls += [0.0] * (k - 1)
        else:
            itls += [(arrived - previous) / k] * k
        previous = arrived
    return ttft, itls


@dataclass
class RequestRecord:
    """One planned request: what it asked for and what came back (times relative to the run start)."""

    index: int
    prompt_len: int
    output_len: int  # tokens asked for (max_tokens with ignore_eos)
    scheduled_s: float  # planned arrival
    status: str = NOT_SENT
    sent_s: float | None = None
    ttft_s: float | None = None
    e2e_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    num_received: int = 0  # output tokens the stream carried (usage when the stream does not list them)
    prompt_tokens_reported: int | None = None  # usage.prompt_tokens from the gateway
    cached_prompt_tokens: int = 0  # usage: prompt tokens served from a prefix cache
    finish_reason: str = ""
    error: str = ""
    resent_after: list[str] = field(default_factory=list)  # why each earlier send of it was sent again
    meets_slo: bool = False

    @property
    def tpot_s(self) -> float | None:
        if self.status != COMPLETED or self.num_received < 2 or self.e2e_s is None or self.ttft_s is None:
            return None
        return (self.e2e_s - self.ttft_s) / (self.num_received - 1)

    def to_json(self) -> dict:
        return {
            "index": self.index,
            "status": self.status,
            "prompt_len": self.prompt_len,
            "output_len": self.output_len,
            "num_received": self.num_received,
            "prompt_tokens_reported": self.prompt_tokens_reported,
            "cached_prompt_tokens": self.cached_prompt_tokens,
            "finish_reason": self.finish_reason,
            "error": self.error,
            "resent_after": self.resent_after,
            "scheduled_s": self.scheduled_s,
            "sent_s": self.sent_s,
            "ttft_s": self.ttft_s,
            "e2e_s": self.e2e_s,
            "tpot_s": self.tpot_s,
            "itl_p99_s": percentile(self.itl_s, 99) if self.itl_s else None,
            "num_itl": len(self.itl_s),
            "meets_slo": self.meets_slo,
        }


@dataclass(frozen=True)
class Slo:
    """Latency targets in milliseconds; None means not checked. ITL is the p99 of a request's own ITLs."""

    ttft_ms: float | None = None
    itl_ms: float | None = None
    tpot_ms: float | None = None

    def met_by(self, record: RequestRecord) -> bool:
        """Completed with every requested token, and within each given target."""
        if record.status != COMPLETED or record.num_received != record.output_len:
            return False
        if self.ttft_ms is not None and 1000 * record.ttft_s > self.ttft_ms:
            return False
        if self.itl_ms is not None and record.itl_s and 1000 * percentile(record.itl_s, 99) > self.itl_ms:
            return False
        tpot = record.tpot_s
        return self.tpot_ms is None or tpot is None or 1000 * tpot <= self.tpot_ms


def summarize(records: Sequence[RequestRecord], duration_s: float, slo: Slo) -> dict:
    """The run's accounting, latency distributions, throughputs and goodput; sets record.meets_slo."""
    if duration_s <= 0:
        raise ValueError(f"duration_s must be > 0, got {duration_s}")
    by_status = {s: [r for r in records if r.status == s] for s in (COMPLETED, FAILED, CANCELLED, NOT_SENT)}
    done = by_status[COMPLETED]
    errors: dict[str, int] = {}
    for r in by_status[FAILED] + by_status[CANCELLED]:
        errors[r.error] = errors.get(r.error, 0) + 1
    resent: dict[str, int] = {}  # sends that ended before an answer on a reused connection, sent again
    for r in records:
        r.meets_slo = slo.met_by(r)
        for reason in r.resent_after:
            resent[reason] = resent.get(reason, 0) + 1
    num_sent = len(records) - len(by_status[NOT_SENT])
    num_met = sum(r.meets_slo for r in records)
    output_tokens = sum(r.num_received for r in done)
    prompt_tokens = sum(r.prompt_len for r in done)
    return {
        "num_planned": len(records),
        "num_sent": num_sent,
        "num_completed": len(done),
        "num_failed": len(by_status[FAILED]),
        "num_cancelled": len(by_status[CANCELLED]),
        "num_not_sent": len(by_status[NOT_SENT]),
        "errors": dict(sorted(errors.items(), key=lambda kv: -kv[1])),
        "resent": dict(sorted(resent.items())),
        "output_tokens_asked": sum(r.output_len for r in records if r.status != NOT_SENT),
        "output_tokens_received": sum(r.num_received for r in records),
        "num_token_mismatch": sum(r.num_received != r.output_len for r in done),
        "completed_prompt_tokens": prompt_tokens,
        "completed_output_tokens": output_tokens,
        "cached_prompt_tokens": sum(r.cached_prompt_tokens for r in done),
        "duration_s": duration_s,
        "request_throughput": len(done) / duration_s,
        "output_token_throughput": output_tokens / duration_s,
        "total_token_throughput": (prompt_tokens + output_tokens) / duration_s,
        "ttft_ms": describe([r.ttft_s for r in done]),
        "itl_ms": describe([x for r in done for x in r.itl_s]),
        "tpot_ms": describe([r.tpot_s for r in done if r.tpot_s is not None]),
        "e2e_ms": describe([r.e2e_s for r in done]),
        "goodput": {
            "slo_ttft_ms": slo.ttft_ms,
            "slo_itl_ms": slo.itl_ms,
            "slo_tpot_ms": slo.tpot_ms,
            "num_met": num_met,
            "share": num_met / num_sent if num_sent else 0.0,
            "rate": num_met / duration_s,
        },
    }
