"""OpenAI request bodies -> GenerationInput, with errors that name the offending field.

Plain dict validation: OpenAI parameters splitserve does not implement (sent with a value that
would change the answer), wrong types and out-of-range values are HTTP 400 with the field in the
message and in the error's "param". Fields nobody defines are ignored with a log line naming them,
as vLLM's server does (clients and harnesses send extension fields of other servers).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from splitserve.common.sampling_params import MAX_LOGPROBS, SamplingParams
from splitserve.gateway.errors import GatewayError, invalid
from splitserve.gateway.service import ChatOptions, GenerationInput, build_sampling_params

# Request fields passed to SamplingParams under the same name.
_SAMPLING_FIELDS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "seed",
    "stop",
    "ignore_eos",
    "min_tokens",
    "stop_token_ids",
    "include_stop_str_in_output",
    "skip_special_tokens",
)
_COMMON_FIELDS = frozenset(_SAMPLING_FIELDS) | {
    "model",
    "max_tokens",
    "stream",
    "stream_options",
    "n",
    "user",
    "priority",
}
COMPLETION_FIELDS = _COMMON_FIELDS | {"prompt", "logprobs", "add_special_tokens"}
# vLLM's chat template fields: add_generation_prompt, continue_final_message, chat_template_kwargs
CHAT_FIELDS = _COMMON_FIELDS | {
    "messages",
    "max_completion_tokens",
    "logprobs",
    "top_logprobs",
    "add_generation_prompt",
    "continue_final_message",
    "chat_template_kwargs",
}
log = logging.getLogger("splitserve.gateway")
_MAX_LOGGED_FIELDS, _MAX_FIELD_NAME_CHARS = 10, 64
_CHAT_ROLES = ("system", "user", "assistant", "developer", "tool")
# OpenAI parameters splitserve does not implement -> the values that mean "not used" (also null).
_UNSUPPORTED_COMMON = {"logit_bias": ({},), "service_tier": ("auto", "default"), "store": (False,), "metadata": ({},)}
UNSUPPORTED_COMPLETION = {**_UNSUPPORTED_COMMON, "best_of": (1,), "echo": (False,), "suffix": ("",)}
UNSUPPORTED_CHAT = {
    **_UNSUPPORTED_COMMON,
    "tools": ([],),
    "tool_choice": ("none",),
    "functions": ([],),
    "function_call": ("none",),
    "response_format": ({"type": "text"},),
    "parallel_tool_calls": (True, False),
    "audio": (),
    "modalities": (["text"],),
    "prediction": (),
    "reasoning_effort": (),
    "web_search_options": (),
}


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
                stack.append((item, key if depth == 1 else field, depth + 1))
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


def _check_fields(body: Any, allowed: frozenset[str], unsupported: dict[str, tuple]) -> dict[str, Any]:
    """The body as a dict; 400 naming an OpenAI parameter splitserve does not implement (sent with a
    value other than its neutral one: null, or the listed defaults); unknown fields are logged and ignored."""
    if not isinstance(body, dict):
        raise invalid(f"request body must be a JSON object, got {type(body).__name__}", "body")
    ignored = sorted(k for k in body if k not in allowed and k not in unsupported)
    if ignored:
        names = [k if len(k) <= _MAX_FIELD_NAME_CHARS else k[:_MAX_FIELD_NAME_CHARS] + "..." for k in ignored]
        more = f" (+{len(names) - _MAX_LOGGED_FIELDS} more)" if len(names) > _MAX_LOGGED_FIELDS else ""
        log.info("ignoring unknown request fields: %s%s", ", ".join(map(repr, names[:_MAX_LOGGED_FIELDS])), more)
    unknown = sorted(k for k in body if k in unsupported and not _is_neutral(body[k], unsupported[k]))
    if unknown:
        name = unknown[0]
        raise invalid(
            f"unsupported parameter: {name} (got {body[name]!r}); splitserve does not implement it, "
            f"remove it from the request",
            name,
        )
    return body


def _is_neutral(value: Any, neutral: tuple) -> bool:
    return value is None or any(type(value) is type(v) and value == v for v in neutral)


def _bool(body: dict, name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise invalid(f"{name} must be a boolean, got {value!r}", name)
    return value


def _optional_int(body: dict, name: str) -> int | None:
    value = body.get(name)
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
        raise invalid(f"{name} must be an integer, got {value!r}", name)
    return value


def _common(body: dict) -> tuple[dict[str, Any], bool, tuple[bool, bool]]:
    """Sampling values, stream, (include_usage, continuous_usage_stats); checks model, n and user.
    As vLLM, continuous_usage_stats (usage on every chunk) takes effect with include_usage."""
    if body.get("model") is not None and not isinstance(body["model"], str):
        raise invalid(f"model must be a string, got {body['model']!r}", "model")
    n = _optional_int(body, "n")
    if n is not None and n != 1:
        raise invalid(f"n must be 1 (one choice per request is supported), got {n}", "n")
    if body.get("user") is not None and not isinstance(body["user"], str):
        raise invalid(f"user must be a string, got {body['user']!r}", "user")
    stream = _bool(body, "stream", False)
    options = body.get("stream_options")
    include_usage = False
    if options is not None:
        if not isinstance(options, dict) or set(options) - {"include_usage", "continuous_usage_stats"}:
            raise invalid(f"stream_options must be an object with include_usage, got {options!r}", "stream_options")
        if not stream:
            raise invalid("stream_options is only allowed when stream is true", "stream_options")
        include_usage = _bool(options, "include_usage", False)
    continuous = include_usage and _bool(options or {}, "continuous_usage_stats", False)
    values = {name: body[name] for name in _SAMPLING_FIELDS if body.get(name) is not None}
    if isinstance(values.get("stop"), str):
        values["stop"] = [values["stop"]]
    return values, stream, (include_usage, continuous)


def _priority(body: dict) -> int:
    """vLLM's priority: lower runs first under the priority policy; an int32."""
    priority = _optional_int(body, "priority") or 0
    if not -(2**31) <= priority < 2**31:
        raise invalid(f"priority must be a 32-bit integer, got {priority}", "priority")
    return priority


