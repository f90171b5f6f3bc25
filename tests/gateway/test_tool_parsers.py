"""Tool-call parsers on canned model outputs: the calls and content each gives for a whole answer (what vLLM's
parser of the same name gives for the same text, read off its documented format), and the streamed deltas,
which add up to the same calls whatever the pieces."""

from __future__ import annotations

import json

import pytest

from splitserve.gateway.errors import GatewayError
from splitserve.gateway.rest_tool_answers import ToolAnswer
from splitserve.gateway.rest_tools import AUTO_NEEDS_FLAGS, ToolPlan, ToolSettings, tool_request
from splitserve.gateway.tool_parsers import TOOL_PARSERS
from splitserve.gateway.tool_parsers.base import Extracted, ToolCall
from splitserve.gateway.tool_parsers.partial_json import canonical_prefix

WEATHER = ToolCall("get_weather", '{"city": "Paris", "unit": "celsius"}')
TIME = ToolCall("get_time", "{}")

# (parser, model output, the whole answer's content and calls)
CANNED = [
    (
        "hermes",
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>',
        Extracted(None, (WEATHER,)),
    ),
    (
        "hermes",
        'Let me check.\n<tool_call>\n{"name":"get_weather","arguments":{"city":"Paris","unit":"celsius"}}\n'
        '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',
        Extracted("Let me check.\n", (WEATHER, TIME)),
    ),
    (  # a call cut off before its end tag still counts, as in vLLM
        "hermes",
        '<tool_call>\n{"name": "get_time", "arguments": {}}',
        Extracted(None, (TIME,)),
    ),
    ("hermes", "It is sunny in Paris.", Extracted("It is sunny in Paris.")),
    ("hermes", "<tool_call>\n{not json}\n</tool_call>", Extracted("<tool_call>\n{not json}\n</tool_call>")),
    (  # a bad escape in a key: not a call, streamed or not
        "hermes",
        '<tool_call>{"na\\qme": "f", "arguments": {}}</tool_call>',
        Extracted('<tool_call>{"na\\qme": "f", "arguments": {}}</tool_call>'),
    ),
    (
        "hermes",
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Zürich"}}</tool_call>',
        Extracted(None, (ToolCall("get_weather", '{"city": "Zürich"}'),)),
    ),
    (
        "llama3_json",
        '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}',
        Extracted(None, (WEATHER,)),
    ),
    (
        "llama3_json",
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}; '
        '{"name": "get_time", "arguments": {}}',
        Extracted(None, (WEATHER, TIME)),
    ),
    (  # vLLM's llama3_json re-serializes with ASCII escapes
        "llama3_json",
        '{"name": "get_weather", "parameters": {"city": "Zürich"}}',
        Extracted(None, (ToolCall("get_weather", '{"city": "Z\\u00fcrich"}'),)),
    ),
    ("llama3_json", "No tools needed.", Extracted("No tools needed.")),
    ("llama3_json", '{"city": "Paris"}', Extracted('{"city": "Paris"}')),
    (
        "mistral",
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}]',
        Extracted(None, (WEATHER,)),
    ),
    (
        "mistral",
        'Sure. [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}, '
        '{"name": "get_time", "arguments": {}}]',
        Extracted("Sure. ", (WEATHER, TIME)),
    ),
    ("mistral", "Plain words.", Extracted("Plain words.")),
    ("mistral", "[TOOL_CALLS] oops", Extracted("oops")),
]


@pytest.mark.parametrize("name, text, expected", CANNED, ids=[f"{c[0]}-{i}" for i, c in enumerate(CANNED)])
def test_whole_answers_give_vllms_calls_and_content(name, text, expected):
    assert TOOL_PARSERS[name]().extract(text) == expected


def _message(plan: ToolPlan, text: str, finish: str = "stop") -> tuple[dict, str]:
    return ToolAnswer(plan).message(text, finish)


def _streamed(plan: ToolPlan, pieces: list[str], finish: str = "stop") -> tuple[str | None, list[dict], str, list]:
    """Feed the pieces; (content, calls as the openai client assembles them, finish reason, every delta)."""
    answer = ToolAnswer(plan)
    content, calls, deltas = None, {}, []
    for k, piece in enumerate(pieces):
        delta, reason = answer.delta(piece, finish if k == len(pieces) - 1 else None)
        deltas.append(delta)
        if "content" in delta:
            content = (content or "") + delta["content"]
        for entry in delta.get("tool_calls", ()):
            call = calls.setdefault(entry["index"], {"id": None, "name": None, "arguments": ""})
            if "id" in entry:
                assert (call["id"], entry["type"], entry["function"]["arguments"]) == (None, "function", "")
                call["id"], call["name"] = entry["id"], entry["function"]["name"]
            else:
                assert call["id"] is not None, "arguments before the call's first delta"
                call["arguments"] += entry["function"]["arguments"]
    return content, [calls[i] for i in sorted(calls)], reason, deltas


