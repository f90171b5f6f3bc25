"""Tool calling and the Responses API against a real stack (a colocated worker on the default model, float64,
behind a gateway run with --enable-auto-tool-choice --tool-call-parser hermes), through the openai client.

The default model is tiny and random, so what it writes is forced by grammars: tool_choice "required" and a
named function constrain the answer to the tools' schemas (the arguments parse and validate every time); for
"auto", a regex makes the model write the Hermes format, which the parser then reads. Responses' text.format
json_schema output validates against its schema; its usage equals the same request's chat usage.
"""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pytest

from tests.service_harness import ENGINE, Proc, free_port, gateway_args, start_service, wait_until

pytestmark = pytest.mark.slow

FORECAST = {
    "type": "object",
    "properties": {"unit": {"enum": ["celsius", "fahrenheit"]}, "days": {"enum": [1, 2, 3]}},
    "required": ["unit", "days"],
    "additionalProperties": False,
}
ALERT = {
    "type": "object",
    "properties": {"severe": {"type": "boolean"}},
    "required": ["severe"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_forecast", "description": "a forecast", "parameters": FORECAST}},
    {"type": "function", "function": {"name": "get_alerts", "parameters": ALERT}},
]
SCHEMAS = {"get_forecast": FORECAST, "get_alerts": ALERT}
PROMPTS = ["What is the weather?", "def f(x):"]
HERMES = (
    r'<tool_call>\n\{"name": "get_forecast", "arguments": '
    r'\{"unit": "(celsius|fahrenheit)", "days": [123]\}\}\n</tool_call>'
)


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    from splitserve.common.default_model_path import default_model_path

    logs = tmp_path_factory.mktemp("tools-e2e")
    worker, address = start_service("worker", default_model_path(), logs, "worker-0", **ENGINE)
    grpc_port, http_port = free_port(), free_port()
    flags = ("--health-interval-s", "0.2", "--enable-auto-tool-choice", "--tool-call-parser", "hermes")
    gateway = Proc("gateway", gateway_args(grpc_port, http_port, "", address, *flags), logs, "gateway")
    try:
        worker.wait_ready()
        wait_until(lambda: _ready(http_port), 60, lambda: gateway.log_path.read_text()[-3000:])
        yield f"http://127.0.0.1:{http_port}/v1"
    finally:
        gateway.stop()
        worker.stop()


def _ready(http_port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{http_port}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.fixture(scope="module")
def client(stack):
    return openai.OpenAI(base_url=stack, api_key="unused", max_retries=0)


def _check_calls(calls: list[tuple[str, str]]) -> None:
    assert calls, "no tool call"
    for name, arguments in calls:
        jsonschema.validate(json.loads(arguments), SCHEMAS[name])


def _streamed_calls(chunks) -> tuple[list[tuple[str, str]], str]:
    calls: dict[int, list[str]] = {}
    finish = None
    for chunk in chunks:
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            for delta in choice.delta.tool_calls or ():
                if delta.id is not None:
                    assert delta.index not in calls and delta.type == "function" and delta.function.arguments == ""
                    calls[delta.index] = [delta.function.name, ""]
                else:
                    calls[delta.index][1] += delta.function.arguments
    return [tuple(calls[i]) for i in sorted(calls)], finish


@pytest.mark.parametrize("prompt", PROMPTS)
def test_required_arguments_match_the_schema_every_time(client, prompt):
    body = dict(
        model="default_model",
        messages=[{"role": "user", "content": prompt}],
        tools=TOOLS,
        tool_choice="required",
        max_tokens=120,
        temperature=1.0,
        seed=len(prompt),
    )
    r = client.chat.completions.create(**body)
    choice = r.choices[0]
    assert (choice.finish_reason, choice.message.content) == ("tool_calls", ""), choice
    _check_calls([(c.function.name, c.function.arguments) for c in choice.message.tool_calls])
    calls, finish = _streamed_calls(client.chat.completions.create(**body, stream=True))
    assert finish == "tool_calls"
    assert calls == [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]  # same seed


def test_named_function_arguments_match_its_schema(client):
    named = {"type": "function", "function": {"name": "get_alerts"}}
    for prompt in PROMPTS[:2]:
        body = dict(model="default_model", messages=[{"role": "user", "content": prompt}], tools=TOOLS, max_tokens=60)
        r = client.chat.completions.create(**body, tool_choice=named, temperature=0)
        [call] = r.choices[0].message.tool_calls
        assert (r.choices[0].finish_reason, call.function.name) == ("stop", "get_alerts")
        _check_calls([(call.function.name, call.function.arguments)])
        calls, finish = _streamed_calls(
            client.chat.completions.create(**body, tool_choice=named, stream=True, temperature=0)
        )
        assert (calls, finish) == ([("get_alerts", call.function.arguments)], "stop")


def test_auto_reads_what_the_model_writes(client):
    """The regex makes the model write a Hermes call: the parser turns it into message.tool_calls (arguments
    re-serialized as vLLM's parser does), streamed or not."""
    body = dict(
        model="default_model",
        messages=[{"role": "user", "content": "Forecast?"}],
        tools=TOOLS,
        max_tokens=200,
        temperature=0,
        extra_body={"structured_outputs": {"regex": HERMES}},
    )
    r = client.chat.completions.create(**body)
    choice = r.choices[0]
    assert len(choice.message.tool_calls) == 1, choice
    [call] = choice.message.tool_calls
    assert (choice.finish_reason, choice.message.content, call.function.name) == ("tool_calls", None, "get_forecast")
    assert re.fullmatch(r'\{"unit": "(celsius|fahrenheit)", "days": [123]\}', call.function.arguments)
    calls, finish = _streamed_calls(client.chat.completions.create(**body, stream=True))
    assert (calls, finish) == ([("get_forecast", call.function.arguments)], "tool_calls")


def test_responses_text_format_and_exact_usage(client):
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}},
        "required": ["ok"],
        "additionalProperties": False,
    }
    fmt = {"type": "json_schema", "name": "answer", "schema": schema}
    r = client.responses.create(
        model="default_model",
        instructions="Answer in JSON.",
        input="Is it fine?",
        text={"format": fmt},
        temperature=0,
        max_output_tokens=40,
    )
    assert r.status == "completed"
    jsonschema.validate(json.loads(r.output_text), schema)
    chat = client.chat.completions.create(
        model="default_model",
        messages=[{"role": "system", "content": "Answer in JSON."}, {"role": "user", "content": "Is it fine?"}],
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}},
        temperature=0,
        max_tokens=40,
    )
    assert chat.choices[0].message.content == r.output_text
    assert (r.usage.input_tokens, r.usage.output_tokens, r.usage.total_tokens) == (
        chat.usage.prompt_tokens,
        chat.usage.completion_tokens,
        chat.usage.total_tokens,
    )
    events = list(
        client.responses.create(
            model="default_model",
            instructions="Answer in JSON.",
            input="Is it fine?",
            text={"format": fmt},
            temperature=0,
            max_output_tokens=40,
            stream=True,
        )
    )
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == r.output_text
    assert events[-1].type == "response.completed" and events[-1].response.usage.output_tokens == r.usage.output_tokens


def test_responses_required_function_call(client):
    tools = [{"type": "function", **tool["function"]} for tool in TOOLS]
    r = client.responses.create(
        model="default_model",
        input="Weather?",
        tools=tools,
        tool_choice="required",
        parallel_tool_calls=False,
        max_output_tokens=120,
        temperature=0,
    )
    [call] = [o for o in r.output if o.type == "function_call"]
    _check_calls([(call.name, call.arguments)])
    events = list(
        client.responses.create(
            model="default_model",
            input="Weather?",
            tools=tools,
            tool_choice="required",
            parallel_tool_calls=False,
            max_output_tokens=120,
            temperature=0,
            stream=True,
        )
    )
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert [(d.arguments, events[-1].response.output[d.output_index].name) for d in done] == [
        (call.arguments, call.name)
    ]
