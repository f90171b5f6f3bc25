"""Structured output in the engine: xgrammar grammars, one matcher per request, the token bitmask.

    SamplingParams.structured_output (a StructuredOutput spec)
        │ check_spec: the service process checks its size and parses it (no tokenizer, cheap) before
        │             queueing any work; a refusal starts with REFUSAL_PREFIX and carries xgrammar's message
        │ grammar_backend.GrammarBackend: the engine core compiles it against the model's tokenizer
        │             (compile_spec) on trial in a worker process it can kill (a time budget, the request's
        │             abort), then for itself, cached by spec; a spec whose fresh matcher allows no token
        │             (it only refers to itself) is refused there
        ▼
    RequestGrammar on the Request: accept(token) for every output token as it is appended (the prefill's
        first token included: a decode that imports a request starts a fresh matcher from the spec and
        accepts the first token, which is exact and cheap); is_terminated ends the request with stop; a token
        it refuses (a dead end: every token was masked) ends that request alone with an error
        │ build_token_mask: host fill of one bitmask row per grammar row, while the forward pass runs
        ▼
    apply_token_mask (the sampler's first step): tokens the grammar forbids -> -inf

xgrammar imports torch, so the gateway never imports this module (pyproject's import-linter contracts). It is
imported with this module, when a service or an engine core starts: its first import holds the GIL for about half a
second of CPU (seconds on a loaded machine), which on first use stalled a service's event loop (every stream it
relays) or a core's step loop.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import torch
import xgrammar

from splitserve.common.structured_output import REFUSAL_PREFIX, StructuredOutput

# xgrammar's errors start with "[hh:mm:ss] /path/file.cc:NN: " and may hold "Check failed: (...) is false: "
_LOG_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:\d+: ")
_CHECK_FAILED = re.compile(r"Check failed: \(.*?\) is false: ")
KIND_LABELS = {
    "json": "JSON schema",
    "json_object": "JSON object",
    "regex": "regex",
    "choice": "choice",
    "grammar": "grammar",
}
_EBNF_ESCAPES = {"\\": "\\\\", '"': '\\"', "\n": "\\n", "\r": "\\r", "\t": "\\t"}


def xgrammar_message(exc: BaseException) -> str:
    """xgrammar's message without its log prefix (time, C++ source file and line) and trailing newline."""
    text = _LOG_PREFIX.sub("", str(exc).strip())
    return _CHECK_FAILED.sub("", text)


def refusal(spec: StructuredOutput, exc: BaseException) -> ValueError:
    """The ValueError a service and the engine raise for a spec xgrammar refuses (the gateway reads the prefix)."""
    return ValueError(f"{REFUSAL_PREFIX}invalid {KIND_LABELS[spec.kind]}: {xgrammar_message(exc)}")


def choice_grammar(choices: tuple[str, ...]) -> str:
    """EBNF whose language is exactly `choices` (as vLLM builds it for guided_choice)."""
    literals = ("".join(_EBNF_ESCAPES.get(c, c) for c in choice) for choice in choices)
    return "root ::= " + " | ".join(f'"{literal}"' for literal in literals)


def check_spec(spec: StructuredOutput, max_spec_bytes: int | None = None) -> None:
    """Parse `spec` as xgrammar will (no tokenizer needed); ValueError (REFUSAL_PREFIX ...) when it cannot, or when
    it is larger than `max_spec_bytes` (checked first: parsing costs time). Runs in the service processes before a
    request is queued."""
    if max_spec_bytes is not None:
        check_spec_size(spec, max_spec_bytes)
    try:
        if spec.json is not None:
            xgrammar.Grammar.from_json_schema(spec.json, any_whitespace=not spec.disable_any_whitespace)
        elif spec.regex is not None:
            xgrammar.Grammar.from_regex(spec.regex)
        elif spec.choice is not None:
            xgrammar.Grammar.from_ebnf(choice_grammar(spec.choice))
        elif spec.grammar is not None:
            xgrammar.Grammar.from_ebnf(spec.grammar)
    except RuntimeError as exc:
        raise refusal(spec, exc) from None


class GrammarDeadEnd(ValueError):
    """A request's grammar forbids the token it was given: at a dead end of the spec (no token allowed, so the
    sampler picked a masked one), or a token from elsewhere (a prefill's first token). It ends that request
    alone, with this message; the engine steps on."""


