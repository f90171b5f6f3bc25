"""`CanonicalStream`: a JSON value's text, fed as it is generated, re-written in canonical form (json.dumps'
separators and escapes) as far as it is settled. Each character is read once, so streaming a call's
arguments costs time linear in their length however finely they arrive.

    raw, fed in pieces:  {"a" :[1,  2.50], "s":"x\\u00e9
    canonical so far:    {"a": [1, 2.5], "s": "xé

A number is settled when the character after it arrives (or at `finish`), a string character when its
escape is whole (a high surrogate waits for its pair). Text that cannot be JSON stops the output there.
"""

from __future__ import annotations

import json
import re

_WHITESPACE = " \t\n\r"
_SCALAR_CHARS = frozenset("0123456789+-.eEtruefalsn")
_STRING_RUN = re.compile(r'[^"\\]+')
_SURROGATE = re.compile("[\ud800-\udfff]")
_PUNCTUATION = {"{": "{", "[": "[", "}": "}", "]": "]", ",": ", ", ":": ": "}


class CanonicalStream:
    """Canonical text of one JSON value fed piece by piece; `done` once the value is whole."""

    def __init__(self, ensure_ascii: bool = False) -> None:
        self.ensure_ascii = ensure_ascii
        self.done = False
        self.broken = False  # the text cannot be JSON: nothing more is written
        self._pending = ""  # raw text not settled yet
        self._state = "between"  # between tokens, in a "string", or in a "scalar"
        self._depth = 0

    def feed(self, raw: str) -> str:
        """The canonical text that `raw` (appended to what came before) settles."""
        if self.done or self.broken:
            return ""
        self._pending += raw
        out: list[str] = []
        while self._pending and not (self.done or self.broken):
            step = {"between": self._between, "string": self._string, "scalar": self._scalar}[self._state]
            if not step(out):
                break  # waiting for more text
        return "".join(out)

    def finish(self) -> str:
        """At the end of the text: a number still open is settled."""
        if self._state != "scalar" or self.broken:
            return ""
        out: list[str] = []
        self._settle_scalar(out)
        return "".join(out)

    def _between(self, out: list[str]) -> bool:
        c = self._pending[0]
        if c in _WHITESPACE:
            self._pending = self._pending.lstrip(_WHITESPACE)
        elif c in _PUNCTUATION:
            out.append(_PUNCTUATION[c])
            self._pending = self._pending[1:]
            if c in "{[":
                self._depth += 1
            elif c in "}]":
                self._depth -= 1
                self.done = self._depth <= 0
        elif c == '"':
            out.append('"')
            self._pending, self._state = self._pending[1:], "string"
        elif c in _SCALAR_CHARS:
            self._state = "scalar"
        else:
            self.broken = True
        return True

    def _string(self, out: list[str]) -> bool:
        pending = self._pending
        run = _STRING_RUN.match(pending)
        if run is not None:
            out.append(self._escaped(run.group(0)))
            self._pending = pending[run.end() :]
            return True
        if pending[0] == '"':
            out.append('"')
            self._pending, self._state = pending[1:], "between"
            self.done = self._depth <= 0
            return True
        size = 6 if pending[1:2] == "u" else 2  # an escape: \n, or \uXXXX
        if pending[1:2] == "u" and "\ud800" <= _unicode(pending[:6]) <= "\udbff":
            size = 12  # a high surrogate: settled together with its low half
        if len(pending) < size:
            return False
        try:
            char = json.loads('"' + pending[:size] + '"')
        except ValueError:
            self.broken = True
            return True
        out.append(self._escaped(char))
        self._pending = pending[size:]
        return True

    def _scalar(self, out: list[str]) -> bool:
        end = 0
        while end < len(self._pending) and self._pending[end] in _SCALAR_CHARS:
            end += 1
        if end == len(self._pending):
            return False  # a number may go on
        self._settle_scalar(out, end)
        return True

    def _settle_scalar(self, out: list[str], end: int | None = None) -> None:
        token, self._pending = self._pending[:end], self._pending[end:] if end is not None else ""
        try:
            out.append(json.dumps(json.loads(token)))
        except ValueError:
            self.broken = True
            return
        self._state = "between"
        self.done = self._depth <= 0

    def _escaped(self, text: str) -> str:
        # a lone surrogate (a model's unpaired \ud83d) stays an escape: it has no UTF-8 form to send
        ascii_only = self.ensure_ascii or _SURROGATE.search(text) is not None
        return json.dumps(text, ensure_ascii=ascii_only)[1:-1]


def _unicode(escape: str) -> str:
    """The character of a whole \\uXXXX escape, else ""."""
    try:
        return json.loads('"' + escape + '"') if len(escape) == 6 else ""
    except ValueError:
        return ""
