"""One log line per request at the gateway, on by default (`--no-enable-log-requests` or vLLM's
`--disable-log-requests` turn it off):

    request_id=cmpl-1f.. trace_id=4bf9.. route=/v1/completions status=200 prompt_tokens=5 generated_tokens=16
    ttft_ms=41.2 total_ms=380.5 finish_reason=length

The protocol layer (REST middleware, gRPC wrapper) opens a `RequestRecord` for the call, the request path
(`GatewayService.generate`) fills it, and the protocol layer writes the line once the call is answered, with
the route and the status it was answered with: refusals get their line too, with no tokens. A call of
several prompts (a batch) or sequences (n) is one line: tokens summed, the first token's time, the request
id of the first prompt, each distinct finish reason in order (`stop,length`). With JSON logs
(SPLITSERVE_LOG_FORMAT=json) the fields are the line's own JSON fields; values a client chose (the request
id) are escaped as every logged value is (runtime/logs.py).
"""

from __future__ import annotations

import logging
from contextvars import ContextVar
from dataclasses import dataclass, field

log = logging.getLogger("splitserve.requests")
FIELDS = (
    "request_id",
    "trace_id",
    "route",
    "status",
    "prompt_tokens",
    "generated_tokens",
    "ttft_ms",
    "total_ms",
    "finish_reason",
)


@dataclass
class RequestRecord:
    """What one call's request log line says; filled while the call runs (times in ms)."""

    request_id: str = ""
    trace_id: str = ""
    prompt_tokens: int = 0
    generated_tokens: int = 0
    ttft_ms: float | None = None
    finish_reasons: list[str] = field(default_factory=list)

    def add_request(self, request_id: str, num_prompt_tokens: int) -> None:
        """A prompt of this call was admitted (the first names the line)."""
        self.request_id = self.request_id or request_id
        self.prompt_tokens += num_prompt_tokens

    def add_tokens(self, num_tokens: int, since_arrival_ms: float) -> None:
        if num_tokens and self.ttft_ms is None:
            self.ttft_ms = since_arrival_ms
        self.generated_tokens += num_tokens

    def add_finish(self, reason: str) -> None:
        if reason and reason not in self.finish_reasons:
            self.finish_reasons.append(reason)


_current: ContextVar[RequestRecord | None] = ContextVar("splitserve_request_record", default=None)


def current() -> RequestRecord | None:
    """The record of the call this task serves, if its protocol layer opened one."""
    return _current.get()


class RequestLog:
    """Opens a record per call and writes its line when the call ends; `enabled` False writes nothing."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled

    def open(self) -> RequestRecord | None:
        """A new record, current for this task and the tasks it starts (None when off)."""
        if not self.enabled:
            return None
        record = RequestRecord()
        _current.set(record)
        return record

    def write(self, record: RequestRecord | None, route: str, status: str | int, total_ms: float) -> None:
        if record is None:
            return
        fields = {  # JSON logs carry these as they are (null where unknown)
            "request_id": record.request_id or None,
            "trace_id": record.trace_id or None,
            "route": route,
            "status": str(status),
            "prompt_tokens": record.prompt_tokens,
            "generated_tokens": record.generated_tokens,
            "ttft_ms": None if record.ttft_ms is None else round(record.ttft_ms, 1),
            "total_ms": round(total_ms, 1),
            "finish_reason": ",".join(record.finish_reasons) or None,
        }
        shown = ["-" if value is None else value for value in fields.values()]
        log.info(" ".join(f"{name}=%s" for name in FIELDS), *shown, extra={"fields": fields})
