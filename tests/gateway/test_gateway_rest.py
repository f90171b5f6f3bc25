"""The OpenAI-compatible REST shim: the official openai client, SSE, and exact 4xx/5xx errors.

Prompt "hello world w20" is ids [6, 7, 20]; the fakes generate 21, 22, ... (" w21 w22 ...").
The chat template renders [{"role": "user", "content": "hello w30"}] as
"user hello w30 assistant" = ids [3, 6, 30, 5], after which the fakes generate 6 ("hello"),
7 ("world"), 8 ("w8"), ...
"""

import json
import logging
from pathlib import Path

import grpc
import httpx
import openai
import pytest

from splitserve.protos import generation_pb2, generation_pb2_grpc
from tests.gateway_fakes import FakeDecode, FakePrefill, Stack, make_tokenizer_dir
from tests.service_harness import wait_until

MODEL = "tiny-fake"
MAX_BODY = 4096


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    return make_tokenizer_dir(str(tmp_path_factory.mktemp("tokenizer")))


@pytest.fixture(scope="module")
def stack(tokenizer_dir):
    stack = Stack(tokenizer_dir, [FakePrefill()], [FakeDecode()], {"max_body_bytes": MAX_BODY}).start()
    yield stack
    stack.stop()


@pytest.fixture(scope="module")
def client(stack):
    return openai.OpenAI(base_url=stack.base_url + "/v1", api_key="unused", max_retries=0)


def post(stack, path, body, **kwargs):
    content = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return httpx.post(
        stack.base_url + path, content=content, headers={"content-type": "application/json"}, timeout=10, **kwargs
    )


def test_completion(client):
    r = client.completions.create(model=MODEL, prompt="hello world w20", max_tokens=5, temperature=0)
    assert r.choices[0].text == " w21 w22 w23 w24 w25" and r.choices[0].finish_reason == "length"
    assert (r.object, r.model, r.id.startswith("cmpl-")) == ("text_completion", MODEL, True)
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (3, 5, 8)


def test_completion_from_token_ids_with_stop(client):
    r = client.completions.create(model=MODEL, prompt=[6, 7, 20], max_tokens=10, stop="2 w2")
    assert (r.choices[0].text, r.choices[0].finish_reason) == (" w21 w2", "stop")
    assert r.usage.completion_tokens == 3


def test_completion_stream(client):
    chunks = list(
        client.completions.create(
            model=MODEL, prompt="hello world w20", max_tokens=4, stream=True, stream_options={"include_usage": True}
        )
    )
    assert [c.choices[0].text for c in chunks[:-1]] == [" w21", " w22", " w23", " w24"]
    assert [c.choices[0].finish_reason for c in chunks[:-1]] == [None, None, None, "length"]
    assert chunks[-1].choices == [] and (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens) == (3, 4)


def test_chat(client):
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hello w30"}], max_completion_tokens=4
    )
    assert (r.object, r.choices[0].message.role, r.choices[0].message.content) == (
        "chat.completion",
        "assistant",
        " hello world w8 w9",
    )
    assert (r.choices[0].finish_reason, r.usage.prompt_tokens, r.usage.completion_tokens) == ("length", 4, 4)


def test_chat_stream(client):
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hello w30"}], max_tokens=3, stream=True
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].delta.content for c in chunks[1:]] == [" hello", " world", " w8"]
    assert [c.choices[0].finish_reason for c in chunks] == [None, None, None, "length"]
    assert {c.object for c in chunks} == {"chat.completion.chunk"}


def test_completion_logprobs(client):
    r = client.completions.create(model=MODEL, prompt="hello world w20", max_tokens=2, logprobs=1)
    lp = r.choices[0].logprobs
    assert lp.tokens == ["w21", "w22"] and lp.text_offset == [0, 4]  # text " w21 w22"
    assert lp.token_logprobs == pytest.approx([-0.21, -0.22])
    assert [list(t) for t in lp.top_logprobs] == [["w21"], ["w22"]]


