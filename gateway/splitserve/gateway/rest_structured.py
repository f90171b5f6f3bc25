"""Structured output fields of an OpenAI request body -> one StructuredOutput spec and the field it came from.

    response_format      {"type": "text" | "json_object" | "json_schema", "json_schema": {"name", "schema", ...}}
    structured_outputs   vLLM's object: exactly one of json, regex, choice, grammar, json_object
                         (+ disable_any_whitespace)
    guided_json, guided_regex, guided_choice, guided_grammar   vLLM's older top-level fields

At most one of them may constrain a request. Shapes are checked here (400 naming the field); whether
xgrammar compiles the spec is checked by the prefill or decode before any work is queued (a refusal is
a 400 naming the field too: gateway/request_run.py), since xgrammar imports torch.
"""

from __future__ import annotations

from typing import Any

from splitserve.common.structured_output import MAX_CHOICES, StructuredOutput, schema_text
from splitserve.gateway.errors import invalid

GUIDED_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
STRUCTURED_FIELDS = frozenset({"response_format", "structured_outputs", *GUIDED_FIELDS})
# vLLM fields about how to constrain, not what: accepted with the values that change nothing here
UNSUPPORTED_STRUCTURED = {"guided_decoding_backend": ("xgrammar", "auto"), "guided_whitespace_pattern": ()}
_OBJECT_KINDS = ("json", "regex", "choice", "grammar", "json_object")
# structured_outputs keys vLLM defines that we do not implement -> the values that change nothing
_OBJECT_NEUTRAL = {"structural_tag": (), "whitespace_pattern": (), "disable_fallback": (False,)}
_OBJECT_NEUTRAL["disable_additional_properties"] = (False,)


def structured_output_of(body: dict[str, Any]) -> tuple[StructuredOutput | None, str]:
    """The body's structured output spec and the field path it came from ("" when none)."""
    found = [
        spec
        for spec in (
            _response_format(body.get("response_format")),
            _object(body.get("structured_outputs")),
            *(_guided(name, body.get(name)) for name in GUIDED_FIELDS),
        )
        if spec is not None
    ]
    if len(found) > 1:
        names = " and ".join(field.split(".", 1)[0] for _, field in found)
        raise invalid(f"only one structured output constraint may be set per request; got {names}", found[1][1])
    return found[0] if found else (None, "")


def _response_format(value: Any) -> tuple[StructuredOutput, str] | None:
    if value is None:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise invalid(
            f'response_format must be an object with a "type" (text, json_object, json_schema), got {value!r}',
            "response_format",
        )
    kind = value["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutput(json_object=True), "response_format"
    if kind != "json_schema":
        raise invalid(
            f"response_format.type must be text, json_object or json_schema, got {kind!r}"[:300], "response_format"
        )
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise invalid(
            'response_format.json_schema must be an object with "name" and "schema" when type is json_schema',
            "response_format",
        )
    if not isinstance(spec.get("name"), str):
        raise invalid("response_format.json_schema.name must be a string", "response_format")
    if spec.get("schema") is None:
        raise invalid("response_format.json_schema.schema must be set (the JSON schema)", "response_format")
    field = "response_format.json_schema.schema"
    return _json(spec["schema"], field, False), field


def _object(value: Any) -> tuple[StructuredOutput, str] | None:
    """vLLM's structured_outputs object."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise invalid(f"structured_outputs must be an object, got {type(value).__name__}", "structured_outputs")
    allowed = {*_OBJECT_KINDS, "disable_any_whitespace", *_OBJECT_NEUTRAL}
    unknown = sorted(k for k in value if k not in allowed)
    if unknown:
        raise invalid(
            f"structured_outputs has unknown fields {', '.join(unknown)}; it takes {', '.join(sorted(allowed))}"[:600],
            "structured_outputs",
        )
    for name, neutral in _OBJECT_NEUTRAL.items():
        if value.get(name) is not None and value[name] not in neutral:
            raise invalid(
                f"structured_outputs.{name} is not supported (got {value[name]!r}); remove it"[:300],
                "structured_outputs",
            )
    kinds = [k for k in _OBJECT_KINDS if value.get(k) not in (None, False)]
    if len(kinds) != 1:
        raise invalid(
            f"structured_outputs must set exactly one of {', '.join(_OBJECT_KINDS)}; got "
            f"{', '.join(kinds) if kinds else 'none'}",
            "structured_outputs",
        )
    whitespace = value.get("disable_any_whitespace")
    if whitespace is not None and not isinstance(whitespace, bool):
        raise invalid(
            f"structured_outputs.disable_any_whitespace must be a boolean, got {whitespace!r}"[:300],
            "structured_outputs",
        )
    kind, field = kinds[0], f"structured_outputs.{kinds[0]}"
    if kind == "json_object":
        if value[kind] is not True:
            raise invalid(f"{field} must be true or absent, got {value[kind]!r}"[:300], "structured_outputs")
        return StructuredOutput(json_object=True, disable_any_whitespace=bool(whitespace)), field
    return _kind(kind, value[kind], field, bool(whitespace)), field


def _guided(name: str, value: Any) -> tuple[StructuredOutput, str] | None:
    if value is None:
        return None
    return _kind(name.removeprefix("guided_"), value, name, False), name


def _kind(kind: str, value: Any, field: str, no_whitespace: bool) -> StructuredOutput:
    param = field.split(".", 1)[0]
    if kind == "json":
        return _json(value, field, no_whitespace)
    if kind == "choice":
        if not isinstance(value, list) or not value:
            raise invalid(f"{field} must be a non-empty list of strings, got {value!r}"[:300], param)
        if len(value) > MAX_CHOICES:
            raise invalid(f"{field} may hold at most {MAX_CHOICES} strings, got {len(value)}", param)
        bad = next((v for v in value if not isinstance(v, str) or not v), None)
        if bad is not None:
            raise invalid(f"{field} must hold non-empty strings, got {bad!r}"[:300], param)
        return StructuredOutput(choice=tuple(value))
    if not isinstance(value, str) or not value:  # regex, grammar
        raise invalid(f"{field} must be a non-empty string, got {value!r}"[:300], param)
    return StructuredOutput(**{kind: value})


def _json(schema: Any, field: str, no_whitespace: bool) -> StructuredOutput:
    try:
        text = schema_text(schema, field)
    except ValueError as exc:
        raise invalid(str(exc), field.split(".", 1)[0]) from None
    return StructuredOutput(json=text, disable_any_whitespace=no_whitespace)