class RequestGrammar:
    """One request's grammar state: which tokens may come next, advanced by every output token."""

    def __init__(self, matcher: xgrammar.GrammarMatcher) -> None:
        self._matcher = matcher

    def accept(self, token_id: int) -> None:
        """Advance over `token_id`; GrammarDeadEnd when the grammar does not allow it here."""
        if not self._matcher.accept_token(token_id):
            raise GrammarDeadEnd(f"{REFUSAL_PREFIX}token {token_id} does not match the request's grammar at this point")

    @property
    def is_terminated(self) -> bool:
        """The grammar is complete and its stop token was accepted: the output is done."""
        return self._matcher.is_terminated()

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into `bitmask[row]` (bit t of word t // 32 set = token t allowed)."""
        self._matcher.fill_next_token_bitmask(bitmask, row)


def spec_bytes(spec: StructuredOutput) -> int:
    """How big a spec is, in UTF-8 bytes of its text (the choices joined), for --structured-output-max-spec-bytes."""
    if spec.choice is not None:
        return sum(len(c.encode()) for c in spec.choice)
    text = spec.json or spec.regex or spec.grammar or ""
    return len(text.encode())


def check_spec_size(spec: StructuredOutput, max_spec_bytes: int) -> None:
    """ValueError (REFUSAL_PREFIX ...) naming the limit when `spec` is larger than `max_spec_bytes`."""
    size = spec_bytes(spec)
    if size > max_spec_bytes:
        raise ValueError(
            f"{REFUSAL_PREFIX}{KIND_LABELS[spec.kind]} is {size} bytes; this engine compiles at most "
            f"{max_spec_bytes} (--structured-output-max-spec-bytes)"
        )


def load_tokenizer_info(model_dir: str, vocab_size: int, stop_token_ids: tuple[int, ...]) -> xgrammar.TokenizerInfo:
    """The model directory's tokenizer (through transformers, as vLLM loads it) as xgrammar sees it; the bitmask
    covers `vocab_size` (the lm_head's width). ValueError (REFUSAL_PREFIX ...) when the model has no tokenizer."""
    directory = Path(model_dir)
    if not (directory / "tokenizer.json").exists() and not (directory / "tokenizer_config.json").exists():
        raise ValueError(
            f"{REFUSAL_PREFIX}this engine serves {model_dir!r}, which has no tokenizer files; "
            "structured output needs the model's tokenizer"
        )
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(directory)
    return xgrammar.TokenizerInfo.from_huggingface(
        tokenizer, vocab_size=vocab_size, stop_token_ids=list(stop_token_ids) or None
    )


def compile_spec(compiler: xgrammar.GrammarCompiler, spec: StructuredOutput) -> xgrammar.CompiledGrammar:
    """The compiled grammar of `spec`; ValueError (REFUSAL_PREFIX ...) when xgrammar refuses it, or when it admits
    no first token at all (a self-referencing schema or rule: nothing can ever match)."""
    try:
        if spec.json is not None:
            compiled = compiler.compile_json_schema(spec.json, any_whitespace=not spec.disable_any_whitespace)
        elif spec.json_object:
            compiled = compiler.compile_builtin_json_grammar()
        elif spec.regex is not None:
            compiled = compiler.compile_regex(spec.regex)
        elif spec.choice is not None:
            compiled = compiler.compile_grammar(choice_grammar(spec.choice))
        else:
            compiled = compiler.compile_grammar(spec.grammar)
    except RuntimeError as exc:
        raise refusal(spec, exc) from None
    if not _admits_a_first_token(compiled):
        raise ValueError(
            f"{REFUSAL_PREFIX}{KIND_LABELS[spec.kind]} admits no output: no token can start a string it matches "
            "(a rule or schema that only refers to itself?)"
        )
    return compiled


def _admits_a_first_token(compiled: xgrammar.CompiledGrammar) -> bool:
    """Whether a fresh matcher allows any token (a stop token counts: the empty string may match)."""
    bitmask = xgrammar.allocate_token_bitmask(1, compiled.tokenizer_info.vocab_size)  # (1, ceil(V / 32)) int32
    xgrammar.GrammarMatcher(compiled).fill_next_token_bitmask(bitmask, 0)
    return bool(bitmask.any())


@dataclass
class TokenMask:
    """Which tokens each constrained row may take: `bitmask[i]` (int32 words, bit t % 32 of word t // 32 set =
    token t allowed) applies to logits row `rows[i]`."""

    rows: torch.Tensor  # (G,) int64, on the logits' device
    bitmask: torch.Tensor  # (G, ceil(V / 32)) int32, on the logits' device


def build_token_mask(
    grammars: list[tuple[int, RequestGrammar]], vocab_size: int, device: torch.device, pin: bool
) -> TokenMask | None:
    """Fill one bitmask row per (logits row, grammar) on the host and start its copy to `device`
    (non-blocking from pinned memory): called after the forward pass is launched, so on CUDA the fill
    overlaps the model. None when no row is constrained."""
    if not grammars:
        return None
    num_words = -(-vocab_size // 32)
    host = torch.empty((len(grammars), num_words), dtype=torch.int32, pin_memory=pin)  # (G, W)
    for i, (_, grammar) in enumerate(grammars):
        grammar.fill(host, i)
    rows = torch.tensor([row for row, _ in grammars], dtype=torch.int64, pin_memory=pin)  # (G,)
    return TokenMask(rows.to(device, non_blocking=True), host.to(device, non_blocking=True))


def apply_token_mask(logits: torch.Tensor, mask: TokenMask | None) -> torch.Tensor:
    """Set the logits of forbidden tokens to -inf, in place; (B, V) in, the same tensor out."""
    if mask is None:
        return logits
    vocab_size = logits.shape[-1]
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)  # (32,)
    bits = (mask.bitmask[:, :, None] >> shifts) & 1  # (G, W, 32)
    allowed = bits.reshape(bits.shape[0], -1)[:, :vocab_size].bool()  # (G, V)
    constrained = logits[mask.rows]  # (G, V)
    logits[mask.rows] = constrained.masked_fill(~allowed, float("-inf"))
    return logits
