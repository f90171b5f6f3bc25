"""Tool-call parsers by vLLM's --tool-call-parser names: one module per model family's format.

hermes       <tool_call>{"name": ..., "arguments": ...}</tool_call>   (Hermes 2 Pro, Qwen 2.5, Qwen 3)
llama3_json  {"name": ..., "parameters": ...}; ...                     (Llama 3.1, 3.2)
mistral      [TOOL_CALLS][{"name": ..., "arguments": ...}]             (Mistral 7B Instruct v0.3)
"""

from __future__ import annotations

from splitserve.gateway.tool_parsers.base import ToolParser
from splitserve.gateway.tool_parsers.hermes import HermesParser
from splitserve.gateway.tool_parsers.llama3_json import Llama3JsonParser
from splitserve.gateway.tool_parsers.mistral import MistralParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    parser.name: parser for parser in (HermesParser, Llama3JsonParser, MistralParser)
}