def test_chat_logprobs(client):
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "w40"}], max_tokens=1, logprobs=True, top_logprobs=2
    )
    (entry,) = r.choices[0].logprobs.content  # prompt "user w40 assistant": first token 6 "hello"
    assert (entry.token, entry.logprob) == ("hello", pytest.approx(-0.06))
    assert [(t.token, t.logprob) for t in entry.top_logprobs] == [
        ("hello", pytest.approx(-0.06)),
        ("world", pytest.approx(-1.07)),
    ]


def test_models_health_ready(client, stack):
    assert [(m.id, m.object) for m in client.models.list().data] == [(MODEL, "model")]
    assert httpx.get(stack.base_url + "/health").json() == {"status": "ok"}
    ready = httpx.get(stack.base_url + "/ready")
    assert ready.status_code == 200 and ready.json()["ready"] is True


def test_n_choices_through_the_openai_client(client, stack):
    """n=2: one prompt, one DecodeRequest whose fork id is the second sequence; choices 0 and 1; the
    prompt counted once in usage, as vLLM counts it. (The fake decode runs every sequence greedily.)"""
    (decode,) = [s.servicer for s in stack.servers.values() if isinstance(s.servicer, FakeDecode)]
    before = len(decode.requests)
    r = client.completions.create(model=MODEL, prompt="hello world w20", max_tokens=5, n=2)
    assert [(c.index, c.text, c.finish_reason) for c in r.choices] == [
        (0, " w21 w22 w23 w24 w25", "length"),
        (1, " w21 w22 w23 w24 w25", "length"),
    ]
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (3, 10, 13)
    (sent,) = decode.requests[before:]
    assert list(sent.fork_ids) == [sent.request_id + "~1"]
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hello w30"}], max_tokens=3, n=2, stream=True
        )
    )
    texts = {0: "", 1: ""}
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
    assert texts == {0: " hello world w8", 1: " hello world w8"}


def test_n_sequences_when_the_first_ends_at_the_prefill(stack):
    """max_tokens=1: the prefill's answer ends sequence 0 (and keeps no KV); the decode still gets the
    prompt for sequence 1, and sequence 0 is aborted there once sequence 1 has output."""
    (decode,) = [s.servicer for s in stack.servers.values() if isinstance(s.servicer, FakeDecode)]
    before = len(decode.requests)
    r = post(stack, "/v1/completions", {"model": MODEL, "prompt": "hello world w20", "max_tokens": 1, "n": 2})
    assert r.status_code == 200, r.text
    assert [(c["index"], c["text"]) for c in r.json()["choices"]] == [(0, " w21"), (1, " w21")]
    (sent,) = decode.requests[before:]
    assert not sent.HasField("kv") and list(sent.fork_ids) == [sent.request_id + "~1"]
    stack.wait_for(lambda: sent.request_id in decode.aborts, what="sequence 0 aborted at the decode")
    stack.wait_for(lambda: not decode.running, what="nothing left running at the decode")


def test_best_of_returns_the_n_best_not_streamed(stack):
    r = post(stack, "/v1/completions", {"model": MODEL, "prompt": "hello world w20", "max_tokens": 2, "best_of": 3})
    assert r.status_code == 200, r.text
    body = r.json()
    assert [(c["index"], c["text"], c["logprobs"]) for c in body["choices"]] == [(0, " w21 w22", None)]
    assert body["usage"]["completion_tokens"] == 2  # only the returned sequence's tokens, as vLLM counts
    r = post(stack, "/v1/completions", {"model": MODEL, "prompt": "w20", "best_of": 2, "n": 2, "stream": True})
    assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n")  # best_of == n streams


