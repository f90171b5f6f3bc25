"""Gateway metrics scraped from /metrics after a known batch of requests (exact counts).

Prompt "hello world w20" is 3 tokens, the chat prompt [user "hello w30"] renders to 4 and
token ids [40, 41] are 2; the fakes generate exactly max_tokens tokens (finish "length").
"""

import json
import re

import grpc
import httpx
import pytest

from splitserve.protos import common_pb2, generation_pb2, generation_pb2_grpc
from tests.gateway_fakes import FakeDecode, FakePrefill, Stack, make_tokenizer_dir, parse_metrics

MODEL = "tiny-fake"
GENERATE = "/splitserve.v1.Generation/Generate"


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    return make_tokenizer_dir(str(tmp_path_factory.mktemp("tokenizer")))


@pytest.fixture
def stack(tokenizer_dir):
    stack = Stack(tokenizer_dir, [FakePrefill()], [FakeDecode()]).start()
    yield stack
    stack.stop()


def post(stack, path, body):
    content = body if isinstance(body, bytes) else json.dumps(body)
    return httpx.post(stack.base_url + path, content=content, headers={"content-type": "application/json"}, timeout=10)


def scrape(url):
    r = httpx.get(url, timeout=5)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    return r.text, parse_metrics(r.text)


def grpc_generate(stack, **kwargs):
    stub = generation_pb2_grpc.GenerationStub(grpc.insecure_channel(stack.grpc_target))
    return list(stub.Generate(generation_pb2.GenerateRequest(**kwargs), timeout=10))


def test_counts_tokens_and_latencies_match_the_batch(stack):
    completion = {"model": MODEL, "prompt": "hello world w20", "max_tokens": 5}
    usages = [post(stack, "/v1/completions", completion).json()["usage"] for _ in range(3)]
    usages.append(post(stack, "/v1/completions", {**completion, "max_tokens": 1}).json()["usage"])
    chat = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hello w30"}],
        "max_tokens": 3,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with httpx.stream("POST", stack.base_url + "/v1/chat/completions", json=chat, timeout=10) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    usages.append(events[-1]["usage"])
    for _ in range(2):
        out = grpc_generate(
            stack, token_ids=generation_pb2.TokenIds(ids=[40, 41]), sampling=common_pb2.SamplingParams(max_tokens=4)
        )
        usages.append(
            {"prompt_tokens": out[-1].usage.prompt_tokens, "completion_tokens": sum(len(m.token_ids) for m in out)}
        )
    assert post(stack, "/v1/completions", {**completion, "n": 17}).status_code == 400
    assert post(stack, "/v1/completions", b"{oops").status_code == 400
    assert post(stack, "/v1/completions", {**completion, "model": "gpt-4"}).status_code == 404
    with pytest.raises(grpc.RpcError) as info:
        grpc_generate(stack, text="")
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert httpx.get(stack.base_url + "/v1/models").status_code == 200
    assert httpx.get(stack.base_url + "/health").status_code == 200

    text, m = scrape(stack.base_url + "/metrics")
    assert f'model_name="{MODEL}"' in text and f'instance="gateway@127.0.0.1:{stack.gateway.grpc_port}"' in text
    requests = {
        dict(labels)["route"] + " " + dict(labels)["status"]: value
        for (name, labels), value in m.items()
        if name == "splitserve:gateway_requests_total"
    }
    assert requests == {
        "/v1/completions 200": 4,
        "/v1/completions 400": 2,
        "/v1/completions 404": 1,
        "/v1/chat/completions 200": 1,
        "/v1/models 200": 1,
        "/health 200": 1,
        f"{GENERATE} OK": 2,
        f"{GENERATE} INVALID_ARGUMENT": 1,
    }
    prompt_tokens = sum(u["prompt_tokens"] for u in usages)
    generation_tokens = sum(u["completion_tokens"] for u in usages)
    assert (prompt_tokens, generation_tokens) == (3 * 4 + 4 + 2 * 2, 5 * 3 + 1 + 3 + 4 * 2)
    served = 7
    assert m[("splitserve:gateway_prompt_tokens_total", ())] == prompt_tokens
    assert m[("splitserve:gateway_generation_tokens_total", ())] == generation_tokens
    assert m[("splitserve:gateway_time_to_first_token_seconds_count", ())] == served
    assert m[("splitserve:gateway_e2e_request_latency_seconds_count", ())] == served
    assert (
        m[("splitserve:gateway_request_time_per_output_token_seconds_count", ())] == served - 1
    )  # not the 1-token one
    assert m[("splitserve:gateway_inter_token_latency_seconds_count", ())] == generation_tokens - served
    assert m[("splitserve:gateway_request_success_total", (("finished_reason", "length"),))] == served
    assert m[("splitserve:gateway_request_success_total", (("finished_reason", "stop"),))] == 0  # there from start
    assert m[("splitserve:gateway_num_requests_running", ())] == 0
    # the fake decode steps every 10 ms: 4 decode steps of a 5-token request take >= 30 ms
    assert m[("splitserve:gateway_e2e_request_latency_seconds_sum", ())] >= 3 * 0.03
    assert m[("splitserve:gateway_time_to_first_token_seconds_bucket", (("le", "+Inf"),))] == served


