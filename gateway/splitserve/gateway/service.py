"""The request path shared by the gRPC API and the REST shim.

    GenerationInput ──request limit, admit, validate, tokenize, token limit, seed──▶ RequestRun.stream()
                                                         (prefill → decode, detokenize)
                    ◀──────────── GenerateResponse messages ─────────────

Everything that can be refused is refused before the first message (GatewayError), so
both front ends can still answer with a status code; later failures end the stream with
a last message whose finish_reason is ERROR and whose `error` says why. The client-side
metrics of every request that produced a message are recorded here (gateway/observe.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import aclosing
from typing import Any

from splitserve.common.sampling_params import MAX_SEED, SamplingParams
from splitserve.gateway import request_log
from splitserve.gateway.admission import LocalCounts
from splitserve.gateway.auth import ANONYMOUS
from splitserve.gateway.errors import GatewayError, invalid
from splitserve.gateway.generation_input import GenerationInput, answer_entries, request_tokens
from splitserve.gateway.limits import RateLimiter
from splitserve.gateway.observe import FINISH_REASON_NAMES, GatewayMetrics
from splitserve.gateway.registry import Registry
from splitserve.gateway.request_run import RequestRun, RunDeps
from splitserve.gateway.router import Router
from splitserve.gateway.sequences import SequenceRun, best_of, merged
from splitserve.gateway.tokenizing import GatewayTokenizer
from splitserve.protos import generation_pb2

log = logging.getLogger("splitserve.gateway")

MAX_REQUEST_ID_CHARS = 256
MAX_TOP_K = 2**31 - 1  # the wire's int32
MAX_UINT32 = 2**32 - 1


class GatewayService:
    """Validation, admission, tokenization (`tokens`: gateway/tokenizing.py) and the per-request runs.

    Invariant: `num_active` counts generate() calls between admission and their end.
    """

    def __init__(
        self,
        registry: Registry,
        router: Router,
        tokenizer: Any,
        *,
        max_concurrent_requests: int = 1024,
        max_stop_strings: int = 16,
        max_answer_entries: int = 1 << 20,
        max_request_tokens: int = 1 << 17,
        request_timeout_s: float = 600.0,
        limiter: RateLimiter | None = None,
        metrics: GatewayMetrics | None = None,
        served_model_names: Sequence[str] = (),
        stream_interval: int = 1,
        chat_template: str | None = None,
        counts: LocalCounts | None = None,
        processes_not_ready: Callable[[], list[int]] = list,
    ) -> None:
        self.registry = registry
        # --api-server-count N: the other processes without a full path yet (ProcessShare.processes_not_ready)
        self.processes_not_ready = processes_not_ready
        self._served_model_names = tuple(served_model_names)
        self.router = router
        self.tokenizer = tokenizer
        self.tokens = GatewayTokenizer(tokenizer, chat_template)  # --chat-template: every chat is rendered with it
        self.max_concurrent_requests = max_concurrent_requests
        self.max_stop_strings = max_stop_strings
        self.max_answer_entries = max_answer_entries
        self.max_request_tokens = max_request_tokens
        self.request_timeout_s = request_timeout_s
        self.limiter = limiter or RateLimiter()
        self.metrics = metrics
        self.num_active = 0  # this process's (gateway/admission.py counts the whole gateway's)
        self._active_ids: set[str] = set()  # request ids now running here (ids share decode streams)
        # requests and each caller's sequences in flight, for the whole gateway (all its processes)
        self.counts = counts if counts is not None else LocalCounts()
        self.draining = False
        self._background: set[asyncio.Task] = set()
        self._run_deps = RunDeps(
            router=router,
            registry=registry,
            tokenizer=tokenizer,
            spawn=self.spawn,
            stream_interval=stream_interval,
            waiting_ahead=self.counts.waiting_ahead,
        )
        # suffix of the ids this gateway gives its requests on internal hops: two gateways in front of the same
        # services may both run a caller's "req-1"; the services must see two requests
        self.instance_tag = secrets.token_hex(6)

    def check_request_size(self, inputs: Sequence[GenerationInput]) -> None:
        """Refuse (400), before any work, a request that could ask for more than max_request_tokens tokens
        (never below the context) or whose answer could hold more than max_answer_entries token entries: one
        small body (64 prompts x n 16 x prompt_logprobs 20) once built a 1.5 GB answer, and another (64 prompts x
        n 16 x 200 tokens) held the engines for minutes."""
        max_model_len = self.registry.max_model_len
        limit = max(self.max_request_tokens, max_model_len)
        tokens = sum(request_tokens(inp, max_model_len) for inp in inputs)
        if tokens > limit:
            raise invalid(
                f"the request could ask for {tokens:,} tokens (prompts x sequences x (prompt tokens + max_tokens), "
                f"a sequence at most the context of {max_model_len:,}); at most {limit:,} (--max-request-tokens): "
                "ask for fewer prompts, sequences or tokens",
                "max_tokens",
            )
        worst = sum(answer_entries(inp, max_model_len) for inp in inputs)
        if worst > self.max_answer_entries:
            params = inputs[0].params
            field = "prompt_logprobs" if params.prompt_logprobs is not None else "max_tokens"
            raise invalid(
                f"the answer could hold {worst:,} token entries (prompts x sequences x (max_tokens + prompt tokens "
                f"with prompt_logprobs or echo) x (1 + logprobs)); at most {self.max_answer_entries:,} "
                "(--max-answer-entries): ask for fewer prompts, sequences, tokens or logprobs",
                field,
            )

    # -- model ------------------------------------------------------------

    @property
    def model_id(self) -> str:
        return self.registry.model_id

    @property
    def served_names(self) -> tuple[str, ...]:
        """The names a request may give the model (--served-model-name, else the model id)."""
        if self._served_model_names:
            return self._served_model_names
        return (self.model_id,) if self.model_id else ()

    @property
    def reported_name(self) -> str:
        """The model name answers carry: the first served name, whichever one a request gave (as vLLM)."""
        served = self.served_names
        return served[0] if served else ""

    def check_model(self, model: str) -> None:
        """NOT_FOUND unless `model` is empty or one of the served names."""
        served = self.served_names
        if model and served and model not in served:
            raise GatewayError(  # a long name is cut in the middle by GatewayError
                "not_found",
                f"model {model!r} is not served here; this gateway serves {', '.join(map(repr, served))}",
                param="model",
                code="model_not_found",
            )

    # -- generation ------------------------------------------------------------------------

    def _admit(self, request_id: str) -> str:
        """Take a place among the gateway's requests in flight (every process's) for the request; its id."""
        if self.draining:
            raise GatewayError("unavailable", "the gateway is shutting down; retry on another gateway", retry_after_s=1)
        num_running = self.counts.try_admit(self.max_concurrent_requests)
        if num_running >= 0:
            raise GatewayError(
                "resource_exhausted",
                f"the gateway already runs {num_running} requests "
                f"(max_concurrent_requests={self.max_concurrent_requests}); retry later",
                retry_after_s=1,
            )
        request_id = request_id or f"req-{uuid.uuid4().hex}"
        try:
            if len(request_id) > MAX_REQUEST_ID_CHARS:
                raise invalid(
                    f"request_id must be at most {MAX_REQUEST_ID_CHARS} characters, got {len(request_id)}", "request_id"
                )
            if request_id in self._active_ids:  # this process's: internal ids carry its instance tag
                raise invalid(
                    f"request_id {request_id!r} is already running on this gateway; use a unique id", "request_id"
                )
        except GatewayError:
            self.counts.release()
            raise
        return request_id

    def check_request_limits(self, inp: GenerationInput, num_prompt_tokens: int) -> None:
        """Values the wire, the vocabulary or the context cannot hold: top_k, stop_token_ids, logit_bias, max_tokens."""
        params, vocab_size = inp.params, self.tokens.vocab_size
        if params.top_k > MAX_TOP_K:
            raise invalid(f"top_k must be -1, 0 (off) or at most {MAX_TOP_K}, got {params.top_k}", "top_k")
        for token_id in params.stop_token_ids:
            if token_id >= vocab_size:
                raise invalid(
                    f"stop_token_ids must be token ids below the vocabulary size {vocab_size}, got {token_id}",
                    "stop_token_ids",
                )
        for token_id, _ in params.logit_bias[-1:]:  # ascending ids: the last is the largest
            if token_id >= vocab_size:
                raise invalid(
                    f"logit_bias keys must be token ids below the vocabulary size {vocab_size}, got {token_id}",
                    "logit_bias",
                )
        param, max_tokens, limit = inp.max_tokens_param or "max_tokens", params.max_tokens, self.registry.max_model_len
        if inp.max_tokens_param and max_tokens is not None and limit and num_prompt_tokens + max_tokens > limit:
            raise invalid(
                f"{param} is {max_tokens}, but the prompt has {num_prompt_tokens} tokens and the model's "
                f"context limit (max_model_len) is {limit} tokens: {param} must be at most "
                f"{limit - num_prompt_tokens}",
                param,
            )
        if max_tokens is not None and max_tokens > MAX_UINT32:
            raise invalid(f"{param} must be at most {MAX_UINT32}, got {max_tokens}", param)

    async def _prepare(
        self, inp: GenerationInput, client_id: str, num_sequences: int = 1
    ) -> tuple[list[int], SamplingParams]:
        """Validate and tokenize the prompt, check the limits, fit a default max_tokens into the
        context, charge the client's tokens; the prompt ids and the params to run with."""
        self.check_model(inp.model)
        prompt_ids = await self.tokens.prompt_token_ids(inp, self.registry.max_model_len)
        self.check_request_limits(inp, len(prompt_ids))
        params, limit = inp.params, self.registry.max_model_len
        room = limit - len(prompt_ids)
        if limit and not inp.max_tokens_param and (params.max_tokens is None or params.max_tokens > room):
            if params.min_tokens > room:
                raise invalid(
                    f"min_tokens is {params.min_tokens}, but the prompt has {len(prompt_ids)} tokens and "
                    f"the model's context limit (max_model_len) is {limit} tokens: at most {room} tokens "
                    f"can be generated",
                    "min_tokens",
                )
            params = dataclasses.replace(params, max_tokens=room)  # the default, cut to what the context holds
        self.limiter.take_tokens(
            client_id, len(prompt_ids), (params.max_tokens or 0) * num_sequences, inp.max_tokens_param or "max_tokens"
        )
        return prompt_ids, params

    async def generate(
        self,
        inp: GenerationInput,
        timeout_s: float | None = None,
        client_id: str = ANONYMOUS,
        trace_carrier: dict[str, str] | None = None,
        connection: str = "",
    ) -> AsyncIterator[generation_pb2.GenerateResponse]:
        """Run one request of `client_id`; yield its GenerateResponse messages (the last has finish_reason).
        `connection` (the client's address) names the caller for its fair share when no API keys are set.

        Raises GatewayError before the first message when the request is refused (rate
        limit, admission, validation). Closing the iterator early (client gone) aborts the
        request on every hop.
        """
        arrival_ns = time.monotonic_ns()
        record = request_log.current()  # this call's request log line, when its front end keeps one
        if record is not None:
            record.add_request(inp.request_id, 0)  # named also when refused below
        self.limiter.take_request(client_id)
        request_id = self._admit(inp.request_id)
        self._enter(request_id, +1)
        observer = self.metrics.run(arrival_ns / 1e9) if self.metrics is not None else None
        if record is not None:
            record.add_request(request_id, 0)
        prompt_ids: list[int] = []
        closed_early = False
        num_sequences = inp.best_of or inp.n
        caller = client_id if client_id != ANONYMOUS else connection or ANONYMOUS
        share = self.counts.add_sequences(caller, num_sequences)
        try:
            prompt_ids, params = await self._prepare(inp, client_id, num_sequences)
            if record is not None:
                record.prompt_tokens += len(prompt_ids)
            seed = params.seed if params.seed is not None else secrets.randbelow(MAX_SEED + 1)
            echo_text = None
            if inp.echo:  # the text as given; token ids decoded as they are (special tokens kept, as vLLM)
                echo_text = (
                    inp.text if inp.text is not None else await self.tokens.detokenize(prompt_ids, param="prompt")
                )
            budget_s = self.request_timeout_s if timeout_s is None else min(timeout_s, self.request_timeout_s)
            run_fields = dict(
                request_id=request_id,
                prompt_token_ids=prompt_ids,
                priority=inp.priority,
                arrival_ns=arrival_ns,
                deadline=time.monotonic() + budget_s,
                budget_s=budget_s,
                trace_carrier=trace_carrier,
                echo_text=echo_text,
                drop_output=inp.echo_only,
                structured_field=inp.structured_field,
                share=share,
            )
            internal_id = f"{request_id}@{self.instance_tag}"
            if num_sequences == 1:
                run = RequestRun(self._run_deps, internal_id=internal_id, params=params, seed=seed, **run_fields)
                stream = run.stream()
            else:
                stream = self._sequences(inp, params, seed, internal_id, num_sequences, run_fields)
            async with aclosing(stream) as messages:
                async for message in messages:
                    if observer is not None:
                        observer.message(message)
                    if record is not None:
                        record.add_tokens(len(message.token_ids), (time.monotonic_ns() - arrival_ns) / 1e6)
                        record.add_finish(FINISH_REASON_NAMES.get(message.finish_reason, ""))
                    yield message
        except (GeneratorExit, asyncio.CancelledError):
            closed_early = True
            raise
        finally:
            self._enter(request_id, -1)
            self.counts.add_sequences(caller, -num_sequences)
            self.counts.release()
            if observer is not None:
                observer.end(len(prompt_ids), closed_early)

    def _sequences(
        self,
        inp: GenerationInput,
        params: SamplingParams,
        seed: int,
        internal_id: str,
        num_sequences: int,
        run_fields: dict,
    ) -> AsyncIterator[generation_pb2.GenerateResponse]:
        """The messages of an n > 1 (or best_of > 1) request: one lead run, the others forked from its prompt
        (gateway/sequences.py). best_of > n ranks by cumulative logprob, so logprobs are computed then."""
        run_params = params
        if num_sequences > inp.n and params.logprobs is None:
            run_params = dataclasses.replace(params, logprobs=0)
        fork_ids = [f"{internal_id}~{i}" for i in range(1, num_sequences)]  # the decode seeds them seed + i
        lead = RequestRun(
            self._run_deps, internal_id=internal_id, params=run_params, seed=seed, fork_ids=fork_ids, **run_fields
        )
        others = [
            SequenceRun(lead, internal_id=fork_id, params=run_params, seed=seed, index=i, **run_fields)
            for i, fork_id in enumerate(fork_ids, start=1)
        ]
        messages = merged([lead, *others])
        if num_sequences > inp.n:
            return best_of(messages, num_sequences, inp.n, keep_logprobs=params.logprobs is not None)
        return messages

    def _enter(self, request_id: str, step: int) -> None:
        """Count a request in (+1) or out (-1) of the active set."""
        self.num_active += step
        if step > 0:
            self._active_ids.add(request_id)
        else:
            self._active_ids.discard(request_id)
        if self.metrics is not None:
            self.metrics.set_running(self.num_active)

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