COMPLETION_ERRORS = [
    ({"temperature": "hot"}, "temperature", "temperature must be a number, got 'hot'"),
    ({"top_p": 0}, "top_p", "top_p must be > 0 and <= 1, got 0.0"),
    ({"max_tokens": 0}, "max_tokens", "max_tokens must be >= 1 or None, got 0"),
    ({"logprobs": 21}, "logprobs", "logprobs must be >= 0 and <= 20, got 21"),
    ({"stream": "yes"}, "stream", "stream must be a boolean, got 'yes'"),
    ({"stop": ["x"] * 17}, "stop", "stop must have at most 16 strings, got 17"),
    ({"stop": 5}, "stop", "stop must be a list of strings, got 5"),
    ({"seed": -1}, "seed", "seed must be >= 0 and <= 2**63-1, got -1"),
    ({"prompt": ""}, "prompt", "prompt must not be empty"),
    ({"prompt": ["w1"] * 65}, "prompt", "prompt holds 65 prompts; at most 64 per request"),
    (
        {"prompt": ["w1", [1, 500]]},
        "prompt",
        "prompt token id 500 is out of range; the vocabulary has 200 tokens (ids 0..199)",
    ),
    ({"prompt": [1, 500]}, "prompt", "prompt token id 500 is out of range; the vocabulary has 200 tokens (ids 0..199)"),
    (
        {"prompt": " ".join(["w9"] * 64)},
        "prompt",
        "prompt has 64 tokens, but the model's context limit "
        "(max_model_len) is 64 tokens, which must also hold at least one generated token",
    ),
    (
        {"stream_options": {"include_usage": True}},
        "stream_options",
        "stream_options is only allowed when stream is true",
    ),
    ({"stream": True, "stream_options": {"usage": True}}, "stream_options", "stream_options has no field 'usage'"),
    ({"priority": 2**31}, "priority", "priority must be >= -2147483648 and <= 2147483647, got 2147483648"),
    ({"prompt": None}, "prompt", "prompt is required"),
    ({"prompt": [1, -2]}, "prompt", "prompt token ids must be non-negative integers, got -2"),
    ({"stop": ["x", 3]}, "stop", "stop must be a list of strings"),
    ({"add_special_tokens": 1}, "add_special_tokens", "add_special_tokens must be a boolean, got 1"),
    ({"max_tokens": 2.0}, "max_tokens", "max_tokens must be an integer, got 2.0"),
    ({"n": 17}, "n", "n must be >= 1 and <= 16, got 17"),
    ({"n": 0}, "n", "n must be >= 1 and <= 16, got 0"),
    ({"n": 3, "best_of": 2}, "best_of", "best_of must be >= n (3), got 2"),
    (
        {"n": 1, "best_of": 2, "stream": True},
        "best_of",
        "best_of > n (2 > 1) cannot be streamed: the best 1 are known only when all 2 have ended; "
        "set stream to false or best_of to n",
    ),
    (
        {"logit_bias": {"200": 5}},
        "logit_bias",
        "logit_bias keys must be token ids below the vocabulary size 200, got 200",
    ),
    ({"logit_bias": {"-1": 5}}, "logit_bias", "logit_bias keys must be token ids (decimal integers), got '-1'"),
    ({"logit_bias": {"5": "x"}}, "logit_bias", "logit_bias['5'] must be a number, got 'x'"),
]


@pytest.mark.parametrize(
    "change,param,message", COMPLETION_ERRORS, ids=[c[1] + str(i) for i, c in enumerate(COMPLETION_ERRORS)]
)
def test_completion_bad_parameters_get_400_naming_the_field(stack, change, param, message):
    r = post(stack, "/v1/completions", {"model": MODEL, "prompt": "hello", **change})
    assert r.status_code == 400
    assert r.json() == {"error": {"message": message, "type": "invalid_request_error", "param": param, "code": None}}


CHAT_ERRORS = [
    ({"messages": []}, "messages", "messages must be a non-empty list of {role, content} objects"),
    (
        {"messages": [{"role": "robot", "content": "x"}]},
        "messages",
        "messages[0].role must be one of system, user, assistant, developer, tool, got 'robot'",
    ),
    (
        {"messages": [{"role": "user", "content": 3}]},
        "messages",
        "messages[0].content must be a string or a list of text parts, got 3",
    ),
    ({"top_logprobs": 2}, "top_logprobs", "top_logprobs requires logprobs to be true"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs", "top_logprobs must be >= 0 and <= 20, got 21"),
    (
        {"messages": [{"role": "user", "content": None}]},
        "messages",
        "messages[0].content must be a string or a list of text parts, got None",
    ),
    ({"messages": [{"content": "x"}]}, "messages", "messages[0].role is required"),
    (
        {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
        "messages",
        "messages[0].content must be a string or a list of text parts",
    ),
    ({"chat_template_kwargs": [1]}, "chat_template_kwargs", "chat_template_kwargs must be an object, got [1]"),
    ({"max_completion_tokens": 0}, "max_completion_tokens", "max_completion_tokens must be >= 1 or None, got 0"),
    ({"presence_penalty": 3}, "presence_penalty", "presence_penalty must be >= -2 and <= 2, got 3.0"),
]


@pytest.mark.parametrize("change,param,message", CHAT_ERRORS, ids=[c[1] + str(i) for i, c in enumerate(CHAT_ERRORS)])
def test_chat_bad_parameters_get_400_naming_the_field(stack, change, param, message):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], **change}
    r = post(stack, "/v1/chat/completions", body)
    assert r.status_code == 400
    assert r.json()["error"] == {"message": message, "type": "invalid_request_error", "param": param, "code": None}


