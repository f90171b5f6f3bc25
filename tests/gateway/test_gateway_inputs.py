"""Every bad-input class gets a precise error naming the field, and the gateway keeps serving.

Complements the 400 tables of test_gateway_rest.py / test_gateway_api.py with the classes
they do not cover: max_tokens beyond the context, unsupported OpenAI parameters, values the
wire cannot carry, nesting and lone surrogates in JSON, unknown paths and methods, malformed
gRPC messages. The fakes' context (max_model_len) is 64 tokens; "hello world w20" is 3 tokens.
"""

import json
import time

import grpc
import httpx
import pytest

from splitserve.protos import common_pb2, generation_pb2, generation_pb2_grpc
from tests.gateway_fakes import FakeDecode, FakePrefill, Stack, make_tokenizer_dir
from tests.service_harness import wait_until

MODEL = "tiny-fake"
MAX_BODY = 4096
PROMPT = {"model": MODEL, "prompt": "hello world w20"}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hello w30"}]}  # 4 prompt tokens
GENERATE = "/splitserve.v1.Generation/Generate"


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    return make_tokenizer_dir(str(tmp_path_factory.mktemp("tokenizer")))


@pytest.fixture(scope="module")
def stack(tokenizer_dir):
    stack = Stack(tokenizer_dir, [FakePrefill()], [FakeDecode(step_s=0.002)], {"max_body_bytes": MAX_BODY}).start()
    yield stack
    assert_still_serving(stack)
    stack.stop()


JSON = {"content-type": "application/json"}


def post(stack, path, body):
    content = body if isinstance(body, bytes) else json.dumps(body)
    return httpx.post(stack.base_url + path, content=content, headers=JSON, timeout=10)


def assert_still_serving(stack):
    r = post(stack, "/v1/completions", {**PROMPT, "max_tokens": 2})
    assert (r.status_code, r.json()["choices"][0]["text"]) == (200, " w21 w22")


def error(message, param, code=None):
    return {"error": {"message": message, "type": "invalid_request_error", "param": param, "code": code}}


def context_message(param, value, prompt_tokens):
    return (
        f"{param} is {value}, but the prompt has {prompt_tokens} tokens and the model's context limit "
        f"(max_model_len) is 64 tokens: {param} must be at most {64 - prompt_tokens}"
    )


REST_CASES = [
    # missing fields
    ("/v1/completions", {"model": MODEL}, 400, error("prompt is required", "prompt")),
    (
        "/v1/chat/completions",
        {"model": MODEL},
        400,
        error("messages must be a non-empty list of {role, content} objects", "messages"),
    ),
    # wrong types
    (
        "/v1/completions",
        {**PROMPT, "max_tokens": "5"},
        400,
        error("max_tokens must be an integer, got '5'", "max_tokens"),
    ),
    (
        "/v1/completions",
        {**PROMPT, "prompt": {"text": "hi"}},
        400,
        error("prompt must be a string or a list of token ids, got dict", "prompt"),
    ),
    ("/v1/completions", {**PROMPT, "model": 7}, 400, error("model must be a string, got 7", "model")),
    ("/v1/chat/completions", {**CHAT, "logprobs": 1}, 400, error("logprobs must be a boolean, got 1", "logprobs")),
    # max_tokens beyond the context (vLLM refuses these too)
    ("/v1/completions", {**PROMPT, "max_tokens": 62}, 400, error(context_message("max_tokens", 62, 3), "max_tokens")),
    (
        "/v1/chat/completions",
        {**CHAT, "max_completion_tokens": 61},
        400,
        error(context_message("max_completion_tokens", 61, 4), "max_completion_tokens"),
    ),
    (
        "/v1/chat/completions",
        {**CHAT, "max_tokens": 100},
        400,
        error(context_message("max_tokens", 100, 4), "max_tokens"),
    ),
    # unsupported OpenAI parameters are named (their neutral values are accepted: see below)
    (
        "/v1/completions",
        {**PROMPT, "suffix": "}"},
        400,
        error(
            "unsupported parameter: suffix (got '}'); splitserve does not implement it, remove it from the request",
            "suffix",
        ),
    ),
    # vLLM's prompt_logprobs: 0..20, and (as vLLM) not streamed
    (
        "/v1/completions",
        {**PROMPT, "prompt_logprobs": 21},
        400,
        error("prompt_logprobs must be >= 0 and <= 20, got 21", "prompt_logprobs"),
    ),
    (
        "/v1/completions",
        {**PROMPT, "prompt_logprobs": 2, "stream": True},
        400,
        error("prompt_logprobs is 2: above 0 it is not available when stream is true", "prompt_logprobs"),
    ),
    (
        "/v1/chat/completions",
        {**CHAT, "tools": [{"type": "function"}]},
        400,
        error("tools[0].function.name must be a non-empty string", "tools"),
    ),
    (
        "/v1/chat/completions",
        {**CHAT, "functions": [{"name": "f"}]},
        400,
        error(
            "unsupported parameter: functions (got [{'name': 'f'}]); splitserve does not implement it, remove it "
            "from the request",
            "functions",
        ),
    ),
    (
        "/v1/chat/completions",
        {**CHAT, "response_format": {"type": "json_schema"}},
        400,
        error(
            'response_format.json_schema must be an object with "name" and "schema" when type is json_schema',
            "response_format",
        ),
    ),
    # out-of-range values, including those only the wire's types cannot carry
    (
        "/v1/completions",
        {**PROMPT, "top_p": 1e-50},
        400,
        error(
            "top_p must be > 0 and <= 1, got 0.0 (the request's value rounded to float32, as it is sent on)", "top_p"
        ),
    ),
    (
        "/v1/completions",
        {**PROMPT, "temperature": 10**400},
        400,
        error("temperature must be a number within its range, got an integer of 401 digits", "temperature"),
    ),
    (
        "/v1/completions",
        {**PROMPT, "top_k": 2**31},
        400,
        error("top_k must be -1, 0 (off) or at most 2147483647, got 2147483648", "top_k"),
    ),
    (
        "/v1/completions",
        {**PROMPT, "stop_token_ids": [3, 200]},
        400,
        error("stop_token_ids must be token ids below the vocabulary size 200, got 200", "stop_token_ids"),
    ),
    (
        "/v1/completions",
        {**PROMPT, "frequency_penalty": float("nan")},
        400,
        error("frequency_penalty must be >= -2 and <= 2, got nan", "frequency_penalty"),
    ),
    (
        "/v1/completions",
        {**PROMPT, "stop": ["x" * 257]},
        400,
        error("stop strings must be at most 256 characters, got one of 257", "stop"),
    ),
    # unknown model
    (
        "/v1/chat/completions",
        {**CHAT, "model": "llama"},
        404,
        error("model 'llama' is not served here; this gateway serves 'tiny-fake'", "model", "model_not_found"),
    ),
]


