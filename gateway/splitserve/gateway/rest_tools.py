"""Tool calling on /v1/chat/completions, as vLLM serves it.

    tools                 [{"type": "function", "function": {"name", "description", "parameters"}}]
    tool_choice           "none" | "auto" (the default with tools) | "required" | {"type": "function",
                          "function": {"name": ...}}
    parallel_tool_calls   false: at most one call per answer

The tools reach the chat template as transformers passes them (`tools=`). How the answer is read:

    none       plain content (the tools are still rendered)
    auto       the server's --tool-call-parser reads the text (needs --enable-auto-tool-choice, else 400)
    required   a grammar forces a JSON array [{"name", "parameters"}] (one schema per tool), so every call's
               arguments parse against its tool's schema; finish_reason "tool_calls"
    named      a grammar forces that function's parameters schema; the whole text is the arguments;
               finish_reason stays "stop" (as OpenAI and vLLM answer a named choice)

Both grammars are vLLM's schemas with no whitespace but json.dumps' separators (", ", ": "): the JSON a
model writes is then the form json.dumps gives, and a call always ends (a grammar that admits any
whitespace lets a weak model spend its whole budget on spaces, leaving arguments that do not parse).

`ToolAnswer` (gateway/rest_tool_answers.py) turns each choice's text into message.content and
message.tool_calls, or its pieces into OpenAI's streamed deltas.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from splitserve.common.structured_output import StructuredOutput, schema_text
from splitserve.gateway.errors import invalid
from splitserve.gateway.tool_parsers import TOOL_PARSERS

AUTO_NEEDS_FLAGS = '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'
_NAMED_USAGE = 'Correct usage: `{"type": "function", "function": {"name": "my_function"}}`'
_EMPTY_PARAMETERS = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class ToolSettings:
    """The server's tool flags: --enable-auto-tool-choice and --tool-call-parser (vLLM's names)."""

    enable_auto_tool_choice: bool = False
    tool_call_parser: str = ""

    def __post_init__(self) -> None:
        if self.tool_call_parser and self.tool_call_parser not in TOOL_PARSERS:
            raise ValueError(
                f"--tool-call-parser {self.tool_call_parser!r} is not one of {', '.join(sorted(TOOL_PARSERS))}"
            )
        if self.enable_auto_tool_choice and not self.tool_call_parser:
            raise ValueError(
                "--enable-auto-tool-choice requires --tool-call-parser (one of hermes, llama3_json, mistral)"
            )


@dataclass(frozen=True)
class ToolPlan:
    """How one chat request uses its tools: `choice` is none, auto, required or named (`function` then)."""

    choice: str
    function: str = ""
    parallel: bool = True
    parser_name: str = ""  # auto: the server's parser


@dataclass(frozen=True)
class ToolRequest:
    """What a chat body's tool fields give the request: the plan, the tools for the template, the grammar
    (required and named) and the field a grammar refusal is reported under."""

    plan: ToolPlan | None
    template_tools: tuple[dict, ...] | None
    structured: StructuredOutput | None = None
    structured_field: str = ""
    keep_special_tokens: bool = False


def tool_request(tools: Any, tool_choice: Any, parallel: bool | None, settings: ToolSettings) -> ToolRequest:
    """Validate the tool fields of a chat body (400 naming the field, vLLM's messages) and plan the answer."""
    checked = _check_tools(tools) if tools is not None else None
    if tool_choice is None:
        tool_choice = "auto" if checked else "none"
    if tool_choice == "none":
        return ToolRequest(None, tuple(checked) if checked else None)
    if checked is None:
        raise invalid("When using `tool_choice`, `tools` must be set.", "tool_choice")
    if not checked:
        raise invalid(f"tools must hold at least one function when tool_choice is {tool_choice!r}"[:300], "tools")
    names = [tool["function"]["name"] for tool in checked]
    parallel_ok = parallel is not False
    if tool_choice == "auto":
        if not (settings.enable_auto_tool_choice and settings.tool_call_parser):
            raise invalid(AUTO_NEEDS_FLAGS, "tool_choice")
        parser = TOOL_PARSERS[settings.tool_call_parser]
        plan = ToolPlan("auto", parallel=parallel_ok, parser_name=parser.name)
        return ToolRequest(plan, tuple(checked), keep_special_tokens=parser.keep_special_tokens)
    if tool_choice == "required":
        schema = _required_schema(checked, parallel_ok)
        spec = StructuredOutput(json=schema_text(schema, "tools"), disable_any_whitespace=True)
        return ToolRequest(ToolPlan("required", parallel=parallel_ok), tuple(checked), spec, "tools")
    name = _named_function(tool_choice)
    if name not in names:
        raise invalid("The tool specified in `tool_choice` does not match any of the specified `tools`", "tool_choice")
    index = names.index(name)
    parameters = checked[index]["function"].get("parameters") or _EMPTY_PARAMETERS
    field = f"tools[{index}].function.parameters"
    spec = StructuredOutput(json=schema_text(parameters, field), disable_any_whitespace=True)
    return ToolRequest(ToolPlan("named", function=name), tuple(checked), spec, field)


def _named_function(tool_choice: Any) -> str:
    if not isinstance(tool_choice, dict):
        raise invalid(
            f'Invalid value for `tool_choice`: {tool_choice!r}! Only named tools, "none", "auto" or "required" '
            "are supported."[:300],
            "tool_choice",
        )
    function = tool_choice.get("function")
    if not isinstance(function, dict):
        raise invalid(
            f"Invalid value for `function`: `{function}` in `tool_choice`! {_NAMED_USAGE}"[:400], "tool_choice"
        )
    if "name" not in function:
        raise invalid(f"Expected field `name` in `function` in `tool_choice`! {_NAMED_USAGE}", "tool_choice")
    name = function["name"]
    if not isinstance(name, str) or not name:
        raise invalid(f"Invalid `name` in `function`: `{name}` in `tool_choice`! {_NAMED_USAGE}"[:400], "tool_choice")
    return name


def _check_tools(tools: Any) -> list[dict]:
    if not isinstance(tools, list):
        raise invalid(f"tools must be a list of function tools, got {type(tools).__name__}", "tools")
    checked = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            raise invalid(f'tools[{i}] must be {{"type": "function", "function": {{...}}}}', "tools")
        function = tool.get("function")
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
            raise invalid(f"tools[{i}].function.name must be a non-empty string", "tools")
        parameters = function.get("parameters")
        if parameters is not None and not isinstance(parameters, dict):
            raise invalid(f"tools[{i}].function.parameters must be a JSON schema (an object)", "tools")
        description = function.get("description")
        if description is not None and not isinstance(description, str):
            raise invalid(f"tools[{i}].function.description must be a string", "tools")
        checked.append({"type": "function", "function": function})
    return checked


def _required_schema(tools: list[dict], parallel: bool) -> dict:
    """vLLM's schema for tool_choice "required": an array of one or more {"name": <a tool>, "parameters": its
    schema}; tools' "$defs" lifted to the top (their "#/$defs/..." references then resolve)."""
    defs: dict = {}
    options = []
    for tool in tools:
        function = tool["function"]
        parameters = dict(function.get("parameters") or _EMPTY_PARAMETERS)
        defs.update(parameters.pop("$defs", None) or {})
        options.append(
            {
                "properties": {"name": {"type": "string", "enum": [function["name"]]}, "parameters": parameters},
                "required": ["name", "parameters"],
            }
        )
    schema: dict = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": options}}
    if not parallel:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


def template_messages(messages: list[dict]) -> list[dict]:
    """Assistant tool calls as chat templates read them: arguments a dict, not JSON text (as vLLM passes them)."""
    out = []
    for i, message in enumerate(messages):
        calls = message.get("tool_calls")
        if message.get("role") == "assistant" and isinstance(calls, list):
            fixed = []
            for j, call in enumerate(calls):
                function = call.get("function") if isinstance(call, dict) else None
                if not isinstance(function, dict) or not isinstance(function.get("name"), str):
                    raise invalid(f"messages[{i}].tool_calls[{j}] must have a function with a string name", "messages")
                function = dict(function)
                arguments = function.get("arguments")
                if isinstance(arguments, str):
                    try:
                        function["arguments"] = json.loads(arguments) if arguments else {}
                    except ValueError:
                        raise invalid(
                            f"messages[{i}].tool_calls[{j}].function.arguments is not valid JSON", "messages"
                        ) from None
                fixed.append({**call, "function": function})
            message = {**message, "tool_calls": fixed}
        out.append(message)
    return out