def test_unknown_fields_are_ignored_with_a_log_line_and_unsupported_ones_named(stack, caplog):
    """As vLLM: a field nobody defines is logged and ignored; an OpenAI parameter we do not
    implement, sent with a value that would change the answer, is a 400 naming it."""
    with caplog.at_level("INFO", logger="splitserve.gateway"):
        r = post(stack, "/v1/completions", {"model": MODEL, "prompt": "w20", "max_tokens": 2, "foo": 1, "guided_x": 2})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == " w21 w22"
    assert "ignoring unknown request fields: 'foo', 'guided_x'" in caplog.text
    r = post(stack, "/v1/completions", {"model": MODEL, "prompt": "hello", "foo": 1, "suffix": "x"})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "suffix"
    assert r.json()["error"]["message"] == (
        "unsupported parameter: suffix (got 'x'); splitserve does not implement it, remove it from the request"
    )


def test_body_errors(stack):
    r = post(stack, "/v1/completions", b"{not json")
    assert (r.status_code, r.json()["error"]["message"]) == (
        400,
        "request body is not valid JSON: Expecting property name enclosed in double quotes: line 1 column 2 (char 1)",
    )
    r = post(stack, "/v1/completions", b'{"prompt": "\xff"}')
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("request body is not valid UTF-8: ")
    r = post(stack, "/v1/completions", [1, 2])
    assert (r.status_code, r.json()["error"]["message"]) == (400, "request body must be a JSON object, got list")
    r = post(stack, "/v1/completions", {"model": MODEL, "prompt": "w9 " * MAX_BODY})
    assert r.status_code == 413
    assert r.json()["error"] == {
        "message": f"request body has more than {MAX_BODY} bytes (got at least {len(r.request.content)}); "
        f"the limit is max_body_bytes={MAX_BODY}",
        "type": "invalid_request_error",
        "param": "body",
        "code": "request_too_large",
    }


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="gpt-4", prompt="hello")
    assert info.value.body == {
        "message": "model 'gpt-4' is not served here; this gateway serves 'tiny-fake'",
        "type": "invalid_request_error",
        "param": "model",
        "code": "model_not_found",
    }


def test_streaming_client_that_leaves_aborts_the_request(stack):
    (decode,) = [s.servicer for s in stack.servers.values() if isinstance(s.servicer, FakeDecode)]
    body = {"model": MODEL, "prompt": "hello world w20", "max_tokens": 60, "stream": True}
    with httpx.stream("POST", stack.base_url + "/v1/completions", json=body, timeout=10) as r:
        lines = r.iter_lines()
        chunk = json.loads(next(line for line in lines if line)[len("data: ") :])
        assert chunk["choices"][0]["text"] == " w21"
        rid = stack.internal_id(chunk["id"])  # the REST id, with this gateway's suffix on the hops
    stack.wait_for(lambda: rid in decode.aborts, what="AbortRequest after the client left")