@pytest.mark.parametrize(
    "path,body,status,answer", REST_CASES, ids=[f"{c[3]['error']['param']}-{i}" for i, c in enumerate(REST_CASES)]
)
def test_rest_bad_input_is_refused_naming_the_field(stack, path, body, status, answer):
    r = post(stack, path, body)
    assert (r.status_code, r.json()) == (status, answer)


def test_max_tokens_up_to_the_context_is_served(stack):
    r = post(stack, "/v1/completions", {**PROMPT, "max_tokens": 61})
    assert (r.status_code, r.json()["usage"]["completion_tokens"]) == (200, 61)


def test_default_max_tokens_is_cut_to_the_context(stack):
    prompt = " ".join(["w9"] * 60)  # 60 tokens: 4 fit in the context of 64, fewer than the default 16
    r = post(stack, "/v1/completions", {"model": MODEL, "prompt": prompt})
    assert (r.status_code, r.json()["usage"]["completion_tokens"], r.json()["choices"][0]["finish_reason"]) == (
        200,
        4,
        "length",
    )
    r = post(stack, "/v1/completions", {"model": MODEL, "prompt": prompt, "min_tokens": 5})
    assert (r.status_code, r.json()) == (
        400,
        error(
            "min_tokens is 5, but the prompt has 60 tokens and the model's context limit (max_model_len) is 64 tokens: "
            "at most 4 tokens can be generated",
            "min_tokens",
        ),
    )


def test_neutral_values_of_unsupported_parameters_are_accepted(stack):
    r = post(
        stack,
        "/v1/completions",
        {**PROMPT, "max_tokens": 2, "best_of": 1, "echo": False, "suffix": None, "logit_bias": {}, "store": False},
    )
    assert (r.status_code, r.json()["choices"][0]["text"]) == (200, " w21 w22")
    r = post(
        stack,
        "/v1/chat/completions",
        {
            **CHAT,
            "max_tokens": 1,
            "tools": [],
            "tool_choice": "none",
            "response_format": {"type": "text"},
            "parallel_tool_calls": True,
        },
    )
    assert (r.status_code, r.json()["choices"][0]["message"]["content"]) == (200, " hello")


