"""The gateway's request log: one line per call with exact fields (fakes behind a real gateway).

"hello world w20" is 3 tokens; the fakes generate exactly max_tokens tokens (finish "length").
"""

import json
import logging
import re

import grpc
import httpx
import pytest

from splitserve.cli import build_configs, parse_args
from splitserve.protos import generation_pb2, generation_pb2_grpc
from splitserve.runtime.logs import JsonFormatter, PlainFormatter
from tests.gateway_fakes import FakeDecode, FakePrefill, Stack, make_tokenizer_dir
from tests.service_harness import wait_until

MODEL = "tiny-fake"
GENERATE = "/splitserve.v1.Generation/Generate"
LINE = re.compile(
    r"request_id=(?P<request_id>\S+) trace_id=(?P<trace_id>\S+) route=(?P<route>\S+) status=(?P<status>\S+) "
    r"prompt_tokens=(?P<prompt_tokens>\d+) generated_tokens=(?P<generated_tokens>\d+) ttft_ms=(?P<ttft_ms>\S+) "
    r"total_ms=(?P<total_ms>\S+) finish_reason=(?P<finish_reason>\S+)$"
)


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    return make_tokenizer_dir(str(tmp_path_factory.mktemp("tokenizer")))


@pytest.fixture
def stack(tokenizer_dir, caplog):
    caplog.set_level(logging.INFO, logger="splitserve.requests")
    stack = Stack(tokenizer_dir, [FakePrefill()], [FakeDecode()]).start()
    yield stack
    stack.stop()


def lines(caplog, n: int) -> list[logging.LogRecord]:
    def found():
        return len([r for r in caplog.records if r.name == "splitserve.requests"]) >= n

    wait_until(found, 5, f"{n} request log lines")
    records = [r for r in caplog.records if r.name == "splitserve.requests"]
    assert len(records) == n
    return records


def fields(record: logging.LogRecord) -> dict[str, str]:
    match = LINE.match(record.getMessage())
    assert match, record.getMessage()
    return match.groupdict()


def test_a_completion_and_a_refusal_each_get_one_line(stack, caplog):
    body = {"model": MODEL, "prompt": "hello world w20", "max_tokens": 4}
    answer = httpx.post(stack.base_url + "/v1/completions", json=body, timeout=10).json()
    assert httpx.post(stack.base_url + "/v1/completions", json={**body, "n": 17}, timeout=10).status_code == 400
    assert httpx.get(stack.base_url + "/health", timeout=10).status_code == 200  # a GET: no line
    served, refused = (fields(r) for r in lines(caplog, 2))
    ttft, total = float(served.pop("ttft_ms")), float(served.pop("total_ms"))
    assert 0 < ttft <= total
    assert served == {
        "request_id": answer["id"],
        "trace_id": "-",
        "route": "/v1/completions",
        "status": "200",
        "prompt_tokens": "3",
        "generated_tokens": "4",
        "finish_reason": "length",
    }
    assert refused["route"] == "/v1/completions" and refused["status"] == "400"
    assert (refused["prompt_tokens"], refused["generated_tokens"], refused["ttft_ms"]) == ("0", "0", "-")
    assert refused["request_id"].startswith("cmpl-") and refused["finish_reason"] == "-"


def test_a_batch_with_n_is_one_line_with_every_token(stack, caplog):
    body = {"model": MODEL, "prompt": ["hello world w20", "w30"], "max_tokens": 2, "n": 2, "stream": True}
    with httpx.stream("POST", stack.base_url + "/v1/completions", json=body, timeout=10) as r:
        assert r.status_code == 200
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    first_id = events[0]["id"]
    (line,) = (fields(r) for r in lines(caplog, 1))
    assert (line["request_id"], line["status"]) == (first_id, "200")
    assert (line["prompt_tokens"], line["generated_tokens"], line["finish_reason"]) == ("4", "8", "length")


def test_grpc_generate_with_a_hostile_request_id_is_one_escaped_line(stack, caplog):
    stub = generation_pb2_grpc.GenerationStub(grpc.insecure_channel(stack.grpc_target))
    request = generation_pb2.GenerateRequest(request_id="evil\nstatus=200", text="hello world w20")
    request.sampling.max_tokens = 2
    assert sum(len(m.token_ids) for m in stub.Generate(request, timeout=10)) == 2
    (record,) = lines(caplog, 1)
    plain = PlainFormatter("%(message)s").format(record)
    assert plain.startswith("request_id=evil\\nstatus=200 trace_id=- route=" + GENERATE + " status=OK prompt_tokens=3 ")
    assert "\n" not in plain
    line = json.loads(JsonFormatter().format(record))
    assert {k: line[k] for k in ("request_id", "trace_id", "route", "status", "prompt_tokens", "finish_reason")} == {
        "request_id": "evil\nstatus=200",  # JSON escapes it: one line, the value intact
        "trace_id": None,
        "route": GENERATE,
        "status": "OK",
        "prompt_tokens": 3,
        "finish_reason": "length",
    }
    assert line["generated_tokens"] == 2 and 0 < line["ttft_ms"] <= line["total_ms"]
    assert "\n" not in JsonFormatter().format(record)


def test_off_writes_nothing(tokenizer_dir, caplog):
    caplog.set_level(logging.INFO, logger="splitserve.requests")
    stack = Stack(tokenizer_dir, [FakePrefill()], [FakeDecode()], {"enable_log_requests": False}).start()
    try:
        body = {"model": MODEL, "prompt": "hello world w20", "max_tokens": 2}
        assert httpx.post(stack.base_url + "/v1/completions", json=body, timeout=10).status_code == 200
    finally:
        stack.stop()  # the call has ended everywhere once the gateway stopped
    assert not [r for r in caplog.records if r.name == "splitserve.requests"]


@pytest.mark.parametrize(
    "flags, enabled",
    [([], True), (["--disable-log-requests"], False), (["--no-enable-log-requests"], False)],
)
def test_the_flags_as_vllm_names_them(flags, enabled):
    command, loaded, ns = parse_args(["gateway", *flags])
    assert build_configs(loaded, ns)["GatewayConfig"].enable_log_requests is enabled
