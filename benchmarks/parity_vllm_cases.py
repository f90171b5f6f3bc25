"""The requests parity_vllm_api.py sends to both servers, and the known differences (kind pattern -> the test
that documents ours)."""

from __future__ import annotations

from dataclasses import dataclass, field

from parity_vllm import NAME

FORECAST = {
    "type": "object",
    "properties": {"unit": {"enum": ["celsius", "fahrenheit"]}, "days": {"enum": [1, 2, 3]}},
    "required": ["unit", "days"],
    "additionalProperties": False,
}
ALERTS = {
    "type": "object",
    "properties": {"severe": {"type": "boolean"}},
    "required": ["severe"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_forecast", "description": "a forecast", "parameters": FORECAST}},
    {"type": "function", "function": {"name": "get_alerts", "parameters": ALERTS}},
]
RESPONSES_TOOLS = [{"type": "function", **tool["function"]} for tool in TOOLS]
HERMES_CALL = (
    r'<tool_call>\n\{"name": "get_forecast", "arguments": '
    r'\{"unit": "(celsius|fahrenheit)", "days": [123]\}\}\n</tool_call>'
)
CHAT = [{"role": "user", "content": "What is the weather like?"}]
USAGE = {"stream_options": {"include_usage": True}}


@dataclass(frozen=True)
class Case:
    """One request: `kind` names its row; `raw` is a body sent as is (not JSON)."""

    kind: str
    path: str
    body: dict = field(default_factory=dict)
    method: str = "POST"
    stream: bool = False
    raw: str | None = None


def _both(kind: str, path: str, body: dict) -> list[Case]:
    """The request non-streamed and streamed (chat and completions streams ask for usage)."""
    extra = USAGE if path != "/v1/responses" else {}
    return [Case(kind, path, body), Case(f"{kind}, streamed", path, {**body, "stream": True, **extra}, stream=True)]


def cases() -> list[Case]:
    greedy = {"model": NAME, "temperature": 0}
    chat = {**greedy, "messages": CHAT, "max_tokens": 24}
    tools = {**chat, "tools": TOOLS, "max_tokens": 60}
    named = {"type": "function", "function": {"name": "get_forecast"}}
    responses = {**greedy, "input": "What is the weather like?", "max_output_tokens": 24}
    schema = {"type": "json_schema", "name": "alerts", "schema": ALERTS, "strict": True}
    out = [
        *_both("completion", "/v1/completions", {**greedy, "prompt": "def fibonacci(n):", "max_tokens": 16}),
        Case(
            "completion streamed, no usage",
            "/v1/completions",
            {**greedy, "prompt": "import os", "max_tokens": 8, "stream": True},
            stream=True,
        ),
        *_both("chat", "/v1/chat/completions", chat),
        *_both("chat stop string", "/v1/chat/completions", {**chat, "stop": ["."]}),
        *_both("tools, tool_choice none", "/v1/chat/completions", {**tools, "tool_choice": "none"}),
        *_both("tools, tool_choice auto (no call written)", "/v1/chat/completions", {**tools, "tool_choice": "auto"}),
        *_both(
            "tools, auto, a Hermes call forced by regex",
            "/v1/chat/completions",
            {**tools, "max_tokens": 200, "structured_outputs": {"regex": HERMES_CALL}},
        ),
        *_both("tools, tool_choice required", "/v1/chat/completions", {**tools, "tool_choice": "required"}),
        Case(
            "tools, required, parallel_tool_calls false",
            "/v1/chat/completions",
            {**tools, "tool_choice": "required", "parallel_tool_calls": False},
        ),
        *_both("tools, tool_choice named", "/v1/chat/completions", {**tools, "tool_choice": named}),
        *_both("responses", "/v1/responses", responses),
        Case("responses instructions", "/v1/responses", {**responses, "instructions": "Answer briefly."}),
        *_both("responses text.format json_schema", "/v1/responses", {**responses, "text": {"format": schema}}),
        Case("responses tools (auto, no call written)", "/v1/responses", {**responses, "tools": RESPONSES_TOOLS}),
        Case("responses store true", "/v1/responses", {**responses, "store": True}),
        Case("/v1/models", "/v1/models", method="GET"),
        Case("/tokenize prompt", "/tokenize", {"model": NAME, "prompt": "def fibonacci(n):"}),
        Case("/tokenize messages", "/tokenize", {"model": NAME, "messages": CHAT}),
        Case(
            "/tokenize no special tokens", "/tokenize", {"model": NAME, "messages": CHAT, "add_special_tokens": False}
        ),
        Case("/detokenize", "/detokenize", {"model": NAME, "tokens": [2314, 5200, 202]}),
    ]
    return out + error_cases(greedy, chat, tools)


def error_cases(greedy: dict, chat: dict, tools: dict) -> list[Case]:
    completion = {**greedy, "prompt": "def fibonacci(n):", "max_tokens": 8}
    other = {"type": "function", "function": {"name": "not_a_tool"}}
    return [
        Case("error: max_tokens -1", "/v1/completions", {**completion, "max_tokens": -1}),
        Case("error: temperature -1", "/v1/completions", {**completion, "temperature": -1}),
        Case("error: n 0", "/v1/completions", {**completion, "n": 0}),
        Case("error: unknown model", "/v1/completions", {**completion, "model": "not-served"}),
        Case("error: prompt longer than the context", "/v1/completions", {**completion, "prompt": "hi " * 1100}),
        Case("error: max_tokens past the context", "/v1/completions", {**completion, "max_tokens": 5000}),
        Case("error: body not JSON", "/v1/completions", raw="{not json"),
        Case("error: chat without messages", "/v1/chat/completions", {**greedy, "max_tokens": 8}),
        Case("error: chat top_logprobs 50", "/v1/chat/completions", {**chat, "logprobs": True, "top_logprobs": 50}),
        Case(
            "error: chat unknown role", "/v1/chat/completions", {**chat, "messages": [{"role": "x", "content": "hi"}]}
        ),
        Case("error: named tool not in tools", "/v1/chat/completions", {**tools, "tool_choice": other}),
        Case("error: tool_choice required without tools", "/v1/chat/completions", {**chat, "tool_choice": "required"}),
        Case(
            "error: responses previous_response_id",
            "/v1/responses",
            {**greedy, "input": "hi", "previous_response_id": "resp_0123456789abcdef"},
        ),
        Case(
            "error: responses max_output_tokens 0", "/v1/responses", {**greedy, "input": "hi", "max_output_tokens": 0}
        ),
        Case("error: /tokenize without a prompt", "/tokenize", {"model": NAME}),
        Case("error: /detokenize id past the vocabulary", "/detokenize", {"model": NAME, "tokens": [999999]}),
    ]


_DIFFS = "tests/gateway/test_vllm_differences.py::"
_RESPONSE_FIELDS = (
    r"(output\[\d+\]\.status|\.item\.status|logprobs|\.(body|folded|response)\.(text|store)\b|_penalty|_per_turn"
    r"|tool_output_tokens)"
)
_FORCED_TOOLS = r"^tools, (tool_choice required|required, parallel|tool_choice named).* \| "
# a pattern searched in "KIND | PATH: OURS != VLLM" -> why ours differs, and the test that asserts ours
KNOWN: dict[str, str] = {
    r"\.system_fingerprint: <absent>": "vLLM's names its build; we have none to give: "
    f"{_DIFFS}test_usage_always_has_cached_tokens_and_no_system_fingerprint",
    r"prompt_tokens_details": "always sent, as OpenAI does (vLLM: under --enable-prompt-tokens-details): same test",
    r"\.error\.(type|code): ": "OpenAI's error type and code (vLLM: class names, the status again): "
    f"{_DIFFS}test_errors_have_openais_type_and_name_the_field",
    r"^error: .*\.error\.param: ": "param is the top-level field sent (vLLM: pydantic locations or none): same "
    "test and test_a_body_that_is_not_json_names_the_body",
    r"^error: /detokenize": "an id past the vocabulary is refused (vLLM: 200, empty text): "
    f"{_DIFFS}test_detokenize_refuses_ids_past_the_vocabulary",
    r"^/v1/models \| ": "owned_by ours, root the model id (no server path), no permission list: "
    f"{_DIFFS}test_models_list_is_ours",
    rf"^responses.* \| \S*{_RESPONSE_FIELDS}": "OpenAI's Response object (vLLM: message status completed when cut, "
    f"logprobs null, no text/store echo; its own extras): {_DIFFS}test_responses_follow_openais_response_object",
    r'^responses.* \| \.kinds\[\d+\]: "response\.incomplete" != "response\.completed"': "a cut response ends with "
    "OpenAI's response.incomplete event (vLLM: response.completed): "
    "tests/gateway/test_gateway_responses.py::test_streamed_events",
    _FORCED_TOOLS: "arguments forced to the schema, json.dumps spacing (vLLM 0.32 + hermes: the <tool_call> "
    "envelope only, arguments free; with VLLM_ENFORCE_STRICT_TOOL_CALLING=0 its schema admits any whitespace and "
    "the default model spends max_tokens on it), so the texts differ: "
    "tests/gateway/test_gateway_tools.py::test_required_and_named_choices_send_their_grammar",
    r"^/metrics \| vllm:\w+: <absent> != ": "vLLM 0.32 families not exported (list and why): "
    "tests/runtime/test_metric_families.py::test_vllm_families_and_labels_differ_from_vllm_032_as_listed",
    r"^/metrics \| vllm:\w+: \(": "label instance (the process) where vLLM has engine (its index); 5 of "
    "cache_config_info's labels: same test",
}
