"""What a structured-output request asks for (torch-free; vLLM's `StructuredOutputsParams`).

The gateway builds a `StructuredOutput` from `response_format`, `structured_outputs` or the older
`guided_*` fields and checks its shape here (types, exactly one kind, sizes). Whether xgrammar can
compile it is decided where xgrammar runs (the prefill and decode services, engine/grammar.py):
xgrammar imports torch, which the gateway never loads. Their refusals start with REFUSAL_PREFIX, so the
gateway can name the request field the spec came from (`refusal_detail`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

KINDS = ("json", "json_object", "regex", "choice", "grammar")
MAX_CHOICES = 1024  # strings in one choice constraint
REFUSAL_PREFIX = "structured output: "


@dataclass(frozen=True)
class StructuredOutput:
    """Exactly one constraint: a JSON schema (`json`, its JSON text), any JSON object, a regex, one of a list of
    strings, or an EBNF grammar. `disable_any_whitespace` (JSON kinds): no whitespace between JSON tokens."""

    json: str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        set_kinds = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(set_kinds) != 1:
            got = ", ".join(set_kinds) if set_kinds else "none"
            raise ValueError(f"structured output must set exactly one of {', '.join(KINDS)}; got {got}")
        if not isinstance(self.json_object, bool) or not isinstance(self.disable_any_whitespace, bool):
            raise ValueError("structured output json_object and disable_any_whitespace must be booleans")
        for name in ("json", "regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured output {name} must be a non-empty string, got {value!r}"[:300])
        if self.json is not None:
            _check_schema_text(self.json)
        if self.choice is not None:
            object.__setattr__(self, "choice", _check_choices(self.choice))

    @property
    def kind(self) -> str:
        """The one constraint set: one of KINDS."""
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    def to_dict(self) -> dict[str, Any]:
        """The set fields only (JSON-able); `StructuredOutput(**d)` inverts it."""
        d: dict[str, Any] = {self.kind: list(self.choice) if self.choice is not None else getattr(self, self.kind)}
        if self.disable_any_whitespace:
            d["disable_any_whitespace"] = True
        return d


def _check_schema_text(text: str) -> None:
    try:
        schema = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"structured output json is not valid JSON: {exc}") from None
    if not isinstance(schema, (dict, bool)):
        raise ValueError(f"structured output json must be a JSON schema (an object), got {type(schema).__name__}")


def _check_choices(choice: Any) -> tuple[str, ...]:
    if isinstance(choice, (str, bytes)) or not isinstance(choice, (list, tuple)) or not choice:
        raise ValueError(f"structured output choice must be a non-empty list of strings, got {choice!r}"[:300])
    if len(choice) > MAX_CHOICES:
        raise ValueError(f"structured output choice may hold at most {MAX_CHOICES} strings, got {len(choice)}")
    for value in choice:
        if not isinstance(value, str) or not value:
            raise ValueError(f"structured output choice must hold non-empty strings, got {value!r}"[:300])
    return tuple(choice)


def schema_text(schema: Any, field: str) -> str:
    """A JSON schema given as an object (or as its JSON text) -> its JSON text; ValueError naming `field`."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as exc:
            raise ValueError(f"{field} is not valid JSON: {exc}") from None
    if not isinstance(schema, (dict, bool)):
        raise ValueError(f"{field} must be a JSON schema (an object), got {type(schema).__name__}")
    return json.dumps(schema, ensure_ascii=False, separators=(",", ":"))


def refusal_detail(message: str) -> str | None:
    """The part after REFUSAL_PREFIX of an engine's refusal about a structured output spec, else None.
    Finds the prefix anywhere (a service may put its own words before the engine's)."""
    at = message.find(REFUSAL_PREFIX)
    return message[at + len(REFUSAL_PREFIX) :] if at >= 0 else None
