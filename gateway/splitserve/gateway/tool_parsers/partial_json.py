"""JSON read while it is still being generated: where a value ends, an object's fields so far, and the
canonical text of a value's finished part.

A streamed tool call's arguments are sent as the text `json.dumps(arguments)` would give (what the
non-streamed answer holds), fragment by fragment: `canonical_prefix(raw)` (tool_parsers/json_stream.py
incrementally) only ever grows as `raw` grows, and equals `json.dumps(json.loads(raw))` once `raw` is
complete, so the fragments add up to the non-streamed arguments exactly.
"""

from __future__ import annotations

import json
import re

from splitserve.gateway.tool_parsers.json_stream import CanonicalStream

_WHITESPACE = " \t\n\r"
_SCALAR_CHARS = frozenset("0123456789+-.eEtruefalsn")
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"', re.DOTALL)


class MalformedJson(ValueError):
    """The text cannot become JSON by growing."""


def skip_space(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WHITESPACE:
        i += 1
    return i


def string_end(text: str, i: int) -> int | None:
    """Index after the string literal starting at text[i] (a quote); None when the text ends first."""
    found = _STRING.match(text, i)
    return found.end() if found is not None else None


def value_end(text: str, i: int) -> int | None:
    """Index after the JSON value starting at text[i]; None when the text ends first. A scalar (number,
    literal) at the very end of the text counts as unfinished: more digits may follow."""
    c = text[i]
    if c == '"':
        return string_end(text, i)
    if c in "{[":
        depth, j = 0, i
        while j < len(text):
            c = text[j]
            if c == '"':
                end = string_end(text, j)
                if end is None:
                    return None
                j = end
                continue
            if c in "{[":
                depth += 1
            elif c in "}]":
                depth -= 1
                if depth == 0:
                    return j + 1
            j += 1
        return None
    j = i
    while j < len(text) and text[j] in _SCALAR_CHARS:
        j += 1
    if j == i:
        raise MalformedJson(f"unexpected {c!r} at {i}")
    return j if j < len(text) else None


def object_fields(text: str, i: int) -> tuple[list[tuple[str, int, int | None]], int | None]:
    """The fields of the object starting at text[i] ("{"), so far: [(key, value start, value end or None)],
    and the index after the object (None while it is open). A field whose value has not started is left out."""
    if text[i] != "{":
        raise MalformedJson(f"expected an object at {i}")
    fields: list[tuple[str, int, int | None]] = []
    j = skip_space(text, i + 1)
    while j < len(text):
        c = text[j]
        if c == "}":
            return fields, j + 1
        if c == ",":
            j = skip_space(text, j + 1)
            continue
        if c != '"':
            raise MalformedJson(f"expected a key at {j}")
        key_end = string_end(text, j)
        if key_end is None:
            return fields, None
        key = json.loads(text[j:key_end])
        j = skip_space(text, key_end)
        if j >= len(text):
            return fields, None
        if text[j] != ":":
            raise MalformedJson(f"expected ':' at {j}")
        j = skip_space(text, j + 1)
        if j >= len(text):
            return fields, None
        end = value_end(text, j)
        fields.append((key, j, end))
        if end is None:
            return fields, None
        j = skip_space(text, end)
    return fields, None


def canonical_prefix(raw: str, ensure_ascii: bool = False, final: bool = False) -> str:
    """The canonical JSON text (json.dumps' separators and escapes) of what `raw` settles so far: finished
    tokens, and the decoded part of an open string. `final`: the text is all there is (a trailing number
    is finished)."""
    stream = CanonicalStream(ensure_ascii)
    return stream.feed(raw) + (stream.finish() if final else "")