def _split(text: str, size: int) -> list[str]:
    return [text[i : i + size] for i in range(0, len(text), size)] or [""]


@pytest.mark.parametrize("name, text, expected", CANNED, ids=[f"{c[0]}-{i}" for i, c in enumerate(CANNED)])
@pytest.mark.parametrize("size", [1, 3, 7, 1000])
def test_streamed_deltas_add_up_to_the_whole_answer(name, text, expected, size):
    plan = ToolPlan("auto", parser_name=name)
    message, finish = _message(plan, text)
    content, calls, reason, _ = _streamed(plan, _split(text, size))
    assert [(c["name"], c["arguments"]) for c in calls] == [
        (c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls", [])
    ]
    assert ("tool_calls" in message) == bool(expected.calls)  # no call: no field, as vLLM answers
    assert reason == finish == ("tool_calls" if expected.calls else "stop")
    if expected.calls:
        assert content == message["content"] or (content is None and not message["content"])
    else:
        assert content == message["content"] == (expected.content or text)


def test_message_shapes_and_ids():
    plan = ToolPlan("auto", parser_name="hermes")
    message, finish = _message(plan, CANNED[1][1])
    assert finish == "tool_calls" and message["role"] == "assistant" and message["content"] == "Let me check.\n"
    ids = [c["id"] for c in message["tool_calls"]]
    assert all(len(i) == len("chatcmpl-tool-") + 32 and i.startswith("chatcmpl-tool-") for i in ids)
    assert len(set(ids)) == 2 and {c["type"] for c in message["tool_calls"]} == {"function"}
    mistral_text = next(text for name, text, out in CANNED if name == "mistral" and out.calls)
    mistral, _ = _message(ToolPlan("auto", parser_name="mistral"), mistral_text)
    assert len(mistral["tool_calls"][0]["id"]) == 9 and mistral["tool_calls"][0]["id"].isalnum()
    one, _ = _message(ToolPlan("auto", parallel=False, parser_name="hermes"), CANNED[1][1])
    assert [c["function"]["name"] for c in one["tool_calls"]] == ["get_weather"]
    plain, finish = _message(plan, "Hello there.", "length")
    # no call: no tool_calls field (vLLM's message drops an empty list; OpenAI sends none either)
    assert (plain, finish) == ({"role": "assistant", "content": "Hello there."}, "length")


def test_hermes_stream_holds_back_a_tag_being_written():
    plan = ToolPlan("auto", parser_name="hermes")
    _, _, _, deltas = _streamed(plan, ["Hi <tool", "_call>", '{"name": "get_time", "arguments": {}}', "</tool_call>"])
    assert deltas[0] == {"content": "Hi "}
    assert deltas[1] == {}
    first = deltas[2]["tool_calls"][0]
    assert (first["index"], first["type"], first["function"]) == (0, "function", {"name": "get_time", "arguments": ""})
    assert deltas[2]["tool_calls"][1:] == [{"index": 0, "function": {"arguments": "{}"}}]
    assert deltas[3] == {}


def test_a_call_that_goes_bad_after_its_name_was_streamed_stays_sent():
    """Streamed text cannot be taken back: a call whose arguments turn malformed (a bad escape) after its name
    went out stays in the stream with what was sent, finish_reason tool_calls; read whole, the text is content."""
    text = '<tool_call>{"name": "get_time", "arguments": {"x": "\\q"}}</tool_call>'
    plan = ToolPlan("auto", parser_name="hermes")
    assert _message(plan, text) == ({"role": "assistant", "content": text}, "stop")
    content, calls, reason, _ = _streamed(plan, _split(text, 1))
    assert (content, [(c["name"], c["arguments"]) for c in calls], reason) == (
        None,
        [("get_time", '{"x": "')],
        "tool_calls",
    )


def test_required_and_named_answers():
    required = ToolPlan("required")
    text = '[{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}]'
    message, finish = _message(required, text)
    assert finish == "tool_calls" and message["content"] == ""
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]] == [
        ("get_weather", WEATHER.arguments)
    ]
    _, calls, reason, _ = _streamed(required, _split(text, 4))
    assert (calls[0]["name"], calls[0]["arguments"], reason) == ("get_weather", WEATHER.arguments, "tool_calls")
    named = ToolPlan("named", function="get_weather")
    message, finish = _message(named, '{"city":"Paris"}')
    assert finish == "stop" and message["tool_calls"][0]["function"] == {
        "name": "get_weather",
        "arguments": '{"city":"Paris"}',
    }
    _, calls, reason, deltas = _streamed(named, ['{"city"', ':"Paris"}'])
    assert (calls[0]["name"], calls[0]["arguments"], reason) == ("get_weather", '{"city":"Paris"}', "stop")
    assert deltas[0]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": ""}


