"""What every tool-call parser shares: its results, the partial reading used while streaming, call ids.

A parser reads a model's text two ways. `extract(text)` reads a whole answer as vLLM's parser of the same
name does (the non-streamed answer, and the last word of a streamed one). `scan(text)` reads an answer
still being generated: the text settled as content (never part of a call, so it can be sent) and the calls
begun so far, each with its name once whole and its arguments' text so far; gateway/rest_tools.py turns
successive scans into OpenAI's streamed deltas.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import ClassVar

from splitserve.gateway.tool_parsers.partial_json import MalformedJson, object_fields, skip_space


@dataclass(frozen=True)
class ToolCall:
    """One parsed call: the function's name and its arguments as JSON text."""

    name: str
    arguments: str


@dataclass(frozen=True)
class Extracted:
    """A whole answer read: the text content (None: none) and the calls (empty: a plain answer)."""

    content: str | None
    calls: tuple[ToolCall, ...] = ()


@dataclass(frozen=True)
class PartialCall:
    """A call being generated: `name` once its string is whole; `raw_arguments` the arguments' text so far
    (None until the value starts) and where it starts in the text; `complete` once that value is whole."""

    name: str | None
    raw_arguments: str | None = None
    complete: bool = False
    arguments_at: int = -1  # where the arguments' value starts in the text scanned (-1: not yet)


@dataclass(frozen=True)
class Scan:
    """An answer being generated, read: `content` is settled (a prefix of the answer's content); `in_calls`
    says the calls' part has begun (a marker, or the format's first character, was seen)."""

    content: str
    calls: tuple[PartialCall, ...] = ()
    in_calls: bool = False


class ToolParser:
    """Base of the parsers; a subclass sets `name` (vLLM's --tool-call-parser name) and reads its format."""

    name: ClassVar[str] = ""
    ensure_ascii: ClassVar[bool] = False  # how the arguments are re-serialized (as vLLM's parser does)
    keep_special_tokens: ClassVar[bool] = False  # the format's marker is a special token: keep it in the text
    argument_keys: ClassVar[tuple[str, ...]] = ("arguments",)

    def extract(self, text: str) -> Extracted:
        raise NotImplementedError

    def scan(self, text: str, final: bool = False) -> Scan:
        raise NotImplementedError

    def new_call_id(self) -> str:
        """vLLM's tool call id: chatcmpl-tool- and 32 hex digits."""
        return f"chatcmpl-tool-{uuid.uuid4().hex}"

    def call_of(self, obj: object) -> ToolCall:
        """A parsed JSON object {"name": ..., "arguments": {...}} as a call; ValueError when it is not one."""
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            raise ValueError("a tool call must be an object with a string name")
        key = next((k for k in self.argument_keys if k in obj), None)
        if key is None:
            raise ValueError(f"a tool call needs one of {self.argument_keys}")
        call = ToolCall(obj["name"], json.dumps(obj[key], ensure_ascii=self.ensure_ascii))
        call.name.encode(), call.arguments.encode()  # UnicodeEncodeError (a ValueError) on a lone surrogate
        return call

    def partial_call(self, text: str, i: int, offset: int = 0) -> tuple[PartialCall, int | None]:
        """The call whose object starts at text[i] ("{"), and the index after it (None while open); `text`
        is the scanned text's part from `offset` on."""
        fields, end = object_fields(text, i)
        name = None
        raw_arguments, complete, arguments_at = None, False, -1
        for key, start, value_stop in fields:
            if key == "name" and value_stop is not None and text[start] == '"':
                name = json.loads(text[start:value_stop])
            elif key in self.argument_keys:
                raw_arguments = text[start : value_stop if value_stop is not None else len(text)]
                complete, arguments_at = value_stop is not None, offset + start
        return PartialCall(name, raw_arguments, complete, arguments_at), end

    def partial_array(self, text: str, i: int) -> tuple[PartialCall, ...]:
        """The calls of a JSON array of call objects starting at text[i] ("["), so far."""
        if text[i] != "[":
            raise MalformedJson(f"expected '[' at {i}")
        calls: list[PartialCall] = []
        j = skip_space(text, i + 1)
        while j < len(text) and text[j] != "]":
            if text[j] == ",":
                j = skip_space(text, j + 1)
                continue
            call, end = self.partial_call(text, j)
            calls.append(call)
            if end is None:
                break
            j = skip_space(text, end)
        return tuple(calls)


def held_back(text: str, marker: str) -> int:
    """How many characters at the end of `text` could be the start of `marker` (kept from the content until
    the next text says whether the marker follows)."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0
