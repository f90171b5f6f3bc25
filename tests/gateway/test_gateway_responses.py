"""POST /v1/responses through the real gateway and the official openai client's responses.create, over the
fake prefill and decode: the response object and the streamed semantic events, exact.

The chat template renders input "hello w30" as "user hello w30 assistant" = ids [3, 6, 30, 5]; the fakes then
generate 6 ("hello"), 7 ("world"), 8 ("w8"), ...
"""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.gateway_fakes import FakeDecode, FakePrefill, Stack, make_tokenizer_dir

MODEL = "tiny-fake"
TEXT_EVENTS = [
    "response.created",
    "response.in_progress",
    "response.output_item.added",
    "response.content_part.added",
    "response.output_text.delta",
    "response.output_text.delta",
    "response.output_text.delta",
    "response.output_text.done",
    "response.content_part.done",
    "response.output_item.done",
]


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    stack = Stack(make_tokenizer_dir(str(tmp_path_factory.mktemp("tokenizer"))), [FakePrefill()], [FakeDecode()])
    yield stack.start()
    stack.stop()


@pytest.fixture(scope="module")
def client(stack):
    return openai.OpenAI(base_url=stack.base_url + "/v1", api_key="unused", max_retries=0)


def test_text_response(client):
    r = client.responses.create(model=MODEL, input="hello w30", max_output_tokens=3)
    assert (r.object, r.status, r.incomplete_details.reason, r.model) == (
        "response",
        "incomplete",
        "max_output_tokens",
        MODEL,
    )
    assert r.id.startswith("resp_") and len(r.id) == 5 + 32
    [item] = r.output
    assert (item.type, item.role, item.status, item.id.startswith("msg_")) == (
        "message",
        "assistant",
        "incomplete",
        True,
    )
    assert [(p.type, p.text, p.annotations) for p in item.content] == [("output_text", " hello world w8", [])]
    assert r.output_text == " hello world w8"
    usage = r.usage
    assert (usage.input_tokens, usage.output_tokens, usage.total_tokens) == (4, 3, 7)
    assert (usage.input_tokens_details.cached_tokens, usage.output_tokens_details.reasoning_tokens) == (0, 0)
    assert (r.store, r.previous_response_id, r.max_output_tokens, r.tool_choice, r.tools) == (
        False,
        None,
        3,
        "none",
        [],
    )
    # the values applied, as vLLM echoes them: sampling defaults, no background, the default tier
    assert (r.temperature, r.top_p, r.background, r.service_tier) == (1.0, 1.0, False, "auto")


def test_instructions_messages_and_a_finished_answer(client, stack):
    r = client.responses.create(
        model=MODEL,
        instructions="w40",
        input=[
            {"role": "user", "content": "hello w30"},
            {"role": "assistant", "content": [{"type": "output_text", "text": "w31"}]},
            {"role": "user", "content": [{"type": "input_text", "text": "w50"}]},
        ],
        extra_body={"stop": ["w52"]},
        temperature=0.5,
        top_p=0.9,
    )
    # "system w40 user hello w30 assistant w31 user w50 assistant"
    assert list(stack.prefills[0].requests[-1].prompt_token_ids) == [4, 40, 3, 6, 30, 5, 31, 3, 50, 5]
    words = ["hello", "world", *(f"w{i}" for i in range(8, 52))]
    assert (r.status, r.incomplete_details, r.output_text) == ("completed", None, " " + " ".join(words) + " ")
    assert (r.instructions, r.temperature, r.top_p, r.usage.input_tokens) == ("w40", 0.5, 0.9, 10)


def test_streamed_events(client):
    events = list(client.responses.create(model=MODEL, input="hello w30", max_output_tokens=3, stream=True))
    assert [e.type for e in events] == [*TEXT_EVENTS, "response.incomplete"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [e.delta for e in events if e.type == "response.output_text.delta"] == [" hello", " world", " w8"]
    done = next(e for e in events if e.type == "response.output_text.done")
    assert (done.text, done.output_index, done.content_index) == (" hello world w8", 0, 0)
    item_ids = {e.item_id for e in events if hasattr(e, "item_id")}
    final = events[-1].response
    assert item_ids == {final.output[0].id}
    assert (events[0].response.status, events[0].response.output) == ("in_progress", [])
    assert (final.status, final.output_text, final.usage.input_tokens, final.usage.output_tokens) == (
        "incomplete",
        " hello world w8",
        4,
        3,
    )


def test_store_true_is_served_and_nothing_kept(client):
    """vLLM ignores store=true while its store is off (clients send OpenAI's default): so do we."""
    r = client.responses.create(model=MODEL, input="hello w30", max_output_tokens=3, store=True)
    assert (r.status, r.output_text, r.store) == ("incomplete", " hello world w8", False)


def test_a_previous_response_is_not_found(client):
    """Nothing is kept, so every previous_response_id is unknown: 404 with param response_id, as vLLM answers
    an id its store lacks."""
    with pytest.raises(openai.NotFoundError) as info:
        client.responses.create(model=MODEL, input="hello", previous_response_id="resp_abc")
    assert info.value.body == {
        "message": "Response with id 'resp_abc' not found: this server keeps no responses (stateless); send the "
        "whole conversation as input",
        "type": "invalid_request_error",
        "param": "response_id",
        "code": None,
    }


@pytest.mark.parametrize("field, value", [("background", True), ("reasoning", {"effort": "low"})])
def test_state_is_refused_naming_the_field(client, field, value):
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model=MODEL, input="hello", **{field: value})
    assert (info.value.status_code, info.value.body["param"]) == (400, field)
    assert info.value.body["message"] == (
        f"{field} is not supported: this server keeps no responses (stateless), so it cannot store one or "
        f"continue one; remove {field}"
    )


