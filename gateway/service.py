"""The request path shared by the gRPC API and the REST shim.

    GenerationInput ──validate, admit, tokenize, seed──▶ RequestRun.stream()
                                                         (prefill → decode, detokenize)
                    ◀──────────── GenerateResponse messages ─────────────

Everything that can be refused is refused before the first message (GatewayError), so
both front ends can still answer with a status code; later failures end the stream with
a last message whose finish_reason is ERROR and whose `error` says why.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
import uuid
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any, AsyncIterator, Sequence

from engine.sampling_params import MAX_SEED, SamplingParams
from gateway.errors import GatewayError, invalid
from gateway.registry import Registry
from gateway.request_run import RequestRun
from gateway.router import Router
from protos import common_pb2, generation_pb2

log = logging.getLogger("splitserve.gateway")

_OPTIONAL_SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "seed", "repetition_penalty",
                             "presence_penalty", "frequency_penalty", "max_tokens", "min_tokens", "logprobs")


@dataclass(frozen=True)
class GenerationInput:
    """One request as both front ends hand it over; exactly one of text/token_ids/chat is set.

    `params` is already validated (stop strings and detokenizer options included);
    `chat` holds (role, content) turns.
    """

    request_id: str
    model: str
    params: SamplingParams
    text: str | None = None
    token_ids: tuple[int, ...] | None = None
    chat: tuple[tuple[str, str], ...] | None = None
    priority: int = 0


def build_sampling_params(values: dict[str, Any], max_stop_strings: int) -> SamplingParams:
    """SamplingParams from request values; INVALID_ARGUMENT naming the field when invalid."""
    try:
        params = SamplingParams.from_dict(values)
    except (ValueError, TypeError) as exc:
        raise invalid(str(exc)) from None
    if len(params.stop) > max_stop_strings:
        raise invalid(f"stop must have at most {max_stop_strings} strings, got {len(params.stop)}", "stop")
    return params


def sampling_values_from_proto(msg: common_pb2.SamplingParams) -> dict[str, Any]:
    """The fields a gRPC caller set, as SamplingParams keyword values."""
    values: dict[str, Any] = {name: getattr(msg, name) for name in _OPTIONAL_SAMPLING_FIELDS if msg.HasField(name)}
    values["stop_token_ids"] = list(msg.stop_token_ids)
    values["ignore_eos"] = msg.ignore_eos
    return values


def sampling_to_proto(params: SamplingParams, seed: int) -> common_pb2.SamplingParams:
    """The wire form sent to prefill and decode, with the effective seed."""
    msg = common_pb2.SamplingParams(
        temperature=params.temperature, top_p=params.top_p, top_k=params.top_k, min_p=params.min_p,
        seed=seed, repetition_penalty=params.repetition_penalty,
        presence_penalty=params.presence_penalty, frequency_penalty=params.frequency_penalty,
        min_tokens=params.min_tokens, stop_token_ids=params.stop_token_ids, ignore_eos=params.ignore_eos)
    if params.max_tokens is not None:
        msg.max_tokens = params.max_tokens
    if params.logprobs is not None:
        msg.logprobs = params.logprobs
    return msg


class GatewayService:
    """Validation, admission, tokenization and the per-request runs.

    Invariant: `num_active` counts generate() calls between admission and their end.
    """

    def __init__(self, registry: Registry, router: Router, tokenizer: Any, *,
                 max_concurrent_requests: int = 1024, max_stop_strings: int = 16,
                 request_timeout_s: float = 600.0) -> None:
        self.registry = registry
        self.router = router
        self.tokenizer = tokenizer
        self.max_concurrent_requests = max_concurrent_requests
        self.max_stop_strings = max_stop_strings
        self.request_timeout_s = request_timeout_s
        self.vocab_size = len(tokenizer)
        self.num_active = 0
        self._active_ids: set[str] = set()  # request ids now running (ids share decode streams)
        self.draining = False
        self._background: set[asyncio.Task] = set()

    # -- model and tokenization ------------------------------------------------------------

    @property
    def model_id(self) -> str:
        return self.registry.model_id

    def check_model(self, model: str) -> None:
        """NOT_FOUND unless `model` is empty or the served model id."""
        served = self.model_id
        if model and served and model != served:
            raise GatewayError("not_found", f"model {model!r} is not served here; this gateway serves {served!r}",
                               param="model", code="model_not_found")

    def tokenize_text(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def tokenize_chat(self, turns: Sequence[tuple[str, str]]) -> list[int]:
        from engine.tokenizer import apply_chat_template

        try:
            return apply_chat_template(self.tokenizer, [{"role": r, "content": c} for r, c in turns])
        except ValueError as exc:
            raise invalid(str(exc), "messages") from None
        except Exception as exc:  # a template that raises (e.g. roles must alternate)
            raise invalid(f"messages cannot be rendered with the chat template: {exc}", "messages") from None

    def prompt_token_ids(self, inp: GenerationInput) -> list[int]:
        """Tokenize and check the prompt: non-empty, ids in the vocabulary, within the context."""
        if inp.chat is not None:
            if not inp.chat:
                raise invalid("messages must not be empty", "messages")
            ids = self.tokenize_chat(inp.chat)
            param = "messages"
        elif inp.token_ids is not None:
            ids = list(inp.token_ids)
            param = "prompt"
            for token_id in ids:
                if not 0 <= token_id < self.vocab_size:
                    raise invalid(f"prompt token id {token_id} is out of range; the vocabulary has "
                                  f"{self.vocab_size} tokens (ids 0..{self.vocab_size - 1})", "prompt")
        else:
            ids = self.tokenize_text(inp.text or "")
            param = "prompt"
        if not ids:
            raise invalid(f"{param} must not be empty", param)
        limit = self.registry.max_model_len
        if limit and len(ids) >= limit:
            raise invalid(f"{param} has {len(ids)} tokens, but the model's context limit (max_model_len) "
                          f"is {limit} tokens, which must also hold at least one generated token", param)
        return ids

    # -- generation ------------------------------------------------------------------------

    def _admit(self) -> None:
        if self.draining:
            raise GatewayError("unavailable", "the gateway is shutting down; retry on another gateway",
                               retry_after_s=1)
        if self.num_active >= self.max_concurrent_requests:
            raise GatewayError("resource_exhausted",
                               f"the gateway already runs {self.num_active} requests "
                               f"(max_concurrent_requests={self.max_concurrent_requests}); retry later",
                               retry_after_s=1)

    async def generate(self, inp: GenerationInput, timeout_s: float | None = None
                       ) -> AsyncIterator[generation_pb2.GenerateResponse]:
        """Run one request; yield its GenerateResponse messages (the last has finish_reason).

        Raises GatewayError before the first message when the request is refused.
        Closing the iterator early (client gone) aborts the request on every hop.
        """
        arrival_ns = time.monotonic_ns()
        self._admit()
        request_id = inp.request_id or f"req-{uuid.uuid4().hex}"
        if request_id in self._active_ids:
            raise invalid(f"request_id {request_id!r} is already running on this gateway; use a unique id",
                          "request_id")
        self.num_active += 1
        self._active_ids.add(request_id)
        try:
            self.check_model(inp.model)
            prompt_ids = self.prompt_token_ids(inp)
            seed = inp.params.seed if inp.params.seed is not None else secrets.randbelow(MAX_SEED + 1)
            budget_s = self.request_timeout_s if timeout_s is None else min(timeout_s, self.request_timeout_s)
            run = RequestRun(self, request_id=request_id,
                             params=inp.params, prompt_token_ids=prompt_ids, seed=seed,
                             priority=inp.priority, arrival_ns=arrival_ns,
                             deadline=time.monotonic() + budget_s, budget_s=budget_s)
            async with aclosing(run.stream()) as messages:
                async for message in messages:
                    yield message
        finally:
            self.num_active -= 1
            self._active_ids.discard(request_id)

    def spawn(self, coro: Any) -> None:
        """Run a cleanup coroutine in the background (kept referenced until done)."""
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def wait_idle(self, timeout_s: float) -> bool:
        """Wait until no request is active (draining); True when idle in time."""
        end = time.monotonic() + timeout_s
        while self.num_active and time.monotonic() < end:
            await asyncio.sleep(0.05)
        return self.num_active == 0
