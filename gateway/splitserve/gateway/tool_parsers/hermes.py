"""`hermes`: Hermes 2 Pro / Qwen 2.5+ calls, each a JSON object between tags:

    I'll look that up.<tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

The content is the text before the first <tool_call> (None when empty); a call left open at the end of
the answer counts too. Arguments re-serialized as json.dumps(..., ensure_ascii=False), as vLLM's parser.
"""

from __future__ import annotations

import json
import re

from splitserve.gateway.tool_parsers.base import Extracted, PartialCall, Scan, ToolParser, held_back
from splitserve.gateway.tool_parsers.partial_json import skip_space

START, END = "<tool_call>", "</tool_call>"
_CALLS = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)


class HermesParser(ToolParser):
    """Calls between <tool_call> and </tool_call>."""

    name = "hermes"

    def extract(self, text: str) -> Extracted:
        start = text.find(START)
        if start < 0:
            return Extracted(text)
        try:
            calls = tuple(self.call_of(json.loads(closed or open_)) for closed, open_ in _CALLS.findall(text))
        except ValueError:
            return Extracted(text)
        return Extracted(text[:start] or None, calls)

    def scan(self, text: str, final: bool = False) -> Scan:
        start = text.find(START)
        if start < 0:
            keep = 0 if final else held_back(text, START)
            return Scan(text[: len(text) - keep])
        calls: list[PartialCall] = []
        position = start
        while position >= 0:
            body_start = position + len(START)
            stop = text.find(END, body_start)
            body = text[body_start : stop if stop >= 0 else len(text)]
            j = skip_space(body, 0)
            if j < len(body):
                try:
                    call, _ = self.partial_call(body, j, offset=body_start)
                except ValueError:  # not JSON (a bad escape too): no more calls read from here
                    break
                calls.append(call)
            position = text.find(START, stop) if stop >= 0 else -1
        return Scan(text[:start], tuple(calls), in_calls=True)
