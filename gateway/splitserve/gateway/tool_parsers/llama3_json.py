"""`llama3_json`: Llama 3.1 / 3.2 JSON calls (the format of vLLM's tool_chat_template_llama3.1_json.jinja),
optionally after <|python_tag|>, several separated by semicolons:

    {"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", "parameters": {}}

Read as vLLM's parser reads a whole answer: the calls start at the first "{", their arguments are
"arguments" or else "parameters", re-serialized as json.dumps(...) (ASCII escapes), and the answer has no
content then. While streaming, an answer is read as calls only when it starts with "{" or the tag.
"""

from __future__ import annotations

import json

from splitserve.gateway.tool_parsers.base import Extracted, PartialCall, Scan, ToolCall, ToolParser
from splitserve.gateway.tool_parsers.partial_json import skip_space

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonParser(ToolParser):
    """JSON objects {"name", "parameters" | "arguments"} separated by ";"."""

    name = "llama3_json"
    ensure_ascii = True
    argument_keys = ("arguments", "parameters")

    def extract(self, text: str) -> Extracted:
        start = text.find("{")
        if start < 0:
            return Extracted(text)
        decoder = json.JSONDecoder()
        calls: list[ToolCall] = []
        position = start
        try:
            while True:
                obj, position = decoder.raw_decode(text, position)
                calls.append(self.call_of(obj))
                position = skip_space(text, position)
                if not text.startswith(";", position):
                    break
                position = skip_space(text, position + 1)
        except ValueError:
            return Extracted(text)
        return Extracted(None, tuple(calls))

    def scan(self, text: str, final: bool = False) -> Scan:
        begin = skip_space(text, 0)
        tagged = text.startswith(PYTHON_TAG, begin)
        if tagged:
            begin = skip_space(text, begin + len(PYTHON_TAG))
        elif not final and PYTHON_TAG.startswith(text[begin:]):
            return Scan("")  # nothing yet but space, or the tag's first characters
        if begin >= len(text):
            return Scan("", in_calls=True) if tagged else Scan(text)
        if text[begin] != "{":
            return Scan(text)
        calls: list[PartialCall] = []
        position = begin
        try:
            while position < len(text):
                call, end = self.partial_call(text, position)
                calls.append(call)
                if end is None:
                    break
                position = skip_space(text, end)
                if not text.startswith(";", position):
                    break
                position = skip_space(text, position + 1)
        except ValueError:  # not JSON (a bad escape too): no more calls read from here
            pass
        return Scan("", tuple(calls), in_calls=True)
