"""JSON read while it is still being generated: where a value ends, an object's fields so far, and the
canonical text of a value's finished part.

A streamed tool call's arguments are sent as the text `json.dumps(arguments)` would give (what the
non-streamed answer holds), fragment by fragment: `canonical_prefix(raw)` only ever grows as `raw`
grows, and equals `json.dumps(json.loads(raw))` once `raw` is complete, so the fragments add up to the
non-streamed arguments exactly.
"""

from __future__ import annotations

import json

_WHITESPACE = " \t\n\r"
_SCALAR_CHARS = frozenset("0123456789+-.eEtruefalsn")
_LITERALS = ("true", "false", "null")


class MalformedJson(ValueError):
    """The text cannot become JSON by growing."""


def skip_space(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WHITESPACE:
        i += 1
    return i


def string_end(text: str, i: int) -> int | None:
    """Index after the string literal starting at text[i] (a quote); None when the text ends first."""
    j = i + 1
    while j < len(text):
        c = text[j]
        if c == "\\":
            j += 2
            continue
        if c == '"':
            return j + 1
        j += 1
    return None


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
    out: list[str] = []
    i = 0
    while True:
        i = skip_space(raw, i)
        if i >= len(raw):
            return "".join(out)
        c = raw[i]
        if c in "{}[]":
            out.append(c)
            i += 1
        elif c == ",":
            out.append(", ")
            i += 1
        elif c == ":":
            out.append(": ")
            i += 1
        elif c == '"':
            end = string_end(raw, i)
            if end is None:
                out.append(_open_string(raw[i + 1 :], ensure_ascii))
                return "".join(out)
            out.append(json.dumps(json.loads(raw[i:end]), ensure_ascii=ensure_ascii))
            i = end
        else:
            j = i
            while j < len(raw) and raw[j] in _SCALAR_CHARS:
                j += 1
            if j == i:
                return "".join(out)  # not JSON: nothing past here is settled
            if j == len(raw) and not final:
                if raw[i:j] not in _LITERALS:
                    return "".join(out)  # a number may go on
            try:
                out.append(json.dumps(json.loads(raw[i:j])))
            except ValueError:
                return "".join(out)
            i = j


def _open_string(body: str, ensure_ascii: bool) -> str:
    """An unfinished string's canonical text so far (the opening quote and its decoded characters): a
    trailing escape that is not whole yet, and a high surrogate waiting for its pair, are held back."""
    cut = len(body)
    backslash = body.rfind("\\", max(0, cut - 6))
    if backslash >= 0 and _escape_open(body, backslash):
        cut = backslash
    while True:
        try:
            decoded = json.loads('"' + body[:cut] + '"')
            break
        except ValueError:
            if cut == 0:
                return '"'
            cut -= 1
    if decoded and "\ud800" <= decoded[-1] <= "\udbff":
        decoded = decoded[:-1]
    return json.dumps(decoded, ensure_ascii=ensure_ascii)[:-1]


def _escape_open(body: str, at: int) -> bool:
    """Whether the backslash at `at` starts an escape that the end of `body` cuts short."""
    run = 0
    while at - run - 1 >= 0 and body[at - run - 1] == "\\":
        run += 1
    if run % 2:  # this backslash is itself escaped
        return False
    rest = body[at + 1 :]
    if not rest:
        return True
    return rest[0] == "u" and len(rest) < 5
