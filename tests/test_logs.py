"""Structured logs: JSON lines with the request id lifted into a field."""

import json
import logging

from splitserve.runtime.logs import JsonFormatter


def test_json_lines_carry_level_logger_message_and_request_id():
    record = logging.LogRecord(
        "splitserve.decode.pulls",
        logging.WARNING,
        __file__,
        1,
        "request_id=%s KV pull failed: %s",
        ("req-7", "boom"),
        None,
    )
    line = json.loads(JsonFormatter().format(record))
    assert line["level"] == "WARNING" and line["logger"] == "splitserve.decode.pulls"
    assert line["msg"] == "request_id=req-7 KV pull failed: boom"
    assert line["request_id"] == "req-7"
    assert "trace_id" not in line  # tracing is off in tests unless asked for
    assert line["ts"].endswith("Z")


def test_lines_without_a_request_have_no_request_id():
    record = logging.LogRecord("splitserve.engine", logging.INFO, __file__, 1, "engine ready", (), None)
    assert "request_id" not in json.loads(JsonFormatter().format(record))
