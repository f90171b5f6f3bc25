"""The OpenAI request bodies as pydantic models, and their validation errors in OpenAI's shape.

The models check types and shapes (strict: a JSON number is no string, true is no integer) and
the limits of the fields this shim owns (n, top_logprobs, priority, prompt counts); the sampling
values' ranges stay with `SamplingParams`, which the gRPC API shares. Unknown fields are kept in
`model_extra` (logged and ignored by the caller, as vLLM does).

A failed validation becomes FastAPI's `RequestValidationError` whose first error carries the
message the client gets: the field's path, what it must be (with its limits) and what it got:

    {"type": "int_type", "loc": ("messages", 0, "role"), "msg": "messages[0].role must be ...", ...}

The REST app answers it with HTTP 400 (vLLM's server does the same for a validation error; FastAPI's
own default would be 422) and the error's first `loc` element as OpenAI's "param".
"""

from __future__ import annotations

import typing
from typing import Any, Literal

from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_core import PydanticCustomError

from splitserve.common.sampling_params import MAX_LOGPROBS, MAX_SEQUENCES
from splitserve.gateway.errors import GatewayError
from splitserve.gateway.generation_input import check_sequences
from splitserve.gateway.rest_structured import UNSUPPORTED_STRUCTURED

MAX_PROMPTS = 64  # prompts in one completion request (each runs as a request of its own)
CHAT_ROLES = ("system", "user", "assistant", "developer", "tool")
_INT32 = (-(2**31), 2**31 - 1)
_MAX_SHOWN_CHARS = 80  # a client's value quoted in a message is cut to this many characters

# OpenAI parameters splitserve does not implement -> the values that mean "not used" (also null).
_UNSUPPORTED_COMMON = {
    "service_tier": ("auto", "default"),
    "store": (False,),
    "metadata": ({},),
    **UNSUPPORTED_STRUCTURED,
}
UNSUPPORTED_COMPLETION = {**_UNSUPPORTED_COMMON, "suffix": ("",)}
UNSUPPORTED_CHAT = {
    **_UNSUPPORTED_COMMON,
    "functions": ([],),
    "function_call": ("none",),
    "audio": (),
    "modalities": (["text"],),
    "prediction": (),
    "reasoning_effort": (),
    "web_search_options": (),
}


def _custom(message: str, field: str | None = None, *, whole: bool = False) -> PydanticCustomError:
    """An error whose message is final but for its path: `field` (if any) is appended to the path
    of the object that failed, and the message follows it (`whole`: the message stands alone)."""
    kind = "splitserve_whole" if whole else "splitserve"
    return PydanticCustomError(kind, message, {"field": field} if field else None)


def _is_neutral(value: Any, neutral: tuple) -> bool:
    return value is None or any(type(value) is type(v) and value == v for v in neutral)


class _Body(BaseModel):
    """What every object of a request body shares: strict types, unknown fields kept aside."""

    model_config = ConfigDict(strict=True, extra="allow", frozen=True)


class StreamOptions(_Body):
    """OpenAI's stream_options and vLLM's continuous_usage_stats (usage on every chunk)."""

    model_config = ConfigDict(extra="forbid")
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None


class _Request(_Body):
    """The fields completions and chat share."""

    unsupported: typing.ClassVar[dict[str, tuple]] = _UNSUPPORTED_COMMON

    model: str | None = None
    max_tokens: int | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    n: int | None = Field(None, ge=1, le=MAX_SEQUENCES)
    best_of: int | None = Field(None, ge=1, le=MAX_SEQUENCES)
    user: str | None = None
    priority: int | None = Field(None, ge=_INT32[0], le=_INT32[1])
    # sampling values: types here, ranges in SamplingParams
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = Field(None, description="a list of strings")
    ignore_eos: bool | None = None
    min_tokens: int | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    logit_bias: dict[str, float] | None = None  # token id (a decimal string, as JSON keys are) -> bias
    # vLLM's extension: each prompt token's logprob (from the second on) plus this many alternatives
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    # structured output: read and checked by gateway/rest_structured.py (one spec, errors naming the field)
    response_format: Any = None
    structured_outputs: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None

    @field_validator("logit_bias")
    @classmethod
    def _token_id_keys(cls, bias: dict[str, float] | None) -> dict[int, float] | None:
        if bias is None:
            return None
        for key in bias:
            if not (key.isascii() and key.isdigit() and len(key) <= 10):
                raise _custom(f"keys must be token ids (decimal integers), got {_shown(key)}")
        return {int(key): value for key, value in bias.items()}

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, data: Any) -> Any:
        """An OpenAI parameter we do not implement, sent with a value that would change the answer."""
        if isinstance(data, dict):
            for name in sorted(k for k in data if k in cls.unsupported):
                if not _is_neutral(data[name], cls.unsupported[name]):
                    raise _custom(
                        f"unsupported parameter: {name} (got {_shown(data[name])}); splitserve does not implement "
                        f"it, remove it from the request",
                        name,
                        whole=True,
                    )
        return data

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> _Request:
        if self.stream_options is not None and not self.stream:
            raise _custom("is only allowed when stream is true", "stream_options")
        if self.prompt_logprobs and self.stream:  # as vLLM: they would have no chunk to ride on
            raise _custom(
                f"is {self.prompt_logprobs}: above 0 it is not available when stream is true", "prompt_logprobs"
            )
        return self

    @model_validator(mode="after")
    def _sequences(self) -> _Request:
        try:
            check_sequences(self.n or 1, self.best_of, bool(self.stream))
        except GatewayError as exc:
            raise _custom(exc.message, exc.param, whole=True) from None
        return self

    def sampling_values(self) -> dict[str, Any]:
        """The SamplingParams keyword values the client set (a lone stop string as a list)."""
        values = {name: getattr(self, name) for name in _SAMPLING_FIELDS if getattr(self, name) is not None}
        if isinstance(values.get("stop"), str):
            values["stop"] = [values["stop"]]
        return values

    @property
    def ignored_fields(self) -> list[str]:
        """Fields nobody defines (logged and ignored) and unsupported ones sent with a neutral value."""
        return sorted(k for k in self.model_extra or () if k not in self.unsupported)


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
    "logit_bias",
)


