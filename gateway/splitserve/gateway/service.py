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
import struct
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

from splitserve.common import wire
from splitserve.common.sampling_params import MAX_SEED, MAX_SEQUENCES, SamplingParams
from splitserve.gateway import request_log
from splitserve.gateway.admission import LocalCounts
from splitserve.gateway.auth import ANONYMOUS
from splitserve.gateway.errors import GatewayError, invalid
from splitserve.gateway.heap import trim_heap
from splitserve.gateway.limits import RateLimiter
from splitserve.gateway.observe import FINISH_REASON_NAMES, GatewayMetrics
from splitserve.gateway.registry import Registry
from splitserve.gateway.request_run import RequestRun, RunDeps
from splitserve.gateway.router import Router
from splitserve.gateway.sequences import SequenceRun, best_of, merged
from splitserve.protos import common_pb2, generation_pb2

log = logging.getLogger("splitserve.gateway")

MAX_REQUEST_ID_CHARS = 256
MAX_TOP_K = 2**31 - 1  # the wire's int32
MAX_UINT32 = 2**32 - 1
_FLOAT_FIELDS = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")


@dataclass(frozen=True)
class ChatOptions:
    """vLLM's chat template fields. continue_final_message leaves the last (assistant) message open
    for the model to continue (no generation prompt then); template_kwargs reach the template as
    variables, as (name, value) pairs."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    template_kwargs: tuple[tuple[str, Any], ...] = ()
    tools: tuple[dict, ...] | None = None  # function tools, passed to the template as transformers does
    message_extras: tuple[tuple[tuple[str, Any], ...], ...] = ()  # per turn: tool_calls, tool_call_id, name


@dataclass(frozen=True)
class GenerationInput:
    """One request as both front ends hand it over; exactly one of text/token_ids/chat is set.

    `params` is already validated (stop strings and detokenizer options included);
    `chat` holds (role, content) turns. `max_tokens_param` names the field the client set
    max_tokens with: such a max_tokens must fit in the context with the prompt (else 400).
    None: not set; the default (SamplingParams') applies, cut to what the context holds.
    """

    request_id: str
    model: str
    params: SamplingParams
    text: str | None = None
    token_ids: tuple[int, ...] | None = None
    chat: tuple[tuple[str, str], ...] | None = None
    priority: int = 0
    max_tokens_param: str | None = None
    add_special_tokens: bool = True  # text prompts: the tokenizer's BOS/EOS, as vLLM's completions API
    chat_options: ChatOptions | None = None  # chat prompts: how the template renders them
    echo: bool = False  # completions' echo: the first message's text starts with the prompt's
    echo_only: bool = False  # echo with max_tokens 0: the prompt alone (the one token computed is dropped)
    # where params.structured_output came from (e.g. "response_format.json_schema.schema", "guided_regex"): a
    # prefill or decode that refuses the spec (xgrammar cannot compile it) is answered 400 naming this field
    structured_field: str = ""
    n: int = 1  # sequences returned (gateway/sequences.py)
    best_of: int | None = None  # sequences generated (None: n); the n best are returned


def check_sequences(n: int, best_of: int | None, stream: bool) -> None:
    """OpenAI's n and vLLM's best_of: 1 <= n <= best_of <= MAX_SEQUENCES; best_of > n is not streamed."""
    for name, value in (("n", n), ("best_of", best_of)):
        if value is not None and not 1 <= value <= MAX_SEQUENCES:
            raise invalid(f"{name} must be >= 1 and <= {MAX_SEQUENCES}, got {value}", name)
    if best_of is not None and best_of < n:
        raise invalid(f"best_of must be >= n ({n}), got {best_of}", "best_of")
    if stream and best_of is not None and best_of > n:
        raise invalid(
            f"best_of > n ({best_of} > {n}) cannot be streamed: the best {n} are known only when all {best_of} "
            "have ended; set stream to false or best_of to n",
            "best_of",
        )


def build_sampling_params(values: dict[str, Any], max_stop_strings: int) -> SamplingParams:
    """SamplingParams from request values; INVALID_ARGUMENT naming the field when invalid.

    Float fields travel as float32: a value valid as given but not once rounded (top_p=1e-50
    becomes 0.0) is refused here rather than by the prefill or decode.
    """
    rounded: dict[str, float] = {}
    for name in _FLOAT_FIELDS:
        value = values.get(name)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            try:
                as_float = float(value)
            except OverflowError:  # an integer beyond any float
                raise invalid(
                    f"{name} must be a number within its range, got an integer of {len(str(abs(value)))} digits", name
                ) from None
            try:
                rounded[name] = struct.unpack("f", struct.pack("f", as_float))[0]
            except OverflowError:  # beyond float32: outside every allowed range, refused below
                pass
    try:
        params = SamplingParams.from_dict(values)
    except (ValueError, TypeError) as exc:
        raise invalid(str(exc)) from None
    changed = {k: v for k, v in rounded.items() if v != values[k]}
    if changed:
        try:
            params = SamplingParams.from_dict({**values, **changed})
        except (ValueError, TypeError) as exc:
            raise invalid(f"{exc} (the request's value rounded to float32, as it is sent on)") from None
    if len(params.stop) > max_stop_strings:
        raise invalid(f"stop must have at most {max_stop_strings} strings, got {len(params.stop)}", "stop")
    return params


def sampling_values_from_proto(msg: common_pb2.SamplingParams) -> dict[str, Any]:
    """The fields a gRPC caller set, as SamplingParams keyword values."""
    values: dict[str, Any] = {name: getattr(msg, name) for name in wire.OPTIONAL_SAMPLING_FIELDS if msg.HasField(name)}
    values["stop_token_ids"] = list(msg.stop_token_ids)
    values["ignore_eos"] = msg.ignore_eos
    values["logit_bias"] = dict(msg.logit_bias)
    if msg.HasField("structured_output"):
        try:
            values["structured_output"] = wire.structured_from_proto(msg.structured_output)
        except ValueError as exc:
            raise invalid(f"sampling.{exc}", "structured_output") from None
    return values


# Texts up to this many characters are tokenized on the event loop (tens of microseconds); longer
# ones on a thread, through the tokenizer's GIL-releasing batch call.
INLINE_TOKENIZE_CHARS = 8192
TRIM_AFTER_CHARS = 128 << 10  # a text this long is encoded, then the freed heap goes back to the system


def prompt_tokens_bound(inp: GenerationInput) -> int:
    """At most how many tokens an input's prompt has: its ids, or a text's UTF-8 bytes (a token covers at least
    one byte; counted before tokenizing, so a refusal costs no work)."""
    if inp.token_ids is not None:
        return len(inp.token_ids)
    return len((inp.text or "").encode()) + sum(len(content.encode()) for _, content in inp.chat or ())


def answer_entries(inp: GenerationInput, max_model_len: int) -> int:
    """At most how many token entries (a token, or one of its top alternatives) an input's answer holds: its
    sequences' tokens and, with prompt_logprobs or echo, its prompt's, all capped by the context."""
    params = inp.params
    top = 1 + max(params.logprobs or 0, 0)
    tokens = min(params.max_tokens if params.max_tokens is not None else max_model_len, max_model_len)
    entries = (inp.best_of or inp.n) * tokens * top
    if params.prompt_logprobs is not None or inp.echo:
        prompt = prompt_tokens_bound(inp)
        entries += min(prompt, max_model_len) * (1 + max(params.prompt_logprobs or 0, params.logprobs or 0))
    return entries


def request_tokens(inp: GenerationInput, max_model_len: int) -> int:
    """At most how many tokens an input asks the engines for: each sequence's prompt and output, a sequence
    never past the context (max_tokens unset: up to the context)."""
    max_tokens = inp.params.max_tokens if inp.params.max_tokens is not None else max_model_len
    return (inp.best_of or inp.n) * min(prompt_tokens_bound(inp) + max_tokens, max_model_len)


class GatewayService:
    """Validation, admission, tokenization and the per-request runs.

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
    ) -> None:
        self.registry = registry
        self.chat_template = chat_template  # --chat-template: every chat is rendered with it
        self._served_model_names = tuple(served_model_names)
        self.router = router
        self.tokenizer = tokenizer
        self.max_concurrent_requests = max_concurrent_requests
        self.max_stop_strings = max_stop_strings
        self.max_answer_entries = max_answer_entries
        self.max_request_tokens = max_request_tokens
        self.request_timeout_s = request_timeout_s
        self.limiter = limiter or RateLimiter()
        self.metrics = metrics
        self.vocab_size = len(tokenizer)
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

    # -- model and tokenization ------------------------------------------------------------

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

    async def tokenize_text(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """A text prompt's ids as the tokenizer defines them, special tokens included (BOS where the
        model's tokenizer adds one), as transformers and vLLM encode a completion prompt. Past
        INLINE_TOKENIZE_CHARS the work runs on a thread (the event loop never runs O(prompt) work)."""
        if len(text) <= INLINE_TOKENIZE_CHARS:
            return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))
        return list(await asyncio.to_thread(self._encode_large, text, add_special_tokens))

    def _encode_large(self, text: str, add_special_tokens: bool) -> list[int]:
        """On a worker thread: a long text's ids; past TRIM_AFTER_CHARS the heap its encoding took goes back to the
        system (a 1 MB text's encoding peaks at ~250 MB, and glibc kept ~70 MB of it: 102 MB RSS after, 81 after a
        trim, from 35)."""
        ids = self.tokenizer.encode(text, add_special_tokens)
        if len(text) > TRIM_AFTER_CHARS:
            trim_heap()
        return ids

    async def tokenize_chat(self, turns: Sequence[tuple[str, str]], options: ChatOptions | None = None) -> list[int]:
        """The chat rendered with the model's template, then encoded without special tokens (the
        template writes them); long conversations off the event loop."""
        from functools import partial

        from splitserve.common.tokenizer import apply_chat_template

        options = options or ChatOptions()
        if options.continue_final_message and options.add_generation_prompt:
            raise invalid(
                "continue_final_message continues the last message: set add_generation_prompt to false with it",
                "continue_final_message",
            )
        extras = options.message_extras or ((),) * len(turns)
        render = partial(
            apply_chat_template,
            self.tokenizer,
            [{"role": r, "content": c, **dict(extra)} for (r, c), extra in zip(turns, extras)],
            options.add_generation_prompt,
            continue_final_message=options.continue_final_message,
            chat_template=self.chat_template,
            chat_template_kwargs=dict(options.template_kwargs),
            tools=list(options.tools) if options.tools is not None else None,
        )
        try:
            if sum(len(c) for _, c in turns) <= INLINE_TOKENIZE_CHARS:
                return render()
            return await asyncio.to_thread(render)
        except ValueError as exc:
            raise invalid(str(exc), "messages") from None
        except Exception as exc:  # a template that raises (e.g. roles must alternate)
            raise invalid(f"messages cannot be rendered with the chat template: {exc}", "messages") from None

    async def detokenize(
        self, token_ids: Sequence[int], skip_special_tokens: bool = False, param: str = "tokens"
    ) -> str:
        """Text of `token_ids` (each checked against the vocabulary); long lists off the event loop."""
        for token_id in token_ids:
            if isinstance(token_id, bool) or not isinstance(token_id, int) or not 0 <= token_id < self.vocab_size:
                raise invalid(
                    f"{param} must hold token ids 0..{self.vocab_size - 1} (the vocabulary), got {token_id!r}", param
                )
        if len(token_ids) <= INLINE_TOKENIZE_CHARS // 4:
            return self.tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens)
        return await asyncio.to_thread(self.tokenizer.decode, list(token_ids), skip_special_tokens=skip_special_tokens)

    async def prompt_token_ids(self, inp: GenerationInput) -> list[int]:
        """Tokenize and check the prompt: non-empty, ids in the vocabulary, within the context."""
        if inp.chat is not None:
            if not inp.chat:
                raise invalid("messages must not be empty", "messages")
            ids = await self.tokenize_chat(inp.chat, inp.chat_options)
            param = "messages"
        elif inp.token_ids is not None:
            ids = list(inp.token_ids)
            param = "prompt"
            for token_id in ids:
                if not 0 <= token_id < self.vocab_size:
                    raise invalid(
                        f"prompt token id {token_id} is out of range; the vocabulary has "
                        f"{self.vocab_size} tokens (ids 0..{self.vocab_size - 1})",
                        "prompt",
                    )
        else:
            ids = await self.tokenize_text(inp.text or "", inp.add_special_tokens)
            param = "prompt"
        if not ids:
            raise invalid(f"{param} must not be empty", param)
        limit = self.registry.max_model_len
        if limit and len(ids) >= limit:
            raise invalid(
                f"{param} has {len(ids)} tokens, but the model's context limit (max_model_len) "
                f"is {limit} tokens, which must also hold at least one generated token",
                param,
            )
        return ids

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
        params = inp.params
        if params.top_k > MAX_TOP_K:
            raise invalid(f"top_k must be -1, 0 (off) or at most {MAX_TOP_K}, got {params.top_k}", "top_k")
        for token_id in params.stop_token_ids:
            if token_id >= self.vocab_size:
                raise invalid(
                    f"stop_token_ids must be token ids below the vocabulary size {self.vocab_size}, got {token_id}",
                    "stop_token_ids",
                )
        for token_id, _ in params.logit_bias[-1:]:  # ascending ids: the last is the largest
            if token_id >= self.vocab_size:
                raise invalid(
                    f"logit_bias keys must be token ids below the vocabulary size {self.vocab_size}, got {token_id}",
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
        prompt_ids = await self.prompt_token_ids(inp)
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
                echo_text = inp.text if inp.text is not None else await self.detokenize(prompt_ids, param="prompt")
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