def test_a_batch_streams_client_that_leaves_aborts_every_prompt_cleanly(stack, caplog):
    """Three prompts streamed as one batch (the later ones pumped by tasks of their own): a client that leaves
    at the first chunk aborts all three, and closing them logs no error."""
    (decode,) = [s.servicer for s in stack.servers.values() if isinstance(s.servicer, FakeDecode)]
    body = {"model": MODEL, "prompt": ["hello w20", "hello w21", "hello w22"], "max_tokens": 60, "stream": True}
    with httpx.stream("POST", stack.base_url + "/v1/completions", json=body, timeout=10) as r:
        chunk = json.loads(next(line for line in r.iter_lines() if line)[len("data: ") :])
    base = chunk["id"]  # prompt i runs as request f"{base}-{i}" (i > 0) on the internal hops
    wanted = {stack.internal_id(base), stack.internal_id(f"{base}-1"), stack.internal_id(f"{base}-2")}
    wait_until(lambda: wanted <= set(decode.aborts), 10, lambda: f"aborts of {wanted}, got {decode.aborts[-6:]}")
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []


def test_no_decode_up_is_503_with_retry_after(tokenizer_dir):
    decode = FakeDecode()
    stack = Stack(tokenizer_dir, [FakePrefill()], [decode]).start()
    try:
        stack.loop.run(stack.servers["decode-0"].stop())
        inst = stack.gateway.registry.decodes()[0]
        stack.wait_for(lambda: not inst.up, what="the decode to be down")
        r = post(stack, "/v1/completions", {"model": MODEL, "prompt": "hello"})
        assert (r.status_code, r.headers["retry-after"]) == (503, "1")
        assert r.json()["error"] == {
            "message": "no decode instance is up; retry later",
            "type": "service_unavailable_error",
            "param": None,
            "code": None,
        }
        ready = httpx.get(stack.base_url + "/ready")
        assert ready.status_code == 503 and ready.json()["reason"].startswith(
            "no prefill/decode pair with equal KV layouts and no colocated worker is up; decode decode-0 at 127.0.0.1:"
        )
        stub = generation_pb2_grpc.GenerationStub(grpc.insecure_channel(stack.grpc_target))
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Generate(generation_pb2.GenerateRequest(text="hello"), timeout=5))
        assert (info.value.code(), info.value.details()) == (
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            "no decode instance is up; retry later",
        )
        assert ("retry-after", "1") in tuple(info.value.trailing_metadata())
    finally:
        stack.stop()


def test_a_decode_failing_mid_request_reaches_rest_clients(tokenizer_dir):
    from concurrent.futures import ThreadPoolExecutor

    decode = FakeDecode()
    decode.hold = True
    stack = Stack(tokenizer_dir, [FakePrefill()], [decode]).start()
    try:
        body = {"model": MODEL, "prompt": "hello world w20", "max_tokens": 5}
        with (
            ThreadPoolExecutor(1) as pool,
            httpx.stream("POST", stack.base_url + "/v1/completions", json={**body, "stream": True}, timeout=10) as sse,
        ):
            plain = pool.submit(post, stack, "/v1/completions", body)
            lines = sse.iter_lines()
            assert json.loads(next(line for line in lines if line)[len("data: ") :])["choices"][0]["text"] == " w21"
            stack.wait_for(lambda: len(decode.requests) == 2, what="both requests at the decode")
            stack.loop.run(stack.servers["decode-0"].stop())
            events = [line for line in lines if line]
            error = json.loads(events[0][len("data: ") :])["error"]
            assert error["type"] == "server_error" and error["message"].startswith("decode instance decode-0 failed: ")
            assert events[1:] == ["data: [DONE]"]
            response = plain.result(10)
        assert response.status_code == 500
        assert response.json()["error"]["message"].startswith("decode instance decode-0 failed: ")
    finally:
        stack.stop()


def test_a_gateway_process_is_not_ready_while_another_of_its_processes_has_no_path(tokenizer_dir):
    """--api-server-count N: readiness is the whole gateway's, so a client that one process told "ready" is not
    refused by another that has not described the instances yet."""
    serving = Stack(tokenizer_dir, [FakePrefill()], [FakeDecode()]).start()
    try:
        wait_until(lambda: httpx.get(serving.base_url + "/health").status_code == 200, 5, "/health never said 200")
        serving.gateway.service.processes_not_ready = lambda: [1]
        health = httpx.get(serving.base_url + "/health")
        assert (health.status_code, health.json()) == (
            503,
            {"status": "unavailable", "reason": "gateway processes [1] have not found a full path yet"},
        )
        ready = httpx.get(serving.base_url + "/ready")
        assert (ready.status_code, ready.json()["ready"]) == (503, False)
        serving.gateway.service.processes_not_ready = list
        assert httpx.get(serving.base_url + "/ready").status_code == 200
    finally:
        serving.stop()


