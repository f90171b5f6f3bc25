"""Structured output in the engine: xgrammar grammars, one matcher per request, the token bitmask.

    SamplingParams.structured_output (a StructuredOutput spec)
        │ check_spec: the service process parses it (no tokenizer, cheap) before queueing any work;
        │             a refusal starts with REFUSAL_PREFIX and carries xgrammar's own message
        │ GrammarBackend.matcher: the engine core compiles it against the model's tokenizer
        │             (xgrammar caches compiled grammars per spec) and starts a matcher; a spec whose
        │             fresh matcher allows no token (it only refers to itself) is refused there
        ▼
    RequestGrammar on the Request: accept(token) for every output token as it is appended (the prefill's
        first token included: a decode that imports a request starts a fresh matcher from the spec and
        accepts the first token, which is exact and cheap); is_terminated ends the request with stop; a token
        it refuses (a dead end: every token was masked) ends that request alone with an error
        │ build_token_mask: host fill of one bitmask row per grammar row, while the forward pass runs
        ▼
    apply_token_mask (the sampler's first step): tokens the grammar forbids -> -inf

xgrammar imports torch, so the gateway never imports this module (pyproject's import-linter contracts).
"""

from __future__ import annotations

import re
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from splitserve.common.structured_output import REFUSAL_PREFIX, StructuredOutput

if TYPE_CHECKING:
    import xgrammar

# xgrammar's errors start with "[hh:mm:ss] /path/file.cc:NN: " and may hold "Check failed: (...) is false: "
_LOG_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:\d+: ")
_CHECK_FAILED = re.compile(r"Check failed: \(.*?\) is false: ")
_LABELS = {
    "json": "JSON schema",
    "json_object": "JSON object",
    "regex": "regex",
    "choice": "choice",
    "grammar": "grammar",
}
GRAMMAR_CACHE_BYTES = 256 << 20  # compiled grammars kept per engine (xgrammar's cache)
_EBNF_ESCAPES = {"\\": "\\\\", '"': '\\"', "\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _xgr():
    import xgrammar

    return xgrammar


def xgrammar_message(exc: BaseException) -> str:
    """xgrammar's message without its log prefix (time, C++ source file and line) and trailing newline."""
    text = _LOG_PREFIX.sub("", str(exc).strip())
    return _CHECK_FAILED.sub("", text)


def refusal(spec: StructuredOutput, exc: BaseException) -> ValueError:
    """The ValueError a service and the engine raise for a spec xgrammar refuses (the gateway reads the prefix)."""
    return ValueError(f"{REFUSAL_PREFIX}invalid {_LABELS[spec.kind]}: {xgrammar_message(exc)}")


def choice_grammar(choices: tuple[str, ...]) -> str:
    """EBNF whose language is exactly `choices` (as vLLM builds it for guided_choice)."""
    literals = ("".join(_EBNF_ESCAPES.get(c, c) for c in choice) for choice in choices)
    return "root ::= " + " | ".join(f'"{literal}"' for literal in literals)


def check_spec(spec: StructuredOutput) -> None:
    """Parse `spec` as xgrammar will (no tokenizer needed); ValueError (REFUSAL_PREFIX ...) when it cannot.
    Runs in the service processes before a request is queued."""
    xgr = _xgr()
    try:
        if spec.json is not None:
            xgr.Grammar.from_json_schema(spec.json, any_whitespace=not spec.disable_any_whitespace)
        elif spec.regex is not None:
            xgr.Grammar.from_regex(spec.regex)
        elif spec.choice is not None:
            xgr.Grammar.from_ebnf(choice_grammar(spec.choice))
        elif spec.grammar is not None:
            xgr.Grammar.from_ebnf(spec.grammar)
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


class GrammarBackend:
    """Compiles specs against one model's tokenizer (lazily: the first structured request pays for loading
    it) and starts matchers. The tokenizer is the model directory's, through transformers, as vLLM uses it."""

    def __init__(self, model_dir: str, vocab_size: int, stop_token_ids: tuple[int, ...]) -> None:
        self.model_dir = model_dir
        self.vocab_size = vocab_size  # the lm_head's width: the bitmask covers every logit
        self.stop_token_ids = stop_token_ids
        self._compiler: xgrammar.GrammarCompiler | None = None
        self._lock = threading.Lock()  # the compiler is made once, by whichever thread asks first
        self._pool: ThreadPoolExecutor | None = None

    def prepare(self, spec: StructuredOutput) -> Future:
        """Compile `spec` on a worker thread, so that `compile` in the step loop then finds it in xgrammar's
        cache. The core loop holds a request back until this is done: a 128k-token vocabulary takes ~0.35 s
        to compile a small schema, and xgrammar releases the GIL for most of it, so the loop steps on."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar")
        return self._pool.submit(self.compile, spec)

    def _get_compiler(self) -> xgrammar.GrammarCompiler:
        with self._lock:
            if self._compiler is None:
                self._compiler = self._make_compiler()
            return self._compiler

    def _make_compiler(self) -> xgrammar.GrammarCompiler:
        directory = Path(self.model_dir)
        if not (directory / "tokenizer.json").exists() and not (directory / "tokenizer_config.json").exists():
            raise ValueError(
                f"{REFUSAL_PREFIX}this engine serves {self.model_dir!r}, which has no tokenizer files; "
                "structured output needs the model's tokenizer"
            )
        from transformers import AutoTokenizer

        xgr = _xgr()
        tokenizer = AutoTokenizer.from_pretrained(directory)
        info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=self.vocab_size, stop_token_ids=list(self.stop_token_ids) or None
        )
        # bounded: every distinct spec a client sends stays cached (LRU) only up to this much memory
        return xgr.GrammarCompiler(info, cache_limit_bytes=GRAMMAR_CACHE_BYTES)

    def compile(self, spec: StructuredOutput) -> xgrammar.CompiledGrammar:
        """The compiled grammar of `spec` (cached by xgrammar); ValueError (REFUSAL_PREFIX ...) when invalid,
        or when it admits no first token at all (a self-referencing schema or rule: nothing can ever match)."""
        compiled = self._compile(spec)
        if not self._admits_a_first_token(compiled):
            raise ValueError(
                f"{REFUSAL_PREFIX}{_LABELS[spec.kind]} admits no output: no token can start a string it matches "
                "(a rule or schema that only refers to itself?)"
            )
        return compiled

    def _compile(self, spec: StructuredOutput) -> xgrammar.CompiledGrammar:
        compiler = self._get_compiler()
        try:
            if spec.json is not None:
                return compiler.compile_json_schema(spec.json, any_whitespace=not spec.disable_any_whitespace)
            if spec.json_object:
                return compiler.compile_builtin_json_grammar()
            if spec.regex is not None:
                return compiler.compile_regex(spec.regex)
            if spec.choice is not None:
                return compiler.compile_grammar(choice_grammar(spec.choice))
            return compiler.compile_grammar(spec.grammar)
        except RuntimeError as exc:
            raise refusal(spec, exc) from None

    def _admits_a_first_token(self, compiled: xgrammar.CompiledGrammar) -> bool:
        """Whether a fresh matcher allows any token (a stop token counts: the empty string may match)."""
        xgr = _xgr()
        bitmask = xgr.allocate_token_bitmask(1, self.vocab_size)  # (1, ceil(V / 32)) int32
        xgr.GrammarMatcher(compiled).fill_next_token_bitmask(bitmask, 0)
        return bool(bitmask.any())

    def matcher(self, spec: StructuredOutput) -> RequestGrammar:
        return RequestGrammar(_xgr().GrammarMatcher(self.compile(spec)))


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
