"""vLLM's token endpoints (REST /tokenize, /detokenize, /version; gRPC Tokenize, Detokenize), their
limits, and large inputs that never stall the gateway's event loop."""

from __future__ import annotations

import threading
import time

import grpc
import httpx
import pytest

from splitserve.protos import common_pb2, generation_pb2, generation_pb2_grpc
from tests.gateway_fakes import VOCAB_SIZE, FakeDecode, FakePrefill, Stack, make_tokenizer_dir
from tests.service_harness import wait_until

MODEL = "tiny"


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    return make_tokenizer_dir(str(tmp_path_factory.mktemp("tokenizer")))


@pytest.fixture()
def stack(tokenizer_dir):
    s = Stack(tokenizer_dir, [FakePrefill()], [FakeDecode(step_s=0.02)], overrides={"model_id": MODEL}).start()
    wait_until(lambda: httpx.get(s.base_url + "/health").status_code == 200, 5, "the fake stack never served")
    yield s
    s.stop()


def test_tokenize_and_detokenize_over_rest(stack):
    r = httpx.post(
        stack.base_url + "/tokenize", json={"model": MODEL, "prompt": "w20 w21 w22", "return_token_strs": True}
    )
    assert r.json() == {"count": 3, "max_model_len": 64, "tokens": [20, 21, 22], "token_strs": ["w20", "w21", "w22"]}
    chat = httpx.post(stack.base_url + "/tokenize", json={"messages": [{"role": "user", "content": "w40"}]}).json()
    assert chat["tokens"] == stack.gateway.service.tokenizer.encode(
        stack.gateway.service.tokenizer.apply_chat_template([{"role": "user", "content": "w40"}]), False
    )
    assert httpx.post(stack.base_url + "/detokenize", json={"tokens": [20, 21, 22]}).json() == {"prompt": "w20 w21 w22"}
    assert httpx.get(stack.base_url + "/version").json()["version"] != "unknown"


@pytest.mark.parametrize(
    "path, body, param, message",
    [
        (
            "/detokenize",
            {"tokens": [1, VOCAB_SIZE]},
            "tokens",
            f"tokens must hold token ids 0..{VOCAB_SIZE - 1} (the vocabulary), got {VOCAB_SIZE}",
        ),
        ("/detokenize", {"tokens": "w20"}, "tokens", "tokens must be a list of token ids"),
        ("/tokenize", {"prompt": 5}, "prompt", "prompt must be a string, got int"),
        (
            "/tokenize",
            {"prompt": "w1", "add_special_tokens": "yes"},
            "add_special_tokens",
            "add_special_tokens must be true or false, got 'yes'",
        ),
        (
            "/tokenize",
            {"prompt": "w1", "model": "other"},
            "model",
            "model 'other' is not served here; this gateway serves 'tiny'",
        ),
        (
            "/tokenize",
            {"prompt": "w1", "bogus": 1},
            "bogus",
            "unknown field 'bogus'; /tokenize takes add_generation_prompt, add_special_tokens, messages, model, "
            "prompt, return_token_strs",
        ),
    ],
)
def test_bad_token_requests_name_the_field(stack, path, body, param, message):
    r = httpx.post(stack.base_url + path, json=body)
    assert r.status_code in (400, 404)
    assert r.json()["error"]["param"] == param
    assert r.json()["error"]["message"] == message


def test_grpc_tokenize_and_detokenize(stack):
    stub = generation_pb2_grpc.GenerationStub(grpc.insecure_channel(stack.grpc_target))
    ids = stub.Tokenize(generation_pb2.TokenizeRequest(text="w30 w31"), timeout=5)
    assert list(ids.token_ids) == [30, 31] and ids.max_model_len == 64
    assert stub.Detokenize(generation_pb2.DetokenizeRequest(token_ids=[30, 31]), timeout=5).text == "w30 w31"
    with pytest.raises(grpc.RpcError) as info:
        stub.Detokenize(generation_pb2.DetokenizeRequest(token_ids=[VOCAB_SIZE + 5]), timeout=5)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (
        info.value.details()
        == f"token_ids must hold token ids 0..{VOCAB_SIZE - 1} (the vocabulary), got {VOCAB_SIZE + 5}"
    )


def test_tokenize_counts_against_the_request_rate_limit(tokenizer_dir):
    s = Stack(
        tokenizer_dir, [FakePrefill()], [FakeDecode()], overrides={"rate_limit_rps": 1.0, "rate_limit_burst": 2}
    ).start()
    try:
        codes = [httpx.post(s.base_url + "/tokenize", json={"prompt": "w1"}).status_code for _ in range(3)]
        assert codes == [200, 200, 429]
        stub = generation_pb2_grpc.GenerationStub(grpc.insecure_channel(s.grpc_target))
        with pytest.raises(grpc.RpcError) as info:
            stub.Tokenize(generation_pb2.TokenizeRequest(text="w1"), timeout=5)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    finally:
        s.stop()


def test_a_grpc_message_over_the_body_limit_is_refused_before_tokenizing(stack):
    stub = generation_pb2_grpc.GenerationStub(grpc.insecure_channel(stack.grpc_target))
    with pytest.raises(grpc.RpcError) as info:
        stub.Tokenize(generation_pb2.TokenizeRequest(text="w1 " * (7 << 20)), timeout=30)  # 21 MB
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_a_large_text_does_not_stall_a_running_stream_or_health(stack):
    """A ~1 MB prompt (the body limit) is tokenized off the event loop: a stream running meanwhile
    keeps its pace and /health answers."""
    stub = generation_pb2_grpc.GenerationStub(grpc.insecure_channel(stack.grpc_target))
    request = generation_pb2.GenerateRequest(text="w20", sampling=common_pb2.SamplingParams(max_tokens=40))
    arrivals: list[float] = []
    stream = stub.Generate(request, timeout=30)
    first = next(stream)
    arrivals.append(time.monotonic())

    def read():
        for message in stream:
            arrivals.extend([time.monotonic()] * max(1, len(message.token_ids)))

    reader = threading.Thread(target=read)
    reader.start()
    big = "w20 " * 240_000  # 960,000 characters
    worker = threading.Thread(target=lambda: stub.Tokenize(generation_pb2.TokenizeRequest(text=big), timeout=60))
    started = time.monotonic()
    worker.start()
    health_s = []
    while worker.is_alive():
        t = time.monotonic()
        assert httpx.get(stack.base_url + "/health", timeout=5).status_code == 200
        health_s.append(time.monotonic() - t)
    worker.join()
    reader.join()
    took = time.monotonic() - started
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:])]
    assert first.token_ids and len(arrivals) >= 40
    assert took > 0.2, "the tokenization was too quick to show anything"
    assert max(health_s) < 0.25, health_s
    assert max(gaps) < 0.25, gaps
