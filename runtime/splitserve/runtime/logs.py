"""Process logging: one line per event, plain or JSON (`SPLITSERVE_LOG_FORMAT=json`).

Log calls name the request as `request_id=<id>`; the JSON formatter lifts it into its own
field, and adds the current trace id when tracing is on, so log lines join traces.
"""

from __future__ import annotations

import json
import logging
import os
import re
import time

_REQUEST_ID = re.compile(r"request_id=(\S+)")
PLAIN_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


# control characters a client could put in a logged value (a request_id with "\n" forged log lines)
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def escape_controls(text: str) -> str:
    """`text` with every control character written as an escape (\n, \x1b, ...): one event, one line."""
    return _CONTROL.sub(lambda m: m.group().encode("unicode_escape").decode("ascii"), text)


class PlainFormatter(logging.Formatter):
    """PLAIN_FORMAT, with control characters in the message escaped; a traceback keeps its lines."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        record.message = escape_controls(record.message)
        return super().formatMessage(record)


class JsonFormatter(logging.Formatter):
    """{"ts", "level", "logger", "msg", "request_id"?, "trace_id"?, "exc"?} per line, and a record's own
    `fields` (logged with extra={"fields": {...}}) as fields of the line."""

    def format(self, record: logging.LogRecord) -> str:
        message = record.getMessage()
        line = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "msg": message,
        }
        match = _REQUEST_ID.search(message)
        if match:
            line["request_id"] = match.group(1)
        trace_id = _current_trace_id()
        if trace_id:
            line["trace_id"] = trace_id
        for key, value in (getattr(record, "fields", None) or {}).items():
            if value is not None or key not in line:  # an unknown field never hides what the formatter found
                line[key] = value
        if record.exc_info:
            line["exc"] = self.formatException(record.exc_info)
        return json.dumps(line, ensure_ascii=False)


def _current_trace_id() -> str | None:
    from splitserve.runtime import tracing

    if not tracing.enabled():
        return None
    from opentelemetry import trace

    context = trace.get_current_span().get_span_context()
    return f"{context.trace_id:032x}" if context.is_valid else None


def setup_logging() -> None:
    """Configure the root logger from SPLITSERVE_LOG_LEVEL and SPLITSERVE_LOG_FORMAT (plain|json)."""
    handler = logging.StreamHandler()
    json_format = os.environ.get("SPLITSERVE_LOG_FORMAT", "plain").lower() == "json"
    handler.setFormatter(JsonFormatter() if json_format else PlainFormatter(PLAIN_FORMAT))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(os.environ.get("SPLITSERVE_LOG_LEVEL", "INFO").upper())
