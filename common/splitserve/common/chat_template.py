"""Chat templates rendered as transformers renders them, with jinja2 alone (no torch, no transformers).

jinja2's immutable sandbox with transformers' options (trim_blocks, lstrip_blocks, loop controls, the
`{% generation %}` tag), its filter (tojson without HTML escaping) and globals (raise_exception,
strftime_now, a restricted dict and namespace); `render` also handles continue_final_message. Used by
splitserve.common.tokenizer; tests/common/test_tokenizer.py holds the rendered text equal to transformers'.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from datetime import datetime
from functools import lru_cache
from typing import Any, NoReturn

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment

REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")  # one reasoning text, several names
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "  # marks where the final message ends in the rendered text


def render(
    template: str, chat: list[dict], context: dict, add_generation_prompt: bool, continue_final_message: bool | str
) -> str:
    """Render one conversation. To continue the final message, a tag is appended to it and the text is
    cut where the tag lands, so whatever the template writes after a message (end-of-turn tokens) goes."""
    if not continue_final_message:
        return _compile(template).render(messages=chat, add_generation_prompt=add_generation_prompt, **context)
    field = continue_final_message if isinstance(continue_final_message, str) else "content"
    final = chat[-1].get(field)
    if final is None:
        raise ValueError(f"continue_final_message is set but the final message has no {field!r} to continue")
    fields = [f for f in REASONING_FIELDS if chat[-1].get(f) == final] if field in REASONING_FIELDS else [field]
    if not any(f in template for f in fields):
        raise ValueError(f"continue_final_message is set to {field!r} but the chat template never reads that field")
    if isinstance(final, (list, tuple)):  # content blocks: continue the last text block
        block = next((b for b in reversed(final) if "text" in b), None)
        if block is None:
            raise ValueError("continue_final_message is set but the final message has no text block to continue")
        final, block["text"] = block["text"], block["text"] + _CONTINUE_TAG
    else:
        for f in fields:
            chat[-1][f] = chat[-1][f] + _CONTINUE_TAG
    text = _compile(template).render(messages=chat, add_generation_prompt=add_generation_prompt, **context)
    tag = _CONTINUE_TAG.strip()
    if final.strip() not in text or tag not in text:
        raise ValueError(
            "continue_final_message is set but the chat template dropped part of the final message "
            f"{final.strip()!r}; rendered: {text!r}"
        )
    cut = text.rindex(tag)
    # a template that strips message text also strips the space after the tag: trim what it left
    return text[:cut] if text[cut : cut + len(_CONTINUE_TAG)] == _CONTINUE_TAG else text[:cut].rstrip()


def without_none_values(message: Mapping[str, Any]) -> dict:
    """The message without keys whose value is None (an API's content=None renders as "None" otherwise)."""
    if not isinstance(message, Mapping):
        raise TypeError(f"chat messages must be dicts, got {message!r}")
    return {key: value for key, value in message.items() if value is not None}


def alias_reasoning_fields(chat: list[dict]) -> list[dict]:
    """Give a message's reasoning under the names templates read it by ("thinking", "reasoning_content")."""
    out = []
    for message in chat:
        reasoning = next((message[k] for k in REASONING_FIELDS if message.get(k) is not None), None)
        out.append(message if reasoning is None else {"thinking": reasoning, **message, "reasoning_content": reasoning})
    return out


def plain(value: Any) -> Any:
    """A copy of `value` made of JSON types only: a chat template is untrusted code, so no object with
    methods reaches it (other objects become a "<TypeName>" placeholder)."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    for base, exact in ((str, str.__str__), (int, int.__int__), (float, float.__float__)):
        if isinstance(value, base):  # a subclass (an enum) loses its methods, and its own __str__
            return exact(value)
    if isinstance(value, Mapping):
        return {plain(k): plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(plain(v) for v in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):  # pydantic models
        return plain(value.model_dump())
    return f"<{type(value).__name__}>"


class _GenerationTag(Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks; here it renders its body."""

    tags = {"generation"}

    def parse(self, parser: Any) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return caller()


class _TemplateNamespace(jinja2.utils.Namespace):
    """jinja2's namespace() without underscore attributes (a way from a template into CPython internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # no named `self`, so namespace(self=...) works
        attrs = dict(*args[1:], **kwargs)
        for name in attrs:
            _TemplateNamespace._check(name)
        jinja2.utils.Namespace.__init__(args[0], attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"a chat template may not set namespace attribute {name!r}")


class _TemplateDict:
    """The `dict` a template sees: it builds dicts and offers no type to climb from."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


def _raise_exception(message: str) -> NoReturn:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys: bool = False
) -> str:
    """jinja2's own tojson escapes HTML characters (<, >, &, '), which would change the prompt."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=32)
def _compile(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, "jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = _tojson
    env.globals.update(
        raise_exception=_raise_exception, strftime_now=_strftime_now, dict=_TemplateDict(), namespace=_TemplateNamespace
    )
    return env.from_string(template)
