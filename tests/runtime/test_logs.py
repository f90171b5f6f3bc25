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


def test_plain_lines_escape_control_characters_a_client_sent():
    """A request_id holding a newline cannot forge a second log line."""
    import io
    import logging

    from splitserve.runtime.logs import PLAIN_FORMAT, PlainFormatter

    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(PlainFormatter(PLAIN_FORMAT))
    logger = logging.getLogger("test.escape")
    logger.addHandler(handler)
    try:
        logger.warning("request_id=%s failed", "r1\n2026-12-01 00:00:00 INFO forged: admin logged in\x1b[2J")
        try:
            raise ValueError("boom")
        except ValueError:
            logger.exception("request_id=%s crashed", "r2")
    finally:
        logger.removeHandler(handler)
    lines = stream.getvalue().splitlines()
    assert lines[0].endswith(r"request_id=r1\n2026-12-01 00:00:00 INFO forged: admin logged in\x1b[2J failed")
    assert lines[1].endswith("request_id=r2 crashed") and lines[2] == "Traceback (most recent call last):"