RAW_CASES = [
    (
        b'{"prompt": "a\\ud800b"}',
        error(
            "prompt contains a lone UTF-16 surrogate (\\ud800 at character 1); strings must be valid Unicode", "prompt"
        ),
    ),
    (
        b'{"model": "tiny-fake", "messages": [{"role": "user", "content": "\\udfff"}]}',
        error(
            "messages contains a lone UTF-16 surrogate (\\udfff at character 0); strings must be valid Unicode",
            "messages",
        ),
    ),
    (
        b'{"prompt": "hi", "\\ud83d": 1}',
        error(
            "body has a key that contains a lone UTF-16 surrogate (\\ud83d at character 0); strings must be valid "
            "Unicode",
            "body",
        ),
    ),
    (
        b'{"prompt": "hi", "": {"\\ud800": 1}}',  # a field without a name: the error names the body
        error(
            "body has a key that contains a lone UTF-16 surrogate (\\ud800 at character 0); strings must be valid "
            "Unicode",
            "body",
        ),
    ),
    (
        b'{"prompt": ' + b"[" * 40 + b"]" * 40 + b"}",
        error("prompt nests deeper than 32 levels; the request body may have at most 32", "prompt"),
    ),
    (b"[" * 3000, error("request body nests deeper than 32 levels; the request body may have at most 32", "body")),
    (
        b'{"prompt": "\xff"}',
        error(
            "request body is not valid UTF-8: 'utf-8' codec can't decode byte 0xff in position 12: invalid start byte",
            "body",
        ),
    ),
    (b"", error("request body is not valid JSON: Expecting value: line 1 column 1 (char 0)", "body")),
    (
        b'{"prompt": "hi",}',
        error(
            "request body is not valid JSON: Expecting property name enclosed in double quotes: line 1 column 17 "
            "(char 16)",
            "body",
        ),
    ),
    (b"null", error("request body must be a JSON object, got NoneType", "body")),
    (b'"hello"', error("request body must be a JSON object, got str", "body")),
]


@pytest.mark.parametrize("raw,answer", RAW_CASES, ids=[f"raw-{i}" for i in range(len(RAW_CASES))])
def test_rest_malformed_bodies(stack, raw, answer):
    r = post(stack, "/v1/completions", raw)
    assert (r.status_code, r.json()) == (400, answer)


def test_unknown_paths_and_methods_answer_in_openai_shape(stack):
    r = httpx.get(stack.base_url + "/v1/completions")
    assert (r.status_code, r.json()) == (405, error("Method Not Allowed: GET /v1/completions", None))
    r = httpx.post(stack.base_url + "/v1/embeddings", json={})
    assert (r.status_code, r.json()) == (404, error("Not Found: POST /v1/embeddings", None))


def test_oversize_body_without_content_length_is_cut_at_the_limit(stack):
    def chunks():
        for _ in range(10):
            yield b" " * 1000

    r = httpx.post(stack.base_url + "/v1/completions", content=chunks(), headers=JSON, timeout=10)
    assert "content-length" not in r.request.headers  # chunked: only counting the bytes can stop it
    assert (r.status_code, r.json()["error"]["code"]) == (413, "request_too_large")
    message = r.json()["error"]["message"]
    seen = int(message.split("(got at least ")[1].split(")")[0])  # however the server grouped the chunks
    assert MAX_BODY < seen <= 10_000 and message == (
        f"request body has more than {MAX_BODY} bytes (got at least {seen}); the limit is max_body_bytes={MAX_BODY}"
    )


def _stub(stack):
    return generation_pb2_grpc.GenerationStub(grpc.insecure_channel(stack.grpc_target))


def _refusal(call):
    with pytest.raises(grpc.RpcError) as info:
        list(call())
    return info.value.code(), info.value.details()


GRPC_CASES = [
    (
        dict(text="hello world w20", sampling=common_pb2.SamplingParams(max_tokens=62)),
        context_message("max_tokens", 62, 3),
    ),
    (
        dict(text="hello world w20", sampling=common_pb2.SamplingParams(max_tokens=4_000_000_000)),
        context_message("max_tokens", 4_000_000_000, 3),
    ),
    (
        dict(text=" ".join(["w9"] * 70)),
        "prompt has 70 tokens, but the model's context limit (max_model_len) is 64 "
        "tokens, which must also hold at least one generated token",
    ),
    (dict(text="hi", sampling=common_pb2.SamplingParams(top_p=float("inf"))), "top_p must be > 0 and <= 1, got inf"),
    (
        dict(text="hi", sampling=common_pb2.SamplingParams(stop_token_ids=[7, 4_000_000])),
        "stop_token_ids must be token ids below the vocabulary size 200, got 4000000",
    ),
    (dict(text="hi", request_id="r" * 300), "request_id must be at most 256 characters, got 300"),
    (dict(text="hi", stop=[""]), "stop strings must be non-empty strings, got ''"),
]


@pytest.mark.parametrize(
    "kwargs,message", GRPC_CASES, ids=[c[1].split(" ")[0] + str(i) for i, c in enumerate(GRPC_CASES)]
)
def test_grpc_bad_input_is_invalid_argument(stack, kwargs, message):
    request = generation_pb2.GenerateRequest(**kwargs)
    assert _refusal(lambda: _stub(stack).Generate(request, timeout=5)) == (grpc.StatusCode.INVALID_ARGUMENT, message)