@pytest.mark.parametrize(
    "raw",
    ['{"a": [1, 2.50, -3e2], "b": {"c": "x\\"y\\u00e9\\ud83d\\ude00z"}, "d": true, "e": null}', '  {"k" :  "v\\n"}'],
)
def test_canonical_prefix_only_grows_and_ends_as_json_dumps(raw):
    seen = ""
    for cut in range(len(raw) + 1):
        now = canonical_prefix(raw[:cut])
        assert now.startswith(seen), (raw[:cut], seen, now)
        seen = now
    assert canonical_prefix(raw, final=True) == json.dumps(json.loads(raw), ensure_ascii=False)


TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}},
    {"type": "function", "function": {"name": "get_time"}},
]


@pytest.mark.parametrize(
    "tools, choice, settings, message, param",
    [
        (None, "auto", ToolSettings(), "When using `tool_choice`, `tools` must be set.", "tool_choice"),
        (TOOLS, None, ToolSettings(), AUTO_NEEDS_FLAGS, "tool_choice"),
        (
            TOOLS,
            "sometimes",
            ToolSettings(),
            'Invalid value for `tool_choice`: \'sometimes\'! Only named tools, "none", "auto" or "required" are '
            "supported.",
            "tool_choice",
        ),
        (
            TOOLS,
            {"type": "function", "function": {"name": "nope"}},
            ToolSettings(),
            "The tool specified in `tool_choice` does not match any of the specified `tools`",
            "tool_choice",
        ),
        (
            [{"type": "function", "function": {}}],
            "required",
            ToolSettings(),
            "tools[0].function.name must be a non-empty string",
            "tools",
        ),
    ],
)
def test_bad_tool_fields_are_refused_naming_the_field(tools, choice, settings, message, param):
    with pytest.raises(GatewayError) as info:
        tool_request(tools, choice, None, settings)
    assert (info.value.message, info.value.param) == (message, param)


def test_plans_and_grammars():
    auto = tool_request(TOOLS, None, None, ToolSettings(True, "hermes"))
    assert (auto.plan, auto.structured) == (ToolPlan("auto", parser_name="hermes"), None)
    assert auto.template_tools == tuple(TOOLS)
    none = tool_request(TOOLS, "none", None, ToolSettings())
    assert (none.plan, none.template_tools) == (None, tuple(TOOLS))
    required = tool_request(TOOLS, "required", False, ToolSettings())
    schema = json.loads(required.structured.json)
    assert schema == {
        "type": "array",
        "minItems": 1,
        "maxItems": 1,
        "items": {
            "type": "object",
            "anyOf": [
                {
                    "properties": {"name": {"type": "string", "enum": [name]}, "parameters": parameters},
                    "required": ["name", "parameters"],
                }
                for name, parameters in (
                    ("get_weather", {"type": "object"}),
                    ("get_time", {"type": "object", "properties": {}}),
                )
            ],
        },
    }
    named = tool_request(TOOLS, {"type": "function", "function": {"name": "get_time"}}, None, ToolSettings())
    assert (named.plan.choice, named.plan.function, json.loads(named.structured.json)) == (
        "named",
        "get_time",
        {"type": "object", "properties": {}},
    )
    assert named.structured_field == "tools[1].function.parameters"
    with pytest.raises(ValueError, match="requires --tool-call-parser"):
        ToolSettings(True, "")


def test_arguments_being_written_are_not_rescanned():
    """Streaming a long call costs time linear in its length: while its arguments are written, each piece goes
    to the call's canonical stream alone; the parser re-reads the text only around the calls' beginnings."""
    code = 'print("x")\n' * 500
    text = "<tool_call>" + json.dumps({"name": "write", "arguments": {"path": "a.py", "code": code}}) + "</tool_call>"
    answer = ToolAnswer(ToolPlan("auto", parser_name="hermes"))
    scans = []
    scan = answer.parser.scan
    answer.parser.scan = lambda text: scans.append(len(text)) or scan(text)
    pieces = _split(text, 3)
    arguments = ""
    for k, piece in enumerate(pieces):
        delta, _ = answer.delta(piece, "stop" if k == len(pieces) - 1 else None)
        arguments += "".join(e["function"]["arguments"] for e in delta.get("tool_calls", ()))
    assert arguments == json.dumps({"path": "a.py", "code": code})
    assert len(pieces) > 2000 and len(scans) < 20, len(scans)
