"""Where our OpenAI answers differ from vLLM's (0.32, found by benchmarks/parity_vllm_api.py) on purpose: each
test asserts ours and says why. Everything else that table compares is equal to vLLM's.

Over the fake prefill and decode: prompt "hello world w20" is 3 tokens, and the fakes answer " w21 w22 ...".
"""

from __future__ import annotations

import json

import httpx
import pytest

from tests.gateway_fakes import FakeDecode, FakePrefill, Stack, make_tokenizer_dir

MODEL = "tiny-fake"
PROMPT = "hello world w20"


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    stack = Stack(make_tokenizer_dir(str(tmp_path_factory.mktemp("tokenizer"))), [FakePrefill()], [FakeDecode()])
    stack.start()
    yield stack
    stack.stop()


def post(stack, path: str, body: dict | str) -> httpx.Response:
    content = body if isinstance(body, str) else json.dumps(body)
    return httpx.post(stack.base_url + path, content=content, headers={"content-type": "application/json"}, timeout=10)


def test_usage_always_has_cached_tokens_and_no_system_fingerprint(stack):
    """vLLM sends usage.prompt_tokens_details only under --enable-prompt-tokens-details; we always send it, as
    OpenAI does (prefix caching is on by default and clients read its hits there). vLLM's system_fingerprint
    names its own build ("vllm-0.32.0-<hash>"); we have none to give, so the field is absent (the openai client
    reads None either way)."""
    for path, body in (
        ("/v1/completions", {"prompt": PROMPT}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": PROMPT}]}),
    ):
        answer = post(stack, path, {"model": MODEL, "max_tokens": 2, **body}).json()
        assert answer["usage"] == {
            "prompt_tokens": answer["usage"]["prompt_tokens"],
            "completion_tokens": 2,
            "total_tokens": answer["usage"]["prompt_tokens"] + 2,
            "prompt_tokens_details": {"cached_tokens": 0},
        }
        assert "system_fingerprint" not in answer


# body -> (status, type, param, code); vLLM 0.32's (type, param, code) in the comment
ERRORS = [
    ({"max_tokens": -1}, (400, "invalid_request_error", "max_tokens", None)),  # BadRequestError, 400
    ({"n": 0}, (400, "invalid_request_error", "n", None)),  # BadRequestError, param null
    ({"model": "not-served"}, (404, "invalid_request_error", "model", "model_not_found")),  # NotFoundError, 404
    ({"prompt": "w9 " * 70}, (400, "invalid_request_error", "prompt", None)),  # param "input_tokens"
    (
        {"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 50},
        (400, None, "top_logprobs", None),
    ),  # param "logprobs"
    ({"messages": None}, (400, None, "messages", None)),  # "Bad Request", param "body.messages"
    ({"messages": [{"role": "x", "content": "hi"}]}, (400, None, "messages", None)),  # param null
]


@pytest.mark.parametrize("body, expected", ERRORS, ids=[str(i) for i in range(len(ERRORS))])
def test_errors_have_openais_type_and_name_the_field(stack, body, expected):
    """Errors are OpenAI's shape: type "invalid_request_error" (vLLM answers that on /v1/responses, and exception
    class names elsewhere: "BadRequestError", "NotFoundError", "Bad Request"), code null or OpenAI's code name
    (vLLM: the HTTP status again); param is the top-level field the client sent (vLLM: a pydantic location
    such as "body.messages", "input_tokens" for a long prompt, "logprobs" for top_logprobs, or none)."""
    chat = "messages" in body
    base = {"model": MODEL, "max_tokens": 2, **({} if chat else {"prompt": PROMPT})}
    r = post(stack, "/v1/chat/completions" if chat else "/v1/completions", {**base, **body})
    error = r.json()["error"]
    status, kind, param, code = expected
    assert (r.status_code, error["type"], error["param"], error["code"]) == (
        status,
        kind or "invalid_request_error",
        param,
        code,
    )


def test_a_body_that_is_not_json_names_the_body(stack):
    """vLLM: "Bad Request", param "body.1" (pydantic's location of the first bad character)."""
    error = post(stack, "/v1/completions", "{not json").json()["error"]
    assert (error["type"], error["param"], error["code"]) == ("invalid_request_error", "body", None)


def test_detokenize_refuses_ids_past_the_vocabulary(stack):
    """vLLM answers 200 with an empty text for an id past the vocabulary; bad input gets a clear error here."""
    r = post(stack, "/detokenize", {"model": MODEL, "tokens": [999999]})
    assert (r.status_code, r.json()["error"]["param"]) == (400, "tokens")
    assert r.json()["error"]["message"] == "tokens must hold token ids 0..199 (the vocabulary), got 999999"


def test_models_list_is_ours(stack):
    """owned_by names this server; root is the model id (vLLM: the --model value, a local path here: ours never
    shows a path of the server's disk); no `permission` list (vLLM's is a constant left from OpenAI's old API)."""
    [model] = httpx.get(stack.base_url + "/v1/models").json()["data"]
    assert (model["id"], model["owned_by"], model["root"], "permission" in model) == (MODEL, "splitserve", MODEL, False)


def test_responses_follow_openais_response_object(stack):
    """Ours is OpenAI's Response object: a message cut by max_output_tokens has status "incomplete" (vLLM says
    "completed" inside an incomplete response), output_text.logprobs is [] (vLLM null), text.format and store
    are echoed (vLLM: null and absent); vLLM's own extras (presence_penalty, frequency_penalty, usage per turn)
    are not sent."""
    answer = post(stack, "/v1/responses", {"model": MODEL, "input": PROMPT, "max_output_tokens": 2}).json()
    [item] = answer["output"]
    assert (answer["status"], item["status"], item["content"][0]["logprobs"]) == ("incomplete", "incomplete", [])
    assert (answer["text"], answer["store"]) == ({"format": {"type": "text"}}, False)
    assert not {"presence_penalty", "frequency_penalty"} & set(answer)
    assert answer["usage"] == {
        "input_tokens": answer["usage"]["input_tokens"],
        "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
        "output_tokens": 2,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": answer["usage"]["input_tokens"] + 2,
    }