def test_bad_values_name_the_responses_field(stack):
    r = httpx.post(stack.base_url + "/v1/responses", json={"model": MODEL, "input": "hi", "max_output_tokens": -1})
    assert (r.status_code, r.json()["error"]["param"]) == (400, "max_output_tokens")
    assert r.json()["error"]["message"].startswith("max_output_tokens must be"), r.text
    r = httpx.post(stack.base_url + "/v1/responses", json={"model": MODEL, "input": []})
    assert (r.status_code, r.json()["error"]["param"]) == (400, "input")
    r = httpx.post(
        stack.base_url + "/v1/responses", json={"model": MODEL, "input": "hi", "tools": [{"type": "web_search"}]}
    )
    assert (r.status_code, r.json()["error"]["message"]) == (
        400,
        "tools[0] is a 'web_search' tool; only function tools are served",
    )


def test_raw_bodies_validate_against_openais_types(stack):
    """The openai client builds its objects without validating; here every body must validate strictly."""
    from openai.types.responses import Response, ResponseStreamEvent
    from pydantic import TypeAdapter

    body = {"model": MODEL, "input": "hello w30", "max_output_tokens": 3}
    r = httpx.post(stack.base_url + "/v1/responses", json=body)
    Response.model_validate(r.json(), strict=False)
    assert set(r.json()) >= {"id", "object", "created_at", "status", "error", "incomplete_details", "output", "usage"}
    with httpx.stream("POST", stack.base_url + "/v1/responses", json={**body, "stream": True}) as r:
        lines = list(r.iter_lines())
    kinds = [line[len("event: ") :] for line in lines if line.startswith("event: ")]
    datas = [line[len("data: ") :] for line in lines if line.startswith("data: ")]
    adapter = TypeAdapter(ResponseStreamEvent)
    events = [adapter.validate_json(data) for data in datas]
    assert [e.type for e in events] == kinds == [*TEXT_EVENTS, "response.incomplete"]


def test_responses_are_counted_under_their_route(stack):
    from tests.gateway_fakes import parse_metrics

    def count(status: str) -> float:
        metrics = parse_metrics(httpx.get(stack.base_url + "/metrics").text)
        return metrics.get(("splitserve:gateway_requests_total", (("route", "/v1/responses"), ("status", status))), 0)

    before = count("200"), count("400")
    httpx.post(stack.base_url + "/v1/responses", json={"model": MODEL, "input": "hi", "max_output_tokens": 1})
    httpx.post(stack.base_url + "/v1/responses", json={"model": MODEL, "input": "hi", "background": True})
    assert (count("200"), count("400")) == (before[0] + 1, before[1] + 1)


def test_a_decode_failing_mid_stream_ends_with_response_failed(tmp_path):
    import json

    decode = FakeDecode()
    decode.hold = True
    stack = Stack(make_tokenizer_dir(str(tmp_path)), [FakePrefill()], [decode]).start()
    try:
        body = {"model": MODEL, "input": "hello w30", "max_output_tokens": 5, "stream": True}
        with httpx.stream("POST", stack.base_url + "/v1/responses", json=body, timeout=10) as sse:
            lines = (line for line in sse.iter_lines() if line.startswith("data: "))
            first = [json.loads(next(lines)[len("data: ") :]) for _ in range(5)]  # to the prefill's first token
            stack.wait_for(lambda: len(decode.requests) == 1, what="the request at the decode")
            stack.loop.run(stack.servers["decode-0"].stop())
            rest = [json.loads(line[len("data: ") :]) for line in lines]
        assert [e["type"] for e in first] == TEXT_EVENTS[:5] and first[4]["delta"] == " hello"
        assert [e["type"] for e in rest] == ["response.failed"]
        failed = rest[0]["response"]
        assert failed["status"] == "failed" and failed["error"]["code"] == "server_error"
        assert failed["error"]["message"].startswith("decode instance decode-0 failed: ")
        assert failed["output"][0]["content"][0]["text"] == " hello"  # what was streamed before the failure
    finally:
        stack.stop()
