"""Tool calling through the real gateway and the official openai client, over the fake prefill and decode.

The tokenizer here puts a Hermes tool call's words right after the role words, so the fakes (which generate
id + 1, id + 2, ... after the prompt's last token "assistant" = 5) answer a chat with the canned text

    " hello world <tool_call> {"name": "get_weather", "arguments": {"city": "Paris"}} </tool_call>"

in 9 tokens: the hermes parser reads it as content " hello world " and one call.
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.gateway_fakes import SPECIAL, VOCAB_SIZE, FakeDecode, FakePrefill, Stack

ROLE_WORDS = ["user", "system", "assistant", "hello", "world"]
CANNED = ["<tool_call>", '{"name":', '"get_weather",', '"arguments":', '{"city":', '"Paris"}}', "</tool_call>"]
TEMPLATE_WORDS = ["tool", "get_weather", "get_time"]
TEMPLATE = (
    "{% for t in tools or [] %}tool {{ t['function']['name'] }} {% endfor %}"
    "{% for m in messages %}{{ m['role'] }} {{ m['content'] }} "
    "{% for c in m['tool_calls'] or [] %}{{ c['function']['name'] }} {% endfor %}{% endfor %}"
    "{% if add_generation_prompt %}assistant{% endif %}"
)
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "the weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    },
    {"type": "function", "function": {"name": "get_time"}},
]
MESSAGES = [{"role": "user", "content": "hello"}]
NUM_TOKENS = 2 + len(CANNED)


def make_tool_tokenizer(path: str) -> str:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = SPECIAL + ROLE_WORDS + CANNED + TEMPLATE_WORDS
    words += [f"w{i}" for i in range(len(words), VOCAB_SIZE)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.chat_template = TEMPLATE
    fast.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    return make_tool_tokenizer(str(tmp_path_factory.mktemp("tool-tokenizer")))


@pytest.fixture(scope="module")
def stack(tokenizer_dir):
    overrides = {"enable_auto_tool_choice": True, "tool_call_parser": "hermes"}
    stack = Stack(tokenizer_dir, [FakePrefill()], [FakeDecode()], overrides).start()
    yield stack
    stack.stop()


@pytest.fixture(scope="module")
def client(stack):
    return openai.OpenAI(base_url=stack.base_url + "/v1", api_key="unused", max_retries=0)


def test_auto_tool_call_non_streamed(client):
    r = client.chat.completions.create(model="tiny-fake", messages=MESSAGES, tools=TOOLS, max_tokens=NUM_TOKENS)
    choice = r.choices[0]
    assert (choice.finish_reason, choice.message.role, choice.message.content) == (
        "tool_calls",
        "assistant",
        " hello world ",
    )
    [call] = choice.message.tool_calls
    assert (call.type, call.function.name, call.function.arguments) == ("function", "get_weather", '{"city": "Paris"}')
    assert call.id.startswith("chatcmpl-tool-") and len(call.id) == 46
    # the template rendered both tools ("tool get_weather tool get_time") before "user hello assistant"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (4 + 3, NUM_TOKENS)


def test_auto_tool_call_streamed_as_openai_streams_it(client):
    chunks = list(
        client.chat.completions.create(
            model="tiny-fake", messages=MESSAGES, tools=TOOLS, max_tokens=NUM_TOKENS, stream=True
        )
    )
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    content = "".join(d.content or "" for d in deltas)
    tool_deltas = [t for d in deltas for t in d.tool_calls or ()]
    first, rest = tool_deltas[0], tool_deltas[1:]
    assert (first.index, first.type, first.function.name, first.function.arguments) == (
        0,
        "function",
        "get_weather",
        "",
    )
    assert first.id.startswith("chatcmpl-tool-")
    assert all(t.index == 0 and t.id is None and t.function.name is None for t in rest)
    assert len(rest) >= 2  # the arguments arrive in fragments, as the model writes them
    assert "".join(t.function.arguments for t in rest) == '{"city": "Paris"}'
    assert content == " hello world "
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"


def test_history_with_calls_renders_and_none_answers_plain(client):
    history = [
        *MESSAGES,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "world"},
    ]
    r = client.chat.completions.create(
        model="tiny-fake", messages=history, tools=TOOLS, tool_choice="none", max_tokens=2
    )
    # "tool get_weather tool get_time user hello assistant  get_time tool world assistant"
    assert (r.choices[0].message.content, r.choices[0].finish_reason) == (" hello world", "length")
    assert r.choices[0].message.tool_calls is None
    assert r.usage.prompt_tokens == 4 + 2 + 2 + 2 + 1
    with pytest.raises(openai.BadRequestError) as info:
        bad = [
            history[0],
            {
                **history[1],
                "tool_calls": [{**history[1]["tool_calls"][0], "function": {"name": "get_time", "arguments": "{oops"}}],
            },
        ]
        client.chat.completions.create(model="tiny-fake", messages=bad, max_tokens=2)
    assert info.value.body["message"] == "messages[1].tool_calls[0].function.arguments is not valid JSON"
    with pytest.raises(openai.BadRequestError) as info:
        bad = [history[0], {**history[1], "tool_calls": [{"id": "c1", "function": "get_time"}]}]
        client.chat.completions.create(model="tiny-fake", messages=bad, max_tokens=2)
    assert info.value.body["message"] == "messages[1].tool_calls[0] must have a function with a string name"


def test_auto_needs_the_flags(tokenizer_dir):
    stack = Stack(tokenizer_dir, [FakePrefill()], [FakeDecode()]).start()
    try:
        plain = openai.OpenAI(base_url=stack.base_url + "/v1", api_key="unused", max_retries=0)
        with pytest.raises(openai.BadRequestError) as info:
            plain.chat.completions.create(model="tiny-fake", messages=MESSAGES, tools=TOOLS, max_tokens=2)
        assert (info.value.status_code, info.value.body["message"], info.value.body["param"]) == (
            400,
            '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set',
            "tool_choice",
        )
        r = plain.chat.completions.create(
            model="tiny-fake", messages=MESSAGES, tools=TOOLS, tool_choice="none", max_tokens=2
        )
        assert r.choices[0].message.content == " hello world"
    finally:
        stack.stop()


def test_required_and_named_choices_send_their_grammar(stack, client):
    """required and named choices reach the engine as vLLM's JSON-schema constraint (the fakes ignore it: their
    answer is then no JSON array, and comes back as content, with no call).

    Two differences from vLLM on purpose. (1) Whitespace: only json.dumps' separators (disable_any_whitespace),
    where vLLM's grammar admits any: a weak model (the default one) then spent its whole max_tokens on spaces
    and its arguments never parsed. (2) vLLM 0.32, with a parser that has an xgrammar structural tag (hermes,
    among others) and VLLM_ENFORCE_STRICT_TOOL_CALLING on (its default), forces only the parser's envelope
    (`<tool_call>{"name": ..., "arguments": ...}</tool_call>`) and leaves the arguments free unless a tool says
    strict: true; the default model then answers arguments "get_foré()". Ours always constrains the arguments
    to the tool's schema (vLLM's JSON-schema route, which it takes with that variable off)."""
    body = {"model": "tiny-fake", "messages": MESSAGES, "tools": TOOLS, "max_tokens": 2}
    r = client.chat.completions.with_raw_response.create(**body, tool_choice="required", parallel_tool_calls=False)
    answer = json.loads(r.text)
    assert answer["choices"][0]["message"] == {"role": "assistant", "content": " hello world"}  # no call, no field
    assert answer["choices"][0]["finish_reason"] == "length"
    sent = stack.prefills[0].requests[-1].sampling.structured_output
    weather = TOOLS[0]["function"]["parameters"]
    assert sent.disable_any_whitespace
    assert json.loads(sent.json_schema) == {
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
                for name, parameters in (("get_weather", weather), ("get_time", {"type": "object", "properties": {}}))
            ],
        },
    }
    named = {"type": "function", "function": {"name": "get_weather"}}
    r = client.chat.completions.create(**body, tool_choice=named)
    [call] = r.choices[0].message.tool_calls
    assert (call.function.name, call.function.arguments, r.choices[0].finish_reason) == (
        "get_weather",
        " hello world",
        "length",
    )
    assert json.loads(stack.prefills[0].requests[-1].sampling.structured_output.json_schema) == weather
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(**body, tool_choice=named, response_format={"type": "json_object"})
    assert info.value.body["message"] == (
        "a named tool_choice constrains the answer to tool calls; it cannot be combined with response_format"
    )


# -- the Responses API's function calls (its text answers: tests/gateway/test_gateway_responses.py) --

RESPONSE_TOOLS = [{"type": "function", **tool["function"]} for tool in TOOLS]


def test_function_call_response(client):
    r = client.responses.create(
        model="tiny-fake", input="hello", tools=RESPONSE_TOOLS, max_output_tokens=2 + len(CANNED)
    )
    message, call = r.output
    assert (message.type, message.content[0].text) == ("message", " hello world ")
    assert (call.type, call.name, call.arguments, call.status) == (
        "function_call",
        "get_weather",
        '{"city": "Paris"}',
        "completed",
    )
    assert call.call_id.startswith("chatcmpl-tool-") and call.id.startswith("fc_")
    assert [t.name for t in r.tools] == ["get_weather", "get_time"] and r.tool_choice == "auto"


def test_function_call_streamed(client):
    events = list(
        client.responses.create(
            model="tiny-fake", input="hello", tools=RESPONSE_TOOLS, max_output_tokens=2 + len(CANNED), stream=True
        )
    )
    kinds = [e.type for e in events]
    first_call = kinds.index("response.output_item.added", kinds.index("response.output_item.done"))
    text_start = [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[:4] == text_start and kinds[first_call - 1] == "response.output_item.done"
    added = events[first_call].item
    assert (added.type, added.name, added.arguments, added.status) == (
        "function_call",
        "get_weather",
        "",
        "in_progress",
    )
    fragments = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert len(fragments) >= 2 and "".join(fragments) == '{"city": "Paris"}'
    assert kinds[-3:] == ["response.function_call_arguments.done", "response.output_item.done", "response.incomplete"]
    final = events[-1].response
    assert [o.type for o in final.output] == ["message", "function_call"]
    assert final.output[1].arguments == '{"city": "Paris"}' and final.output[1].call_id == added.call_id
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == " hello world "


def test_function_call_output_turns(client):
    r = client.responses.create(
        model="tiny-fake",
        input=[
            {"role": "user", "content": "hello"},
            {"type": "function_call", "call_id": "c1", "name": "get_time", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "world"},
        ],
        tools=RESPONSE_TOOLS,
        tool_choice="none",
        max_output_tokens=2,
    )
    # "tool get_weather tool get_time user hello assistant  get_time tool world assistant"
    assert (r.usage.input_tokens, r.output_text) == (4 + 2 + 2 + 2 + 1, " hello world")


def test_raw_function_call_bodies_validate(client):
    from openai.types.responses import Response, ResponseStreamEvent
    from pydantic import TypeAdapter

    url = str(client.base_url).rstrip("/") + "/responses"
    body = {"model": "tiny-fake", "input": "hello", "tools": RESPONSE_TOOLS, "max_output_tokens": 2 + len(CANNED)}
    response = Response.model_validate(httpx.post(url, json=body).json())
    assert [o.type for o in response.output] == ["message", "function_call"]
    with httpx.stream("POST", url, json={**body, "stream": True}) as r:
        datas = [line[len("data: ") :] for line in r.iter_lines() if line.startswith("data: ")]
    adapter = TypeAdapter(ResponseStreamEvent)
    assert [adapter.validate_json(d).type for d in datas][-1] == "response.incomplete"
