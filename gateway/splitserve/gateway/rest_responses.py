"""POST /v1/responses bodies (OpenAI's Responses API) -> the chat request they describe.

    input                  a string (one user turn) or a list of items: messages ({"role", "content": a string
                           or input_text / output_text parts}), function_call and function_call_output items
    instructions           a system turn before the input
    max_output_tokens      max_tokens;  temperature, top_p (and vLLM's top_k, seed, stop, ...) as on chat
    tools, tool_choice     function tools ({"type": "function", "name", "parameters"}), as chat's tool calling
    text.format            {"type": "text" | "json_object" | "json_schema", "name", "schema"}: structured output
    stream                 the semantic server-sent events (gateway/rest_responses_answers.py)

The service is stateless, as vLLM's is by default: `store: true` is served and nothing is kept (the
response says store false), a `previous_response_id` is not found (404, param response_id, as vLLM answers),
and any other field that needs stored state or a built-in tool is refused (400 naming the field). The body
becomes a chat body and goes through the chat path, so every check and error of chat applies; an error about
a chat field is reported under the Responses field it came from.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from fastapi.exceptions import RequestValidationError

from splitserve.gateway.errors import GatewayError, invalid
from splitserve.gateway.rest_params import RestRequest, parse_chat
from splitserve.gateway.rest_tools import ToolSettings

log = logging.getLogger("splitserve.gateway")

# fields of the Responses API this stateless server refuses -> the values that change nothing
# (`store` is not among them: true is ignored, as vLLM ignores it while its store is off, since clients send
# OpenAI's default store=true without meaning to keep anything; a `previous_response_id` is answered 404)
_REFUSED = {
    "conversation": (),
    "background": (False,),
    "prompt": (),
    "include": ([],),
    "max_tool_calls": (),
    "reasoning": (),
}
# vLLM's sampling extensions, taken here as on chat
_VLLM_SAMPLING = (
    "top_k",
    "min_p",
    "seed",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "repetition_penalty",
    "frequency_penalty",
    "presence_penalty",
    "logit_bias",
    "priority",
)
_KNOWN = {
    *_VLLM_SAMPLING,
    "model",
    "input",
    "instructions",
    "max_output_tokens",
    "temperature",
    "top_p",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "text",
    "stream",
    "stream_options",
    "metadata",
    "user",
    "truncation",
    "service_tier",
    "safety_identifier",
    "prompt_cache_key",
    *_REFUSED,
    "store",
    "previous_response_id",
}
# chat field -> the Responses field it came from (errors name the client's field)
_FIELD_NAMES = {
    "max_tokens": "max_output_tokens",
    "response_format": "text",
    "messages": "input",
    "stream_options": "stream_options",
}
_TEXT_FORMATS = ("text", "json_object", "json_schema")


@dataclass(frozen=True)
class ResponsesRequest(RestRequest):
    """A parsed Responses body: the chat request, and what the response object repeats of the request."""

    echo: dict[str, Any] = field(default_factory=dict)


def parse_responses(
    body: Any, request_id: str, max_stop_strings: int, tool_settings: ToolSettings | None = None
) -> ResponsesRequest:
    """A POST /v1/responses body -> ResponsesRequest; GatewayError (400) naming the field when refused."""
    if not isinstance(body, dict):
        raise invalid(f"request body must be a JSON object, got {type(body).__name__}", "body")
    for name, neutral in _REFUSED.items():
        value = body.get(name)
        if value is not None and not any(type(value) is type(v) and value == v for v in neutral):
            raise invalid(
                f"{name} is not supported: this server keeps no responses (stateless), so it cannot store "
                f"one or continue one; remove {name}",
                name,
            )
    previous = body.get("previous_response_id")
    if previous is not None:
        raise GatewayError(
            "not_found",
            f"Response with id '{str(previous)[:200]}' not found: this server keeps no responses (stateless); "
            "send the whole conversation as input",
            param="response_id",
        )
    chat: dict[str, Any] = {"messages": _messages(body.get("input"), body.get("instructions"))}
    for name in ("model", "temperature", "top_p", "user", *_VLLM_SAMPLING):
        if body.get(name) is not None:
            chat[name] = body[name]
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    if body.get("stream") is not None:
        chat["stream"] = body["stream"]
    if body.get("stream"):
        chat["stream_options"] = {"include_usage": True}
    if body.get("tools") is not None:
        chat["tools"] = _tools(body["tools"])
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = _tool_choice(body["tool_choice"])
    if body.get("parallel_tool_calls") is not None:
        chat["parallel_tool_calls"] = body["parallel_tool_calls"]
    text_format = _text_format(body.get("text"))
    if text_format is not None:
        chat["response_format"] = text_format
    try:
        req = parse_chat(chat, request_id, max_stop_strings, tool_settings)
    except GatewayError as exc:
        raise _renamed(exc) from None
    except RequestValidationError as exc:  # the chat model's refusal: its first error, as the app answers it
        first = exc.errors()[0]
        raise _renamed(invalid(first["msg"], str(first["loc"][0]) if first["loc"] else "body")) from None
    ignored = sorted(k for k in body if k not in _KNOWN)
    if ignored:
        log.info("ignoring unknown request fields: %s", ", ".join(repr(k[:64]) for k in ignored[:10]))
    return ResponsesRequest(**{f: getattr(req, f) for f in RestRequest.__dataclass_fields__}, echo=_echo(body))


def _renamed(exc: GatewayError) -> GatewayError:
    theirs = _FIELD_NAMES.get(exc.param or "")
    if theirs is None:
        return exc
    message = theirs + exc.message[len(exc.param) :] if exc.message.startswith(exc.param) else exc.message
    return invalid(message, theirs)


def _messages(items: Any, instructions: Any) -> list[dict]:
    messages: list[dict] = []
    if instructions is not None:
        if not isinstance(instructions, str):
            raise invalid(f"instructions must be a string, got {type(instructions).__name__}", "instructions")
        messages.append({"role": "system", "content": instructions})
    if isinstance(items, str):
        return [*messages, {"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise invalid("input must be a string or a non-empty list of input items", "input")
    for i, item in enumerate(items):
        message = _message(item, f"input[{i}]", messages)
        if message is not None:
            messages.append(message)
    return messages


def _message(item: Any, where: str, messages: list[dict]) -> dict | None:
    """One input item as a chat turn; a function_call joins the assistant turn just before it."""
    if not isinstance(item, dict):
        raise invalid(f"{where} must be an object, got {type(item).__name__}", "input")
    kind = item.get("type", "message")
    if kind == "message":
        role, content = item.get("role"), item.get("content")
        if isinstance(content, list):
            parts = []
            for j, part in enumerate(content):
                if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text", "text"):
                    raise invalid(f"{where}.content[{j}] must be an input_text part (only text is served)", "input")
                parts.append(part.get("text"))
            if not all(isinstance(p, str) for p in parts):
                raise invalid(f"{where}.content parts must each have a string text", "input")
            content = "".join(parts)
        return {"role": role, "content": content}
    if kind == "function_call":
        for key in ("call_id", "name", "arguments"):
            if not isinstance(item.get(key), str):
                raise invalid(f"{where}.{key} must be a string", "input")
        call = {
            "id": item["call_id"],
            "type": "function",
            "function": {"name": item["name"], "arguments": item["arguments"]},
        }
        last = messages[-1] if messages else None
        if last is not None and last.get("role") == "assistant" and "tool_calls" in last:
            last["tool_calls"].append(call)
            return None
        return {"role": "assistant", "content": None, "tool_calls": [call]}
    if kind == "function_call_output":
        if not isinstance(item.get("call_id"), str) or not isinstance(item.get("output"), str):
            raise invalid(f"{where} must have a string call_id and a string output", "input")
        return {"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]}
    raise invalid(
        f"{where}.type {kind!r} is not served; use message, function_call or function_call_output"[:300], "input"
    )


def _tools(tools: Any) -> list:
    if not isinstance(tools, list):
        raise invalid(f"tools must be a list of function tools, got {type(tools).__name__}", "tools")
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else type(tool).__name__
            raise invalid(f"tools[{i}] is a {kind!r} tool; only function tools are served"[:300], "tools")
        function = {k: tool[k] for k in ("name", "description", "parameters") if tool.get(k) is not None}
        out.append({"type": "function", "function": function})
    return out


def _tool_choice(choice: Any) -> Any:
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice


def _text_format(text: Any) -> dict | None:
    if text is None:
        return None
    if not isinstance(text, dict):
        raise invalid(f"text must be an object with a format, got {type(text).__name__}", "text")
    spec = text.get("format")
    if spec is None:
        return None
    if not isinstance(spec, dict) or spec.get("type") not in _TEXT_FORMATS:
        raise invalid(f"text.format.type must be one of {', '.join(_TEXT_FORMATS)}", "text")
    if spec["type"] != "json_schema":
        return {"type": spec["type"]}
    if not isinstance(spec.get("name"), str) or spec.get("schema") is None:
        raise invalid("text.format needs a string name and a schema when its type is json_schema", "text")
    return {"type": "json_schema", "json_schema": {"name": spec["name"], "schema": spec["schema"]}}


def _given(body: dict, name: str, default: float) -> Any:
    """A sampling value as the request gave it, else the default the engine applies (as vLLM echoes it)."""
    value = body.get(name)
    return default if value is None else value


def _echo(body: dict) -> dict[str, Any]:
    """The request's values the response object repeats (OpenAI's Response fields)."""
    text = body.get("text") if isinstance(body.get("text"), dict) else {}
    return {
        "background": False,
        "instructions": body.get("instructions"),
        "max_output_tokens": body.get("max_output_tokens"),
        "metadata": body.get("metadata"),
        "parallel_tool_calls": body.get("parallel_tool_calls", True),
        "previous_response_id": None,
        "reasoning": None,
        "store": False,
        "service_tier": "auto",
        "temperature": _given(body, "temperature", 1.0),
        "text": {"format": text.get("format") or {"type": "text"}},
        "tool_choice": body.get("tool_choice") or ("auto" if body.get("tools") else "none"),
        "tools": body.get("tools") or [],
        "top_p": _given(body, "top_p", 1.0),
        "truncation": body.get("truncation") or "disabled",
        "user": body.get("user"),
    }
