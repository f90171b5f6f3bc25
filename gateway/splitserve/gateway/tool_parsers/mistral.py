"""`mistral`: Mistral 7B Instruct v0.3 style calls, a JSON array after the [TOOL_CALLS] token:

    [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]

[TOOL_CALLS] is a special token, so the text is detokenized with special tokens kept (as vLLM's parser
asks). The content is the text before the token (None when empty); ids are 9 letters and digits, as
Mistral's templates require.
"""

from __future__ import annotations

import json
import random
import re
import string

from splitserve.gateway.tool_parsers.base import Extracted, Scan, ToolParser, held_back
from splitserve.gateway.tool_parsers.partial_json import skip_space

TOOL_CALLS = "[TOOL_CALLS]"
_ARRAY = re.compile(r"\[{.*}\]", re.DOTALL)
_ID_CHARS = string.ascii_letters + string.digits


class MistralParser(ToolParser):
    """A JSON array of {"name", "arguments"} after [TOOL_CALLS]."""

    name = "mistral"
    keep_special_tokens = True

    def new_call_id(self) -> str:
        return "".join(random.choices(_ID_CHARS, k=9))

    def extract(self, text: str) -> Extracted:
        if TOOL_CALLS not in text:
            return Extracted(text)
        body = text.replace(TOOL_CALLS, "").strip()
        try:
            try:
                calls = json.loads(body)
            except ValueError:  # text around the array: the array alone
                found = _ARRAY.search(body)
                if found is None:
                    raise
                calls = json.loads(found.group(0))
            if not isinstance(calls, list):
                raise ValueError("the calls must be a JSON array")
            parsed = tuple(self.call_of(call) for call in calls)
        except ValueError:
            return Extracted(body)
        return Extracted(text.split(TOOL_CALLS)[0] or None, parsed)

    def scan(self, text: str, final: bool = False) -> Scan:
        start = text.find(TOOL_CALLS)
        if start < 0:
            keep = 0 if final else held_back(text, TOOL_CALLS)
            return Scan(text[: len(text) - keep])
        position = skip_space(text, start + len(TOOL_CALLS))
        calls = ()
        if position < len(text):
            try:
                calls = self.partial_array(text, position)
            except ValueError:  # not JSON (a bad escape too): no more calls read from here
                pass
        return Scan(text[:start], calls, in_calls=True)