class CompletionRequest(_Request):
    """POST /v1/completions. prompt: a string, token ids, or a list of either (one choice each)."""

    unsupported: typing.ClassVar[dict[str, tuple]] = UNSUPPORTED_COMPLETION

    prompt: Any = None
    logprobs: int | None = None
    add_special_tokens: bool | None = None
    # the prompt's text before the output (with logprobs: the prompt tokens' too); max_tokens 0 = the prompt only
    echo: bool | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompts(cls, prompt: Any) -> tuple[str | tuple[int, ...], ...]:
        """The prompts: one, or a batch (a non-empty list of strings and token-id lists)."""
        if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
            if len(prompt) > MAX_PROMPTS:
                raise _custom(f"holds {len(prompt)} prompts; at most {MAX_PROMPTS} per request")
            return tuple(_one_prompt(p) for p in prompt)
        return (_one_prompt(prompt),)

    @model_validator(mode="before")
    @classmethod
    def _prompt_required(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("prompt") is None:
            raise _custom("is required", "prompt")
        return data


def _one_prompt(prompt: Any) -> str | tuple[int, ...]:
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list):
        for token_id in prompt:
            if isinstance(token_id, bool) or not isinstance(token_id, int) or token_id < 0:
                raise _custom(f"token ids must be non-negative integers, got {_shown(token_id)}")
        return tuple(prompt)
    raise _custom(f"must be a string or a list of token ids, got {type(prompt).__name__}")


