"""OpenAI request bodies -> GenerationInput (the models and their errors: gateway/rest_models.py).

Body-level checks that run before the models (nesting depth, lone surrogates), then the parsed
model turned into what the request path takes. Fields nobody defines are ignored with a log line
naming them, as vLLM's server does (clients and harnesses send extension fields of other servers).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from splitserve.common.sampling_params import SamplingParams
from splitserve.gateway.errors import GatewayError, invalid
from splitserve.gateway.generation_input import ChatOptions, GenerationInput, build_sampling_params
from splitserve.gateway.rest_models import ChatCompletionRequest, CompletionRequest, validate
from splitserve.gateway.rest_structured import STRUCTURED_FIELDS, structured_output_of
from splitserve.gateway.rest_tools import ToolPlan, ToolRequest, ToolSettings, template_messages, tool_request

log = logging.getLogger("splitserve.gateway")
_MAX_LOGGED_FIELDS, _MAX_FIELD_NAME_CHARS = 10, 64


MAX_JSON_DEPTH = 32


def check_json_tree(body: Any) -> None:
    """400 when the parsed body nests deeper than MAX_JSON_DEPTH or holds a string with a lone
    UTF-16 surrogate (JSON's \\ud800 escape: not Unicode, cannot be tokenized or echoed).
    Errors name the top-level field the problem is in."""
    stack: list[tuple[Any, str, int]] = [(body, "body", 1)]
    while stack:
        value, field, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise invalid(
                f"{field} nests deeper than {MAX_JSON_DEPTH} levels; the request body may have at most "
                f"{MAX_JSON_DEPTH}",
                field,
            )
        if isinstance(value, dict):
            for key, item in value.items():
                _check_string(key, f"{field} has a key that", field)
                stack.append((item, (key or "body") if depth == 1 else field, depth + 1))  # "" names nothing
        elif isinstance(value, list):
            stack.extend((item, field, depth + 1) for item in value)
        elif isinstance(value, str):
            _check_string(value, field, field)


def _check_string(value: str, where: str, field: str) -> None:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise invalid(
            f"{where} contains a lone UTF-16 surrogate (\\u{ord(value[exc.start]):04x} at character "
            f"{exc.start}); strings must be valid Unicode",
            field,
        ) from None


@dataclass(frozen=True)
class RestRequest:
    """A parsed REST body: what to generate plus how to answer (stream, usage chunk)."""

    inp: GenerationInput
    stream: bool
    include_usage: bool
    logprobs: int | None  # completions: top-n; chat: top_logprobs when logprobs is true
    continuous_usage: bool = False  # stream_options.continuous_usage_stats: usage on every chunk
    more: tuple[GenerationInput, ...] = ()  # a batch of prompts: the ones after `inp` (choice i = prompt i)
    n: int = 1  # choices per prompt: choice i * n + j is prompt i's sequence j
    tools: ToolPlan | None = None  # chat with tools: how each choice's text is read (gateway/rest_tools.py)


def _log_ignored(names: list[str]) -> None:
    if names:
        shown = [k if len(k) <= _MAX_FIELD_NAME_CHARS else k[:_MAX_FIELD_NAME_CHARS] + "..." for k in names]
        more = f" (+{len(shown) - _MAX_LOGGED_FIELDS} more)" if len(shown) > _MAX_LOGGED_FIELDS else ""
        log.info("ignoring unknown request fields: %s%s", ", ".join(map(repr, shown[:_MAX_LOGGED_FIELDS])), more)


def _stream_flags(req: CompletionRequest | ChatCompletionRequest) -> tuple[bool, bool]:
    """(include_usage, continuous_usage_stats); as vLLM, continuous_usage_stats takes effect with include_usage."""
    options = req.stream_options
    include_usage = bool(options and options.include_usage)
    return include_usage, include_usage and bool(options.continuous_usage_stats)


def _params(values: dict[str, Any], max_stop_strings: int, renames: dict[str, str]) -> SamplingParams:
    """build_sampling_params, with messages and param naming the field the client sent."""
    try:
        return build_sampling_params(values, max_stop_strings)
    except GatewayError as exc:
        theirs = renames.get(exc.param or "")
        if theirs is not None and exc.message.startswith(exc.param):
            raise invalid(theirs + exc.message[len(exc.param) :], theirs) from None
        raise


def add_echo_values(values: dict[str, Any], echo: bool, logprobs: int | None) -> bool:
    """Completions' echo, as vLLM: with logprobs, the prompt's are computed too (prompt_logprobs = logprobs
    unless set); max_tokens 0 answers the prompt alone (one token is computed, then dropped). True then."""
    if echo and logprobs is not None:
        values.setdefault("prompt_logprobs", logprobs)
    if echo and values.get("max_tokens") == 0:
        values["max_tokens"] = 1
        return True
    return False


def _structured(req: CompletionRequest | ChatCompletionRequest, values: dict[str, Any]) -> str:
    """Put the request's structured output spec (if any) into `values`; the field it came from."""
    spec, field = structured_output_of({name: getattr(req, name) for name in STRUCTURED_FIELDS})
    if spec is not None:
        values["structured_output"] = spec
    return field


def parse_completion(body: Any, request_id: str, max_stop_strings: int) -> RestRequest:
    """POST /v1/completions body -> RestRequest; RequestValidationError when the body is invalid."""
    req: CompletionRequest = validate(CompletionRequest, body)
    _log_ignored(req.ignored_fields)
    values = req.sampling_values()
    if req.max_tokens is not None:
        values["max_tokens"] = req.max_tokens
    if req.prompt_logprobs is not None:
        values["prompt_logprobs"] = req.prompt_logprobs
    if req.logprobs is not None:
        values["logprobs"] = req.logprobs
    echo_only = add_echo_values(values, bool(req.echo), req.logprobs)
    structured_field = _structured(req, values)
    params = _params(values, max_stop_strings, {})
    inputs = [
        GenerationInput(
            request_id=request_id if i == 0 else f"{request_id}-{i}",
            model=req.model or "",
            params=params,
            max_tokens_param="max_tokens" if "max_tokens" in values else None,
            priority=req.priority or 0,
            add_special_tokens=req.add_special_tokens is not False,
            echo=bool(req.echo),
            echo_only=echo_only,
            structured_field=structured_field,
            n=req.n or 1,
            best_of=req.best_of,
            **({"text": prompt} if isinstance(prompt, str) else {"token_ids": prompt}),
        )
        for i, prompt in enumerate(req.prompt)
    ]
    include_usage, continuous = _stream_flags(req)
    return RestRequest(
        inputs[0], bool(req.stream), include_usage, params.logprobs, continuous, tuple(inputs[1:]), req.n or 1
    )


def _with_tools(req: ChatCompletionRequest, values: dict[str, Any], field: str, settings: ToolSettings) -> ToolRequest:
    """The request's tool plan; a required or named choice's grammar goes into `values` (with no other one)."""
    tools = tool_request(req.tools, req.tool_choice, req.parallel_tool_calls, settings)
    if tools.structured is not None:
        if "structured_output" in values:
            which = 'tool_choice "required"' if tools.plan.choice == "required" else "a named tool_choice"
            raise invalid(
                f"{which} constrains the answer to tool calls; it cannot be combined with {field.split('.')[0]}",
                "tool_choice",
            )
        values["structured_output"] = tools.structured
    if tools.keep_special_tokens:  # the parser's marker is a special token: it must stay in the text
        values["skip_special_tokens"] = False
    return tools


def parse_chat(
    body: Any, request_id: str, max_stop_strings: int, tool_settings: ToolSettings | None = None
) -> RestRequest:
    """POST /v1/chat/completions body -> RestRequest; RequestValidationError when the body is invalid."""
    req: ChatCompletionRequest = validate(ChatCompletionRequest, body)
    _log_ignored(req.ignored_fields)
    values = req.sampling_values()
    renames = {}
    if req.max_completion_tokens is not None:
        values["max_tokens"], renames["max_tokens"] = req.max_completion_tokens, "max_completion_tokens"
    elif req.max_tokens is not None:
        values["max_tokens"] = req.max_tokens
    if req.logprobs:
        values["logprobs"] = req.top_logprobs or 0
    if req.prompt_logprobs is not None:
        values["prompt_logprobs"] = req.prompt_logprobs
    max_tokens_param = renames.get("max_tokens", "max_tokens") if "max_tokens" in values else None
    values.setdefault("max_tokens", None)  # unset: up to the context, as vLLM's chat API (completions: 16)
    structured_field = _structured(req, values)
    tools = _with_tools(req, values, structured_field, tool_settings or ToolSettings())
    structured_field = tools.structured_field or structured_field
    params = _params(values, max_stop_strings, renames)
    extras = req.message_extras if any(req.message_extras) else ()
    if extras:
        fixed = template_messages([dict(extra, role=m.role) for extra, m in zip(extras, req.messages)])
        extras = tuple(tuple((k, v) for k, v in message.items() if k != "role") for message in fixed)
    inp = GenerationInput(
        request_id=request_id,
        model=req.model or "",
        params=params,
        chat=req.turns,
        max_tokens_param=max_tokens_param,
        priority=req.priority or 0,
        structured_field=structured_field,
        n=req.n or 1,
        best_of=req.best_of,
        chat_options=ChatOptions(
            add_generation_prompt=req.add_generation_prompt is not False,
            continue_final_message=bool(req.continue_final_message),
            template_kwargs=tuple(sorted((req.chat_template_kwargs or {}).items())),
            tools=tools.template_tools,
            message_extras=extras,
        ),
    )
    include_usage, continuous = _stream_flags(req)
    return RestRequest(
        inp, bool(req.stream), include_usage, params.logprobs, continuous, n=req.n or 1, tools=tools.plan
    )