def test_health_is_503_until_a_whole_path_serves_and_live_is_always_200(tokenizer_dir):
    """vLLM's convention: a client that waits for /health can then list models and send requests."""
    stack = Stack(tokenizer_dir, [FakePrefill()], []).start()  # a prefill, but no decode: no path
    try:
        health = httpx.get(stack.base_url + "/health")
        assert health.status_code == 503
        assert health.json() == {
            "status": "unavailable",
            "reason": "no prefill/decode pair with equal KV layouts and no colocated worker is up",
        }
        assert httpx.get(stack.base_url + "/live").json() == {"status": "ok"}
        assert httpx.get(stack.base_url + "/ready").status_code == 503
    finally:
        stack.stop()
    serving = Stack(tokenizer_dir, [FakePrefill()], [FakeDecode()]).start()
    try:
        wait_until(lambda: httpx.get(serving.base_url + "/health").status_code == 200, 5, "/health never said 200")
        assert httpx.get(serving.base_url + "/health").json() == {"status": "ok"}
        models = httpx.get(serving.base_url + "/v1/models").json()["data"]
        assert [m["id"] for m in models] == [MODEL]  # listed as soon as /health says ok
    finally:
        serving.stop()


@pytest.fixture(scope="module")
def bos_tokenizer_dir(tmp_path_factory):
    """The word-level tokenizer with a post-processor that adds BOS, as Llama's tokenizers do."""
    from tokenizers import Tokenizer, processors

    path = Path(make_tokenizer_dir(str(tmp_path_factory.mktemp("bos-tokenizer"))))
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    bos_id = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos_id)]
    )
    tok.save(str(path / "tokenizer.json"))
    return str(path)


def test_completion_prompts_get_the_tokenizers_special_tokens_as_transformers_gives(bos_tokenizer_dir):
    from transformers import AutoTokenizer

    prefill = FakePrefill()
    stack = Stack(bos_tokenizer_dir, [prefill], [FakeDecode()]).start()
    try:
        wait_until(lambda: httpx.get(stack.base_url + "/health").status_code == 200, 5, "the stack never served")
        body = {"model": MODEL, "prompt": "w20 w21", "temperature": 0}
        assert httpx.post(stack.base_url + "/v1/completions", json=body).status_code == 200
        chat = {"model": MODEL, "messages": [{"role": "user", "content": "w40"}], "temperature": 0}
        assert httpx.post(stack.base_url + "/v1/chat/completions", json=chat).status_code == 200
    finally:
        stack.stop()
    reference = AutoTokenizer.from_pretrained(bos_tokenizer_dir)
    completion, chat_request = prefill.requests
    assert list(completion.prompt_token_ids) == reference("w20 w21")["input_ids"]
    assert completion.prompt_token_ids[0] == reference.convert_tokens_to_ids("<s>")
    rendered = reference.apply_chat_template(
        [{"role": "user", "content": "w40"}], tokenize=False, add_generation_prompt=True
    )
    assert list(chat_request.prompt_token_ids) == reference(rendered, add_special_tokens=False)["input_ids"]
    # no max_tokens: a completion gets vLLM's 16, a chat as many as the context holds (64 - prompt)
    assert completion.sampling.max_tokens == 16
    assert chat_request.sampling.max_tokens == 64 - len(chat_request.prompt_token_ids)


@pytest.fixture(scope="module")
def kwargs_tokenizer_dir(tmp_path_factory):
    """The word-level tokenizer with a template that reads a template kwarg (like Qwen3's enable_thinking)."""
    path = Path(make_tokenizer_dir(str(tmp_path_factory.mktemp("kwargs-tokenizer"))))
    (path / "chat_template.jinja").write_text(  # transformers 5 saves the template here; it wins over the config
        "{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}"
        "{% if add_generation_prompt %}assistant{% if greet %} hello{% endif %}{% endif %}"
    )
    return str(path)