class TextPart(_Body):
    """An OpenAI content part; only text parts are served."""

    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    """One chat turn; content may be null on an assistant turn (read as empty)."""

    role: Literal[CHAT_ROLES] = Field(description="one of " + ", ".join(CHAT_ROLES))  # type: ignore[valid-type]
    content: str | list[TextPart] | None = Field(None, description="a string or a list of text parts")
    tool_calls: list[dict[str, Any]] | None = None  # an assistant turn's calls (gateway/rest_tools.py)
    tool_call_id: str | None = None  # a tool turn: the call it answers
    name: str | None = None

    @model_validator(mode="after")
    def _content_present(self) -> ChatMessage:
        if self.content is None and self.role != "assistant":
            raise _custom("must be a string or a list of text parts, got None", "content")
        return self

    @property
    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatMessages(_Body):
    """A conversation: what /v1/chat/completions and /tokenize take as messages."""

    messages: list[ChatMessage] = Field(min_length=1, description="a non-empty list of {role, content} objects")

    @model_validator(mode="before")
    @classmethod
    def _messages_required(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("messages") is None:
            raise _custom("must be a non-empty list of {role, content} objects", "messages")
        return data

    @property
    def turns(self) -> tuple[tuple[str, str], ...]:
        return tuple((m.role, m.text) for m in self.messages)

    @property
    def message_extras(self) -> tuple[tuple[tuple[str, Any], ...], ...]:
        """Per message, the fields beside role and content that the template reads (tool calls, ids)."""
        names = ("tool_calls", "tool_call_id", "name")
        return tuple(tuple((k, getattr(m, k)) for k in names if getattr(m, k) is not None) for m in self.messages)


class ChatCompletionRequest(ChatMessages, _Request):
    """POST /v1/chat/completions, with vLLM's chat template fields."""

    unsupported: typing.ClassVar[dict[str, tuple]] = UNSUPPORTED_CHAT

    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    # tool calling: checked by gateway/rest_tools.py (vLLM's messages, naming the field)
    tools: Any = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise _custom("requires logprobs to be true", "top_logprobs")
        return self


# -- validation errors as messages --------------------------------------------------------------------

_KINDS = {  # pydantic error type -> what the value must be
    "int_type": "an integer",
    "int_parsing": "an integer",
    "float_type": "a number",
    "float_parsing": "a number",
    "bool_type": "a boolean",
    "bool_parsing": "a boolean",
    "string_type": "a string",
    "dict_type": "an object",
    "model_type": "an object",
    "model_attributes_type": "an object",
    "list_type": "a list",
    "too_short": "non-empty",
}


def validate(model: type[BaseModel], body: Any) -> Any:
    """`model` from a parsed JSON body; RequestValidationError (messages as the client sees them) if invalid."""
    if not isinstance(body, dict):
        raise RequestValidationError(
            [{"type": "dict_type", "loc": (), "msg": f"request body must be a JSON object, got {type(body).__name__}"}]
        )
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise RequestValidationError([_client_error(model, e) for e in exc.errors(include_url=False)]) from None


def _client_error(model: type[BaseModel], error: dict) -> dict:
    """One pydantic error with `msg` replaced by the message the client gets."""
    path, field = _locate(model, error["loc"])
    loc = error["loc"]
    if error["type"] in ("splitserve", "splitserve_whole"):
        name = (error.get("ctx") or {}).get("field")
        if name:
            path = f"{path}.{name}" if path else name
            loc = loc or (name,)
        message = error["msg"] if error["type"] == "splitserve_whole" else f"{path or 'body'} {error['msg']}"
    elif field is not None and field.description and error["type"] not in ("missing", "extra_forbidden"):
        got = "" if isinstance(error["input"], (list, dict)) else f", got {_shown(error['input'])}"
        message = f"{path} must be {field.description}{got}"
    else:
        message = _message(path or "body", error, field)
    return {"type": error["type"], "loc": loc, "msg": message, "input": error.get("input")}


def _message(path: str, error: dict, field: Any) -> str:
    kind, value = error["type"], error.get("input")
    if kind == "missing":
        return f"{path} is required"
    if kind == "extra_forbidden":
        return f"{path} has no field {error['loc'][-1]!r}"
    if kind in ("greater_than_equal", "less_than_equal", "greater_than", "less_than"):
        return f"{path} must be {_limits(field, error)}, got {_shown(value)}"
    if kind == "float_type" and isinstance(value, int) and not isinstance(value, bool):
        return f"{path} must be a number within its range, got {_shown(value)}"  # an integer beyond any float
    if kind == "literal_error":
        return f"{path} must be {error['ctx']['expected']}, got {_shown(value)}"
    return f"{path} must be {_KINDS.get(kind, 'valid')}, got {_shown(value)}"


def _limits(field: Any, error: dict) -> str:
    """Both bounds of a field (from its Field(ge=..., le=...)), else the one the value broke."""
    bounds = []
    for item in getattr(field, "metadata", ()) if field is not None else ():
        for attr, op in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<")):
            if getattr(item, attr, None) is not None:
                bounds.append(f"{op} {getattr(item, attr)}")
    if not bounds:
        ops = {"greater_than_equal": ">=", "less_than_equal": "<=", "greater_than": ">", "less_than": "<"}
        bounds = [f"{ops[error['type']]} {next(iter(error['ctx'].values()))}"]
    return " and ".join(bounds)


def _locate(model: type[BaseModel], loc: tuple) -> tuple[str, Any]:
    """(the path of `loc` as a client writes it: "messages[0].role", the FieldInfo there).

    Walks the models' fields and list indices; stops at anything else (a union member's tag)."""
    path, field, current, keyed = "", None, model, False
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
            continue
        if keyed:  # a key of a dict field: logit_bias['5']
            path, keyed = f"{path}[{part!r}]", False
            continue
        fields = getattr(current, "model_fields", None) if isinstance(current, type) else None
        if not fields or part not in fields:
            break
        field = fields[part]
        path = f"{path}.{part}" if path else part
        current = _inner_model(field.annotation)
        keyed = any(typing.get_origin(a) is dict for a in (field.annotation, *typing.get_args(field.annotation)))
    return path, field


def _inner_model(annotation: Any) -> type[BaseModel] | None:
    """The model class inside an annotation (list[M], M | None, ...), or None."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        found = _inner_model(arg)
        if found is not None:
            return found
    return None


def _shown(value: Any) -> str:
    """A client's value in a message: repr, big integers by their size, long ones cut."""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 10**30:
        return f"an integer of {len(str(abs(value)))} digits"
    text = repr(value)
    if len(text) > _MAX_SHOWN_CHARS:
        text = f"{text[: _MAX_SHOWN_CHARS - 20]}...{text[-17:]}"
    return text