def _params(values: dict[str, Any], max_stop_strings: int, renames: dict[str, str]) -> SamplingParams:
    """build_sampling_params, with messages and param naming the field the client sent."""
    try:
        return build_sampling_params(values, max_stop_strings)
    except GatewayError as exc:
        theirs = renames.get(exc.param or "")
        if theirs is not None and exc.message.startswith(exc.param):
            raise invalid(theirs + exc.message[len(exc.param) :], theirs) from None
        raise


MAX_PROMPTS = 64  # prompts in one completion request (each runs as a request of its own)


def _prompts(body: dict) -> list[dict[str, Any]]:
    """prompt: a string, a list of token ids, or a list of either (a batch: one choice per prompt)."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        if len(prompt) > MAX_PROMPTS:
            raise invalid(f"prompt holds {len(prompt)} prompts; at most {MAX_PROMPTS} per request", "prompt")
        return [_prompt(p) for p in prompt]
    return [_prompt(prompt)]


def _prompt(prompt: Any) -> dict[str, Any]:
    """One prompt: a string or a list of token ids."""
    if isinstance(prompt, str):
        return {"text": prompt}
    if isinstance(prompt, list):
        for token_id in prompt:
            if isinstance(token_id, bool) or not isinstance(token_id, int) or token_id < 0:
                raise invalid(f"prompt token ids must be non-negative integers, got {token_id!r}", "prompt")
        return {"token_ids": tuple(prompt)}
    if prompt is None:
        raise invalid("prompt is required", "prompt")
    raise invalid(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}", "prompt")


def parse_completion(body: Any, request_id: str, max_stop_strings: int) -> RestRequest:
    """POST /v1/completions body -> RestRequest."""
    body = _check_fields(body, COMPLETION_FIELDS, UNSUPPORTED_COMPLETION)
    values, stream, (include_usage, continuous) = _common(body)
    if body.get("max_tokens") is not None:
        values["max_tokens"] = body["max_tokens"]
    if body.get("logprobs") is not None:
        values["logprobs"] = body["logprobs"]
    params = _params(values, max_stop_strings, {})
    inputs = [
        GenerationInput(
            request_id=request_id if i == 0 else f"{request_id}-{i}",
            model=body.get("model") or "",
            params=params,
            max_tokens_param="max_tokens" if "max_tokens" in values else None,
            priority=_priority(body),
            add_special_tokens=_bool(body, "add_special_tokens", True),
            **prompt,
        )
        for i, prompt in enumerate(_prompts(body))
    ]
    return RestRequest(inputs[0], stream, include_usage, params.logprobs, continuous, tuple(inputs[1:]))


def messages_of(body: dict) -> tuple[tuple[str, str], ...]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise invalid("messages must be a non-empty list of {role, content} objects", "messages")
    turns = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise invalid(f"messages[{i}] must be an object with role and content", "messages")
        role, content = message.get("role"), message.get("content")
        if role not in _CHAT_ROLES:
            raise invalid(f"messages[{i}].role must be one of {', '.join(_CHAT_ROLES)}, got {role!r}", "messages")
        if isinstance(content, list):  # OpenAI content parts: only text parts are served
            if not all(
                isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content
            ):
                raise invalid(
                    f'messages[{i}].content parts must be text parts ({{"type": "text", "text": ...}})', "messages"
                )
            content = "".join(p["text"] for p in content)
        if content is None and role == "assistant":
            content = ""
        if not isinstance(content, str):
            raise invalid(
                f"messages[{i}].content must be a string or a list of text parts, got {content!r}", "messages"
            )
        turns.append((role, content))
    return tuple(turns)


def parse_chat(body: Any, request_id: str, max_stop_strings: int) -> RestRequest:
    """POST /v1/chat/completions body -> RestRequest."""
    body = _check_fields(body, CHAT_FIELDS, UNSUPPORTED_CHAT)
    values, stream, (include_usage, continuous) = _common(body)
    renames = {}
    if body.get("max_completion_tokens") is not None:
        values["max_tokens"], renames["max_tokens"] = body["max_completion_tokens"], "max_completion_tokens"
    elif body.get("max_tokens") is not None:
        values["max_tokens"] = body["max_tokens"]
    want_logprobs = _bool(body, "logprobs", False)
    top = _optional_int(body, "top_logprobs")
    if top is not None:
        if not want_logprobs:
            raise invalid("top_logprobs requires logprobs to be true", "top_logprobs")
        if not 0 <= top <= MAX_LOGPROBS:
            raise invalid(f"top_logprobs must be >= 0 and <= {MAX_LOGPROBS}, got {top}", "top_logprobs")
    if want_logprobs:
        values["logprobs"] = top or 0
    max_tokens_param = renames.get("max_tokens", "max_tokens") if "max_tokens" in values else None
    values.setdefault("max_tokens", None)  # unset: up to the context, as vLLM's chat API (completions: 16)
    params = _params(values, max_stop_strings, renames)
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise invalid(f"chat_template_kwargs must be an object, got {kwargs!r}", "chat_template_kwargs")
    inp = GenerationInput(
        request_id=request_id,
        model=body.get("model") or "",
        params=params,
        chat=messages_of(body),
        max_tokens_param=max_tokens_param,
        priority=_priority(body),
        chat_options=ChatOptions(
            add_generation_prompt=_bool(body, "add_generation_prompt", True),
            continue_final_message=_bool(body, "continue_final_message", False),
            template_kwargs=tuple(sorted((kwargs or {}).items())),
        ),
    )
    return RestRequest(inp, stream, include_usage, params.logprobs, continuous)
