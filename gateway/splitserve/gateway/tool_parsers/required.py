"""What tool_choice "required" makes the model write (a grammar forces it): a JSON array of
{"name": ..., "parameters": {...}}, one element per call, as vLLM's required-choice schema. No content."""

from __future__ import annotations

import json

from splitserve.gateway.tool_parsers.base import Extracted, Scan, ToolParser
from splitserve.gateway.tool_parsers.partial_json import skip_space


class RequiredParser(ToolParser):
    """The array tool_choice "required" constrains the answer to."""

    name = "required"
    argument_keys = ("parameters",)

    def extract(self, text: str) -> Extracted:
        try:
            calls = json.loads(text)
            if not isinstance(calls, list):
                raise ValueError("the calls must be a JSON array")
            return Extracted("", tuple(self.call_of(call) for call in calls))
        except ValueError:
            return Extracted(text)

    def scan(self, text: str, final: bool = False) -> Scan:
        position = skip_space(text, 0)
        if position >= len(text):
            return Scan("", in_calls=True)
        try:
            return Scan("", self.partial_array(text, position), in_calls=True)
        except ValueError:  # not JSON (a bad escape too): no more calls read from here
            return Scan("", in_calls=True)
