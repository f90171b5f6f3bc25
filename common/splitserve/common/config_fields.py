"""Frozen configs built from CLI flags and SPLITSERVE_* environment variables.

A config is a frozen dataclass whose fields carry `option(...)` metadata: help text and
the allowed range or choices. `add_arguments` turns the fields into argparse flags
(`--max-num-seqs`), `from_namespace` builds the config with the precedence
flag > SPLITSERVE_<FIELD> variable > default, and `validate_fields` checks every value
against its range, raising `ConfigError` naming the flag, the value and what is allowed.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import types
import typing
from collections.abc import Mapping
from typing import Any

ENV_PREFIX = "SPLITSERVE_"


class ConfigError(ValueError):
    """A configuration value is out of range or malformed."""


def option(
    default: Any,
    help: str,
    *,
    min: float | None = None,
    max: float | None = None,
    choices: tuple | None = None,
    min_exclusive: bool = False,
    secret: bool = False,
    aliases: tuple[str, ...] = (),
    negated_by: str = "",
) -> Any:
    """A dataclass field with its help text and allowed range or choices; a `secret` one is never printed.
    `aliases`: more flags of the same meaning (vLLM's name where ours differs); `negated_by`: a flag that
    sets a bool field to False (vLLM's `--disable-*` beside our `--enable-*`)."""
    meta = {"help": help, "min": min, "max": max, "choices": choices, "min_exclusive": min_exclusive, "secret": secret}
    meta.update(aliases=tuple(aliases), negated_by=negated_by)
    if isinstance(default, (list, dict, set)):
        raise TypeError("mutable defaults are not allowed in frozen configs")
    return dataclasses.field(default=default, metadata=meta)


def internal_token_option() -> Any:
    """The shared secret of internal calls (splitserve.runtime.grpc_server.InternalAuth), one option for
    every process that makes or serves them."""
    return option(
        "",
        "shared secret every internal call carries and every internal service checks (set it through "
        "SPLITSERVE_INTERNAL_TOKEN: a flag shows in ps); empty = none",
        secret=True,
    )


def flag_name(field_name: str) -> str:
    return "--" + field_name.replace("_", "-")


def env_name(field_name: str) -> str:
    return ENV_PREFIX + field_name.upper()


def _base_type(tp: Any) -> tuple[type, bool]:
    """(scalar type, optional?) for annotations like `int | None`."""
    if isinstance(tp, str):
        raise TypeError(f"unresolved annotation {tp!r}")
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return args[0], True
    return tp, False


def _parse(field: dataclasses.Field, raw: str, tp: type) -> Any:
    flag = flag_name(field.name)
    if tp is bool:
        lowered = raw.strip().lower()
        if lowered in ("1", "true", "yes", "on"):
            return True
        if lowered in ("0", "false", "no", "off"):
            return False
        raise ConfigError(f"{flag}: expected true or false, got {raw!r}")
    try:
        return tp(raw)
    except ValueError:
        raise ConfigError(f"{flag}: expected {tp.__name__}, got {raw!r}") from None


def add_arguments(parser: argparse.ArgumentParser, cls: type, exclude: frozenset[str] = frozenset()) -> None:
    """Add one flag per field of the config dataclass `cls` but those in `exclude` (defaults resolved later)."""
    hints = typing.get_type_hints(cls)
    group = parser.add_argument_group(cls.__name__)
    for field in dataclasses.fields(cls):
        if field.name in exclude:
            continue
        tp, _ = _base_type(hints[field.name])
        meta = field.metadata
        extra = []
        if meta.get("choices"):
            extra.append("one of " + ", ".join(map(str, meta["choices"])))
        if meta.get("min") is not None or meta.get("max") is not None:
            extra.append(f"range [{meta.get('min', '')}, {meta.get('max', '')}]")
        help_text = f"{meta.get('help', '')} (default: {field.default}; env {env_name(field.name)}"
        help_text += "; " + "; ".join(extra) + ")" if extra else ")"
        flags = (flag_name(field.name), *meta.get("aliases", ()))
        if tp is bool:
            group.add_argument(
                *flags,
                dest=field.name,
                default=None,
                action=argparse.BooleanOptionalAction,
                help=help_text,
            )
            if meta.get("negated_by"):
                group.add_argument(
                    meta["negated_by"],
                    dest=field.name,
                    action="store_const",
                    const=False,
                    help=f"the same as --no-{flag_name(field.name)[2:]}",
                )
        else:
            group.add_argument(
                *flags,
                dest=field.name,
                default=None,
                type=str,
                metavar=tp.__name__.upper(),
                help=help_text,
            )


def from_namespace(
    cls: type,
    ns: argparse.Namespace | Mapping[str, Any] | None = None,
    env: Mapping[str, str] | None = None,
    **overrides: Any,
) -> Any:
    """Build and validate `cls`: overrides > flags > SPLITSERVE_* env > defaults."""
    values = vars(ns) if isinstance(ns, argparse.Namespace) else dict(ns or {})
    env = os.environ if env is None else env
    hints = typing.get_type_hints(cls)
    kwargs: dict[str, Any] = {}
    for field in dataclasses.fields(cls):
        tp, optional = _base_type(hints[field.name])
        if field.name in overrides:
            kwargs[field.name] = overrides[field.name]
            continue
        raw = values.get(field.name)
        if raw is None and env_name(field.name) in env:
            raw = env[env_name(field.name)]
        if raw is None:
            continue
        if isinstance(raw, str):
            if optional and raw.strip().lower() in ("", "none"):
                kwargs[field.name] = None
                continue
            raw = _parse(field, raw, tp)
        kwargs[field.name] = raw
    config = cls(**kwargs)
    validate_fields(config)
    return config


def validate_fields(config: Any) -> None:
    """Check every field against its option() range/choices; raise ConfigError naming the flag."""
    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        if value is None:
            continue
        meta, flag = field.metadata, flag_name(field.name)
        choices = meta.get("choices")
        if choices and value not in choices:
            raise ConfigError(f"{flag}={value!r} is not allowed; choose one of {', '.join(map(str, choices))}")
        low, high = meta.get("min"), meta.get("max")
        if low is None and high is None:
            continue
        bounds = f"[{low}, {high}]" if not meta.get("min_exclusive") else f"({low}, {high}]"
        if value != value:  # nan passes every comparison below
            raise ConfigError(f"{flag}={value} is not a number; allowed {bounds}")
        too_low = low is not None and (value <= low if meta.get("min_exclusive") else value < low)
        if too_low or (high is not None and value > high):
            raise ConfigError(f"{flag}={value} is out of range; allowed {bounds}")


def describe(config: Any) -> str:
    """One line per field, for printing the effective config at start."""
    name = type(config).__name__

    def shown(field: dataclasses.Field) -> str:
        value = getattr(config, field.name)
        return "'<set>'" if field.metadata.get("secret") and value else repr(value)

    lines = [f"{name}:"] + [f"  {f.name} = {shown(f)}" for f in dataclasses.fields(config)]
    return "\n".join(lines)


def describe_changes(config: Any) -> str:
    """One line: the fields set away from their defaults (secrets hidden), for the start-up summary."""

    def shown(field: dataclasses.Field) -> str:
        value = getattr(config, field.name)
        return "'<set>'" if field.metadata.get("secret") else repr(value)

    changed = [f"{f.name}={shown(f)}" for f in dataclasses.fields(config) if getattr(config, f.name) != f.default]
    return f"{type(config).__name__}: {', '.join(changed) if changed else 'defaults'}"