def test_chat_template_fields_reach_the_template_as_transformers_renders_them(kwargs_tokenizer_dir):
    from transformers import AutoTokenizer

    prefill = FakePrefill()
    stack = Stack(kwargs_tokenizer_dir, [prefill], [FakeDecode()]).start()
    user = [{"role": "user", "content": "w40"}]
    assistant = [*user, {"role": "assistant", "content": "w41 w42"}]
    bodies = [
        {"messages": user, "chat_template_kwargs": {"greet": True}},
        {"messages": assistant, "continue_final_message": True, "add_generation_prompt": False},
        {"messages": user, "priority": 7},
    ]
    try:
        wait_until(lambda: httpx.get(stack.base_url + "/health").status_code == 200, 5, "the stack never served")
        for body in bodies:
            r = httpx.post(stack.base_url + "/v1/chat/completions", json={"model": MODEL, "max_tokens": 2, **body})
            assert r.status_code == 200, r.text
        both = httpx.post(
            stack.base_url + "/v1/chat/completions",
            json={"model": MODEL, "messages": assistant, "continue_final_message": True},
        )
    finally:
        stack.stop()
    reference = AutoTokenizer.from_pretrained(kwargs_tokenizer_dir)
    expected = [
        reference.apply_chat_template(user, tokenize=False, add_generation_prompt=True, greet=True),
        reference.apply_chat_template(
            assistant, tokenize=False, add_generation_prompt=False, continue_final_message=True
        ),
        reference.apply_chat_template(user, tokenize=False, add_generation_prompt=True),
    ]
    assert expected[0].endswith("assistant hello") and expected[1].endswith("w41 w42")
    got = [list(r.prompt_token_ids) for r in prefill.requests]
    assert got == [reference(text, add_special_tokens=False)["input_ids"] for text in expected]
    assert [r.priority for r in prefill.requests] == [0, 0, 7]
    assert both.status_code == 400 and both.json()["error"]["param"] == "continue_final_message"
    assert both.json()["error"]["message"] == (
        "continue_final_message continues the last message: set add_generation_prompt to false with it"
    )


def test_served_model_names_are_listed_and_accepted(tokenizer_dir):
    """vLLM's --served-model-name: several names, each usable in requests and listed by /v1/models; answers
    carry the first one, whichever a request named (vLLM's OpenAIServingModels.model_name)."""
    s = Stack(
        tokenizer_dir, [FakePrefill()], [FakeDecode()], {"model_id": MODEL, "served_model_name": "alias-a, alias-b"}
    ).start()
    try:
        wait_until(lambda: httpx.get(s.base_url + "/health").status_code == 200, 5, "the stack never served")
        models = httpx.get(s.base_url + "/v1/models").json()["data"]
        assert [(m["id"], m["root"], m["parent"], m["max_model_len"]) for m in models] == [
            ("alias-a", MODEL, None, 64),
            ("alias-b", MODEL, None, 64),
        ]
        body = {"prompt": "w20", "max_tokens": 1}
        r = httpx.post(s.base_url + "/v1/completions", json={**body, "model": "alias-b"})
        assert r.status_code == 200 and r.json()["model"] == "alias-a"
        r = httpx.post(s.base_url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "w1"}]})
        assert r.status_code == 200 and r.json()["model"] == "alias-a"
        r = httpx.post(s.base_url + "/v1/completions", json={**body, "model": MODEL})
        assert r.status_code == 404
        assert r.json()["error"]["message"] == (
            f"model '{MODEL}' is not served here; this gateway serves 'alias-a', 'alias-b'"
        )
        stub = generation_pb2_grpc.GenerationStub(grpc.insecure_channel(s.grpc_target))
        listed = stub.ListModels(generation_pb2.ListModelsRequest(), timeout=5).models
        assert [m.id for m in listed] == ["alias-a", "alias-b"]
    finally:
        s.stop()


