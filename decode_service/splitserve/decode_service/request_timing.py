"""The decode's request metrics: each sequence's times and counts as its tokens come, and each request's facts
recorded once, when the last of its sequences ends (n sequences are one request).

    start (admitted) ──▶ observe (every step's output: TTFT when prefilled here, ITL, at the end decode time,
                         TPOT) ──▶ the last sequence ended (or failed) ──▶ Metrics.request_done
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from splitserve.runtime.metrics import RequestEnd


@dataclass
class RequestTiming:
    """What a request's sequences share for its metrics: recorded once, when the last of them ends."""

    arrival_s: float  # time.monotonic()
    num_prompt_tokens: int
    n: int
    max_tokens: int | None
    num_open: int  # its sequences still running
    num_tokens: int = 0  # generated, over every sequence that ended
    queue_s: float = 0.0  # waiting before the first compute (prefilled here only)
    finish_reason: str = ""  # the lead sequence's


@dataclass
class SequenceTiming:
    """One sequence's times (time.monotonic() seconds) and counts, for its metrics."""

    request: RequestTiming
    lead: bool  # the request's own id (not a fork)
    prefills_here: bool  # the lead of a request without a KV handle: the prompt runs on this engine
    first_s: float = 0.0  # its first token (for an imported request: the prefill's, arriving here)
    last_s: float = 0.0
    num_tokens: int = 0


class RequestTimes:
    """The times and counts of every sequence in flight here, by request id and fork id. `metrics` (the
    service's `Metrics`, built once the core reports the model id) is passed to the calls that record."""

    def __init__(self) -> None:
        self._timing: dict[str, SequenceTiming] = {}

    def start(
        self, request_id: str, fork_ids: list[str], num_prompt_tokens: int, max_tokens: int | None, imported: bool
    ) -> None:
        """A request was admitted: its lead `request_id` and its other sequences (`fork_ids`). `imported`: its
        prompt was prefilled elsewhere, and the prefill's first token counts as this lead's first."""
        now, n = time.monotonic(), 1 + len(fork_ids)
        request = RequestTiming(now, num_prompt_tokens, n, max_tokens, n)
        for sequence_id in (request_id, *fork_ids):
            lead = sequence_id == request_id
            self._timing[sequence_id] = SequenceTiming(request, lead, not imported and lead)
        if imported:
            lead_timing = self._timing[request_id]
            lead_timing.first_s = lead_timing.last_s = now
            lead_timing.num_tokens = 1

    def observe(self, out: Any, metrics: Any) -> None:
        """The metrics of a sequence's new tokens; at its end, the request's (once, on the lead sequence)."""
        mt, now = metrics, time.monotonic()
        t = self._timing.get(out.request_id)
        if t is None:
            return
        if out.new_token_ids:
            if t.num_tokens == 0:
                t.first_s = now
                if t.prefills_here:  # the prompt ran here: its facts are this decode's
                    r = t.request
                    r.queue_s = out.queue_ns / 1e9
                    ttft_s = now - r.arrival_s
                    mt.prompt_done(r.num_prompt_tokens, r.queue_s, max(ttft_s - r.queue_s, 0.0), ttft_s)
            else:
                mt.lab(mt.itl).observe(now - t.last_s)
            t.last_s = now
            t.num_tokens += len(out.new_token_ids)
        if out.finished:
            if t.first_s:
                mt.lab(mt.decode_time).observe(now - t.first_s)
            if t.num_tokens > 1:
                mt.lab(mt.tpot).observe((t.last_s - t.first_s) / (t.num_tokens - 1))
            _request_done(t, out.finish_reason, now, metrics)

    def failed(self, request_id: str, metrics: Any) -> None:
        """A sequence ended with an error (recorded only once metrics exist)."""
        t = self._timing.get(request_id)
        if t is not None and metrics is not None:
            _request_done(t, "error", time.monotonic(), metrics)

    def pop(self, request_id: str) -> None:
        """The sequence left this decode."""
        self._timing.pop(request_id, None)


def _request_done(t: SequenceTiming, finish_reason: str, now: float, metrics: Any) -> None:
    """A sequence ended; the request's facts once its last sequence has (n sequences are one request)."""
    r = t.request
    r.num_open -= 1
    r.num_tokens += t.num_tokens
    if t.lead:
        r.finish_reason = finish_reason
    if r.num_open == 0:
        e2e_s = now - r.arrival_s
        end = RequestEnd(r.finish_reason or finish_reason, r.num_tokens, e2e_s, e2e_s - r.queue_s, r.n, r.max_tokens)
        metrics.request_done(end)