@pytest.mark.parametrize(
    "raw,detail", [(b"\xff\xff", "Wire format was corrupt"), (b"\x1a\x02\xff\xfe", "String field had bad UTF-8")]
)
def test_grpc_malformed_message_is_invalid_argument_not_internal(stack, raw, detail):
    channel = grpc.insecure_channel(stack.grpc_target)
    call = channel.unary_stream(GENERATE, request_serializer=None, response_deserializer=None)
    assert _refusal(lambda: call(raw, timeout=5)) == (
        grpc.StatusCode.INVALID_ARGUMENT,
        f"request is not a valid splitserve.v1.GenerateRequest: Error parsing message with type "
        f"'splitserve.v1.GenerateRequest': {detail}",
    )


def test_a_long_echoed_value_is_cut_in_the_grpc_status(stack):
    code, details = _refusal(
        lambda: _stub(stack).Generate(generation_pb2.GenerateRequest(text="hi", model="m" * (MAX_BODY // 2)), timeout=5)
    )
    assert code == grpc.StatusCode.NOT_FOUND and len(details) < 1100
    assert details.startswith("model 'mmm") and details.endswith(
        "m' is not served here; this gateway serves 'tiny-fake'"
    )
    assert " characters cut]... " in details


def test_a_grpc_message_over_the_body_limit_is_refused_by_size(stack):
    """gRPC requests have the REST body's limit: nothing larger reaches tokenization."""
    code, details = _refusal(
        lambda: _stub(stack).Generate(generation_pb2.GenerateRequest(text="hi", model="m" * 2 * MAX_BODY), timeout=5)
    )
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert details == f"SERVER: Received message larger than max ({2 * MAX_BODY + 7} vs. {MAX_BODY})"


@pytest.mark.parametrize(
    "content_type", [None, "text/plain", "application/x-www-form-urlencoded", "multipart/form-data"]
)
def test_json_endpoints_take_only_application_json(stack, content_type):
    """415 naming the header: a text/plain POST is a "simple" cross-site request a web page may send
    without a CORS preflight; JSON bodies must say they are JSON."""
    headers = {"content-type": content_type} if content_type else {}
    for path in ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"):
        r = httpx.post(stack.base_url + path, content=json.dumps(PROMPT), headers=headers, timeout=10)
        assert r.status_code == 415, (path, r.text)
        assert r.json()["error"] == {
            "message": f"Content-Type must be application/json, got {content_type or 'none'}",
            "type": "invalid_request_error",
            "param": "Content-Type",
            "code": None,
        }
    ok = httpx.post(
        stack.base_url + "/v1/completions",
        json={**PROMPT, "max_tokens": 1},
        headers={"content-type": "Application/JSON; charset=utf-8"},
        timeout=10,
    )
    assert ok.status_code == 200


def test_idle_connections_are_closed_by_the_header_timeout(tokenizer_dir):
    """1,000 connections that never send a byte are closed after http_header_timeout_s;
    a client that does send a request is served."""
    import socket

    s = Stack(tokenizer_dir, [FakePrefill()], [FakeDecode()], {"http_header_timeout_s": 0.5}).start()
    port = int(s.base_url.rsplit(":", 1)[1])
    idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(1000)]
    try:
        for sock in idle:
            sock.settimeout(10)
        started = time.monotonic()
        closed = sum(1 for sock in idle if sock.recv(1) == b"")  # b"": the server closed it
        assert closed == 1000
        assert time.monotonic() - started < 10
        r = httpx.post(s.base_url + "/v1/completions", json={**PROMPT, "max_tokens": 1}, timeout=10)
        assert r.status_code == 200
    finally:
        for sock in idle:
            sock.close()
        s.stop()


def test_a_client_that_leaves_mid_upload_is_a_499_not_a_server_error(stack, caplog):
    """Counted as status 499 and logged in one line, never as an ASGI exception."""
    import socket

    port = int(stack.base_url.rsplit(":", 1)[1])
    before = httpx.get(stack.base_url + "/metrics").text
    with caplog.at_level("INFO", logger="splitserve.gateway"):
        with socket.create_connection(("127.0.0.1", port)) as sock:
            sock.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b'Content-Length: 1000\r\n\r\n{"prompt": '
            )
        wait_until(
            lambda: 'route="/v1/completions",status="499"' in httpx.get(stack.base_url + "/metrics").text,
            5,
            "the disconnect was never counted as 499",
        )
    assert 'route="/v1/completions",status="499"' not in before
    assert "closed the connection while sending its request body" in caplog.text
    assert "Exception in ASGI application" not in caplog.text
    assert_still_serving(stack)