def test_stop_abort_and_error_endings_are_counted_by_reason(tokenizer_dir):
    decode = FakeDecode()
    stack = Stack(tokenizer_dir, [FakePrefill()], [decode]).start()
    try:
        out = grpc_generate(
            stack, text="hello world w20", stop=["w22"], sampling=common_pb2.SamplingParams(max_tokens=9)
        )
        assert [t for msg in out for t in msg.token_ids] == [21, 22]
        body = {"model": MODEL, "prompt": "hello world w20", "max_tokens": 50, "stream": True}
        with httpx.stream("POST", stack.base_url + "/v1/completions", json=body, timeout=10) as r:
            next(line for line in r.iter_lines() if line)  # first token, then the client leaves
        stack.wait_for(lambda: stack.gateway.service.num_active == 0, what="the abandoned request to end")
        decode.hold = True
        stub = generation_pb2_grpc.GenerationStub(grpc.insecure_channel(stack.grpc_target))
        held = stub.Generate(generation_pb2.GenerateRequest(text="w30"), timeout=10)
        next(held)
        stack.loop.run(stack.servers["decode-0"].stop())  # the decode dies mid-request
        last = list(held)[-1]
        assert last.finish_reason == common_pb2.FINISH_REASON_ERROR
        _, m = scrape(stack.base_url + "/metrics")
        reasons = {
            dict(labels)["finished_reason"]: value
            for (name, labels), value in m.items()
            if name == "splitserve:gateway_request_success_total"
        }
        assert reasons == {"stop": 1, "abort": 1, "error": 1, "length": 0}
        assert m[("splitserve:gateway_prompt_tokens_total", ())] == 3 + 3 + 1
        assert m[("splitserve:gateway_e2e_request_latency_seconds_count", ())] == 3
        assert m[("splitserve:gateway_time_to_first_token_seconds_count", ())] == 3
        requests = {
            dict(labels)["route"] + " " + dict(labels)["status"]: value
            for (name, labels), value in m.items()
            if name == "splitserve:gateway_requests_total"
        }
        assert requests == {f"{GENERATE} OK": 2, "/v1/completions 200": 1, "/v1/chat/completions 200": 0}
    finally:
        stack.stop()


def test_metrics_port_when_rest_is_off(tokenizer_dir):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    stack = Stack(tokenizer_dir, [FakePrefill()], [FakeDecode()], {"metrics_port": port}, rest=False).start()
    try:
        assert stack.gateway.http_port == 0 and stack.gateway.metrics_port == port
        out = grpc_generate(stack, text="hello world w20", sampling=common_pb2.SamplingParams(max_tokens=2))
        assert len(out) == 2
        _, m = scrape(f"http://127.0.0.1:{port}/metrics")
        assert m[("splitserve:gateway_requests_total", (("route", GENERATE), ("status", "OK")))] == 1
        assert (
            m[("splitserve:gateway_prompt_tokens_total", ())],
            m[("splitserve:gateway_generation_tokens_total", ())],
        ) == (3, 2)
        assert m[("splitserve:gateway_time_to_first_token_seconds_count", ())] == 1
    finally:
        stack.stop()
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT of the scrape is fine
        s.bind(("127.0.0.1", port))  # no listener left: the metrics server let go of its port on stop


def test_metric_children_follow_a_label_change():
    """Metrics.lab caches each labeled child; the gateway learns its model name after start, and what it
    counts afterwards must carry the new name, not the cached empty one."""
    from prometheus_client import generate_latest

    from splitserve.runtime.metrics import Metrics

    metrics = Metrics(model_name="", instance="gw-test", role="gateway")
    metrics.lab(metrics.gw_requests, route="/ready", status="200").inc()
    metrics.relabel_model("late-model")
    metrics.lab(metrics.gw_requests, route="/ready", status="200").inc()
    metrics.lab(metrics.gw_requests, route="/ready", status="200").inc()
    text = generate_latest(metrics.registry).decode()
    assert 'splitserve:gateway_requests_total{instance="gw-test",model_name="",route="/ready",status="200"} 1.0' in text
    assert (
        'splitserve:gateway_requests_total{instance="gw-test",model_name="late-model",route="/ready",status="200"} 2.0'
        in text
    )
    # the zero series made before the name was known go; the new name's are there from the change
    assert 'splitserve:gateway_num_requests_running{instance="gw-test",model_name=""}' not in text
    assert 'splitserve:gateway_num_requests_running{instance="gw-test",model_name="late-model"} 0.0' in text


def test_model_name_label_is_the_first_served_name(tokenizer_dir):
    """vLLM labels its metrics with its first --served-model-name (the name clients send, that dashboards
    filter on), not the model's id."""
    stack = Stack(tokenizer_dir, [FakePrefill()], [FakeDecode()], {"served_model_name": "alias-a, tiny-fake"}).start()
    try:
        assert post(stack, "/v1/completions", {"model": MODEL, "prompt": "hello", "max_tokens": 2}).status_code == 200
        text, m = scrape(stack.base_url + "/metrics")
        assert m[("splitserve:gateway_request_success_total", (("finished_reason", "length"),))] == 1
        assert set(re.findall(r'model_name="([^"]*)"', text)) == {"alias-a"}
    finally:
        stack.stop()
