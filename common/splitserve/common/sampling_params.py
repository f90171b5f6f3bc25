"""Per-request sampling settings, validated once at construction.

`SamplingParams` is frozen: the engine, the sampler and the detokenizer only read it.
The gateway builds it from a request body with `from_dict`, which rejects unknown keys,
and sends `to_dict()` over the wire, so both ends agree on the same field set.
"""

from __future__ import annotations

import functools
import math
from dataclasses import asdict, dataclass, fields
from typing import Any

from splitserve.common.structured_output import StructuredOutput

MAX_LOGPROBS = 20  # most top alternatives a request may ask for per token
MAX_STOP_STRINGS = 16
MAX_SEQUENCES = 16  # n and best_of: sequences of one request (each a sequence of the decode's batch)
MAX_STOP_STRING_CHARS = 256
MAX_SEED = 2**63 - 1
MAX_LOGIT_BIAS_TOKENS = 1024  # entries of one request's logit_bias (OpenAI's bias range is [-100, 100])
MAX_LOGIT_BIAS = 100.0
# Temperatures below this are treated as greedy (dividing logits by ~0 overflows).
GREEDY_TEMPERATURE_EPS = 1e-5


def _check_number(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {value!r}")
    return float(value)


def _check_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    return value


def _check_range(name: str, value: float, lo: float, hi: float, lo_open: bool = False) -> None:
    lo_ok = value > lo if lo_open else value >= lo
    if not (lo_ok and value <= hi):  # also rejects NaN
        lo_op = ">" if lo_open else ">="
        raise ValueError(f"{name} must be {lo_op} {lo:g} and <= {hi:g}, got {value!r}")


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token and when to stop.

    temperature: 0 (or below GREEDY_TEMPERATURE_EPS) means greedy argmax.
    top_k: 0 or -1 means off. top_p: 1.0 means off. min_p: 0.0 means off.
    seed: None means the engine draws one when the request is created; sampling is
        counter-based on (seed, output position), so it does not depend on the batch.
    repetition_penalty: HF semantics over prompt + output tokens (1.0 = off).
    presence_penalty / frequency_penalty: OpenAI semantics over output tokens (0.0 = off).
    max_tokens: output length cap (None = up to the model's context).
    min_tokens: EOS and stop_token_ids are masked until this many tokens were generated.
    logprobs: None = no logprobs; n >= 0 = the chosen token's logprob plus the top n.
    prompt_logprobs: None = none; n >= 0 = every prompt token's logprob (from the second on) plus
        the top n, computed by the prefill (vLLM's extension).
    stop: stop strings, matched on the detokenized text by the detokenizer.
    logit_bias: (token id, bias) pairs, ascending ids, added to the logits before penalties and
        sampling (OpenAI semantics); biases beyond [-100, 100] are clamped to it, as vLLM does.
    structured_output: a grammar the output must match (None = free text); the request ends (stop)
        when the grammar is complete. Not with min_tokens: the grammar decides where the output ends.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    stop: tuple[str, ...] = ()
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logit_bias: tuple[tuple[int, float], ...] = ()
    structured_output: StructuredOutput | None = None

    def __post_init__(self) -> None:
        self._validate_floats()
        self._validate_ints()
        self._validate_stops()
        self._validate_logit_bias()
        self._validate_structured_output()
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")

    def _set(self, name: str, value: Any) -> None:
        object.__setattr__(self, name, value)  # normalization inside a frozen dataclass

    def _validate_floats(self) -> None:
        limits = {  # name: (lo, hi, lo_open)
            "temperature": (0.0, 100.0, False),
            "top_p": (0.0, 1.0, True),
            "min_p": (0.0, 1.0, False),
            "repetition_penalty": (0.0, 10.0, True),
            "presence_penalty": (-2.0, 2.0, False),
            "frequency_penalty": (-2.0, 2.0, False),
        }
        for name, (lo, hi, lo_open) in limits.items():
            value = _check_number(name, getattr(self, name))
            _check_range(name, value, lo, hi, lo_open)
            self._set(name, value)

    def _validate_ints(self) -> None:
        top_k = _check_int("top_k", self.top_k)
        if top_k < -1:
            raise ValueError(f"top_k must be -1 or >= 0 (-1 and 0 mean off), got {top_k}")
        if self.seed is not None and not 0 <= _check_int("seed", self.seed) <= MAX_SEED:
            raise ValueError(f"seed must be >= 0 and <= 2**63-1, got {self.seed}")
        if self.max_tokens is not None and _check_int("max_tokens", self.max_tokens) < 1:
            raise ValueError(f"max_tokens must be >= 1 or None, got {self.max_tokens}")
        min_tokens = _check_int("min_tokens", self.min_tokens)
        if min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {min_tokens}")
        if self.max_tokens is not None and min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be >= 0 and <= max_tokens ({self.max_tokens}), got {min_tokens}")
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                _check_range(name, _check_int(name, getattr(self, name)), 0, MAX_LOGPROBS)
        ids = self.stop_token_ids
        if isinstance(ids, (str, bytes)) or not isinstance(ids, (list, tuple)):
            raise ValueError(f"stop_token_ids must be a list of integers, got {ids!r}")
        for token_id in ids:
            if _check_int("stop_token_ids", token_id) < 0:
                raise ValueError(f"stop_token_ids must be >= 0, got {token_id}")
        self._set("stop_token_ids", tuple(ids))

    def _validate_stops(self) -> None:
        stop = self.stop
        if isinstance(stop, str):
            stop = (stop,)  # OpenAI accepts a single string
        if not isinstance(stop, (list, tuple)):
            raise ValueError(f"stop must be a list of strings, got {stop!r}")
        if len(stop) > MAX_STOP_STRINGS:
            raise ValueError(f"stop must have at most {MAX_STOP_STRINGS} strings, got {len(stop)}")
        for s in stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop strings must be non-empty strings, got {s!r}")
            if len(s) > MAX_STOP_STRING_CHARS:
                raise ValueError(
                    f"stop strings must be at most {MAX_STOP_STRING_CHARS} characters, got one of {len(s)}"
                )
        self._set("stop", tuple(stop))

    def _validate_logit_bias(self) -> None:
        """A {token id: bias} dict or (id, bias) pairs -> sorted pairs; ids >= 0, finite biases clamped."""
        bias = self.logit_bias
        pairs = list(bias.items()) if isinstance(bias, dict) else bias
        if not isinstance(pairs, (list, tuple)) or not all(isinstance(p, (list, tuple)) and len(p) == 2 for p in pairs):
            raise ValueError(f"logit_bias must map token ids to numbers, got {bias!r}")
        if len(pairs) > MAX_LOGIT_BIAS_TOKENS:
            raise ValueError(f"logit_bias must have at most {MAX_LOGIT_BIAS_TOKENS} tokens, got {len(pairs)}")
        out: dict[int, float] = {}
        for token_id, value in pairs:
            if _check_int("logit_bias token ids", token_id) < 0:
                raise ValueError(f"logit_bias token ids must be >= 0, got {token_id}")
            value = _check_number("logit_bias values", value)
            if not math.isfinite(value):
                raise ValueError(f"logit_bias values must be finite numbers in [-100, 100], got {value!r}")
            if token_id in out:
                raise ValueError(f"logit_bias has token id {token_id} twice")
            out[token_id] = min(MAX_LOGIT_BIAS, max(-MAX_LOGIT_BIAS, value))
        self._set("logit_bias", tuple(sorted(out.items())))

    def _validate_structured_output(self) -> None:
        spec = self.structured_output
        if isinstance(spec, dict):  # from_dict / JSON
            try:
                spec = StructuredOutput(**spec)
            except TypeError as exc:
                raise ValueError(f"structured_output has an unknown field: {exc}") from None
            self._set("structured_output", spec)
        if spec is not None and not isinstance(spec, StructuredOutput):
            raise ValueError(f"structured_output must be a StructuredOutput or None, got {type(spec).__name__}")
        if spec is not None and self.min_tokens:
            raise ValueError(
                f"min_tokens ({self.min_tokens}) cannot be combined with structured output: the grammar decides "
                "where the output ends; remove min_tokens"
            )

    # the derived flags below are read for every running request on every step: computed once (the params are
    # frozen; functools.cached_property writes the instance's __dict__, which a frozen dataclass allows)
    @functools.cached_property
    def is_greedy(self) -> bool:
        """True when the sampler takes the argmax (temperature ~ 0)."""
        return self.temperature < GREEDY_TEMPERATURE_EPS

    @functools.cached_property
    def has_penalties(self) -> bool:
        """True when any of the repetition/presence/frequency penalties is active."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @functools.cached_property
    def plain_greedy(self) -> bool:
        """Greedy with nothing that changes the logits or reads them besides the argmax (no logprobs, penalties or
        logit bias); min_tokens, which masks the stop tokens until an output position, is the caller's to check."""
        return self.is_greedy and self.logprobs is None and not self.has_penalties and not self.logit_bias

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able dict (tuples become lists); `from_dict` inverts it."""
        d = asdict(self)
        d["stop_token_ids"] = list(self.stop_token_ids)
        d["stop"] = list(self.stop)
        d["logit_bias"] = [list(pair) for pair in self.logit_bias]
        d["structured_output"] = self.structured_output.to_dict() if self.structured_output is not None else None
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SamplingParams:
        """Build from a dict, rejecting unknown keys (named in the error)."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown sampling parameters: {', '.join(unknown)}; allowed: {', '.join(sorted(known))}")
        return cls(**d)