def test_continuous_usage_stats_put_the_counts_so_far_on_every_chunk(stack):
    """vLLM's stream_options.continuous_usage_stats (with include_usage): every chunk carries usage."""
    body = {
        "model": MODEL,
        "prompt": "w20 w21",
        "max_tokens": 3,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    r = post(stack, "/v1/completions", body)
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    with_text = [e for e in events if e["choices"]]
    assert [e["choices"][0]["text"] for e in with_text] == [" w22", " w23", " w24"]
    assert [(e["usage"]["prompt_tokens"], e["usage"]["completion_tokens"]) for e in with_text] == [
        (2, 1),
        (2, 2),
        (2, 3),
    ]
    assert events[-1]["choices"] == [] and events[-1]["usage"]["total_tokens"] == 5
    plain = post(stack, "/v1/completions", {**body, "stream_options": {"include_usage": True}})
    chunks = [json.loads(line[6:]) for line in plain.text.splitlines() if line.startswith("data: {")]
    assert [("usage" in c) for c in chunks] == [False, False, False, True]


def test_a_batch_of_prompts_gets_one_choice_per_prompt(stack):
    """vLLM/OpenAI: prompt may be a list; choice i answers prompt i, usage is the batch's sum."""
    body = {"model": MODEL, "prompt": ["w20", [40, 41], "w150"], "max_tokens": 2, "temperature": 0}
    r = post(stack, "/v1/completions", body)
    assert r.status_code == 200, r.text
    answer = r.json()
    assert [(c["index"], c["text"], c["finish_reason"]) for c in answer["choices"]] == [
        (0, " w21 w22", "length"),
        (1, " w42 w43", "length"),
        (2, " w151 w152", "length"),
    ]
    assert (answer["usage"]["prompt_tokens"], answer["usage"]["completion_tokens"]) == (4, 6)
    streamed = post(stack, "/v1/completions", {**body, "stream": True, "stream_options": {"include_usage": True}})
    events = [json.loads(line[6:]) for line in streamed.text.splitlines() if line.startswith("data: {")]
    by_choice: dict[int, str] = {}
    for e in events[:-1]:
        (choice,) = e["choices"]
        by_choice[choice["index"]] = by_choice.get(choice["index"], "") + choice["text"]
    assert by_choice == {0: " w21 w22", 1: " w42 w43", 2: " w151 w152"}
    assert events[-1]["choices"] == [] and events[-1]["usage"]["total_tokens"] == 10
    assert streamed.text.rstrip().endswith("data: [DONE]")


def test_logit_bias_reaches_prefill_and_decode_over_rest_and_grpc(tokenizer_dir):
    """OpenAI's logit_bias (JSON keys are token id strings) reaches both hops as token id -> bias,
    biases clamped to [-100, 100] as vLLM does; gRPC sends the same map."""
    prefill, decode = FakePrefill(), FakeDecode()
    stack = Stack(tokenizer_dir, [prefill], [decode]).start()
    try:
        wait_until(lambda: httpx.get(stack.base_url + "/health").status_code == 200, 5, "the stack never served")
        body = {"model": MODEL, "prompt": "w20", "max_tokens": 2, "logit_bias": {"21": 100, "7": -250, "9": 1.5}}
        r = httpx.post(stack.base_url + "/v1/completions", json=body)
        assert r.status_code == 200, r.text
        stub = generation_pb2_grpc.GenerationStub(grpc.insecure_channel(stack.grpc_target))
        sampling = {"max_tokens": 2, "logit_bias": {21: 100.0, 7: -100.0, 9: 1.5}}
        list(stub.Generate(generation_pb2.GenerateRequest(text="w20", sampling=sampling), timeout=5))
        expected = {21: 100.0, 7: -100.0, 9: 1.5}
        assert [dict(p.sampling.logit_bias) for p in prefill.requests] == [expected, expected]
        assert [dict(d.sampling.logit_bias) for d in decode.requests] == [expected, expected]
    finally:
        stack.stop()


def test_a_refused_body_is_400_as_vllm_answers_not_fastapis_422(stack):
    """vLLM's server turns FastAPI's RequestValidationError into 400 (FastAPI alone answers 422); so do we,
    in OpenAI's error shape, the message naming the field's path and what it must be."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}, {"role": "bot", "content": "y"}]}
    r = post(stack, "/v1/chat/completions", body)
    assert (r.status_code, r.json()) == (
        400,
        {
            "error": {
                "message": "messages[1].role must be one of system, user, assistant, developer, tool, got 'bot'",
                "type": "invalid_request_error",
                "param": "messages",
                "code": None,
            }
        },
    )
