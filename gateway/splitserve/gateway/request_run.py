"""One request's run through prefill and decode, as a stream of GenerateResponse messages.

    disaggregated:  SeatRequest ──▶ decode link ──seat granted (the decode's batch has room)──▶
                    Prefill.Prefill ──first token──▶ client
                    DecodeRequest(kv, first token) ──▶ decode link ──TokenDeltas──▶ client
    local prefill:  DecodeRequest(no kv, no first token) ──▶ decode (colocated worker, or
                    any decode when no prefill is up or the prefill call failed, on another
                    prefill too when one was up)

The run owns the request's detokenizer and counters. Stop strings are matched here: on a
match the decode gets an AbortRequest and the output ends with STOP at the token that
completed the match. Whatever way the run ends (finished, client gone, deadline, error),
`_cleanup` aborts the decode request if still running and releases a KV lease that was
never handed to a decode.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from contextlib import aclosing
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import grpc

from splitserve.common import wire
from splitserve.common.detokenizer import IncrementalDetokenizer
from splitserve.common.sampling_params import SamplingParams
from splitserve.common.structured_output import refusal_detail
from splitserve.gateway.decode_link import SEAT_GRANTED, DecodeLink, LinkDown, LinkFailure
from splitserve.gateway.errors import GatewayError, invalid
from splitserve.gateway.registry import Instance
from splitserve.protos import common_pb2, decode_pb2, generation_pb2, prefill_pb2
from splitserve.runtime import tracing

if TYPE_CHECKING:
    from splitserve.gateway.registry import Registry
    from splitserve.gateway.router import Router

log = logging.getLogger("splitserve.gateway")
FR = common_pb2.FinishReason
# Prefill failures that mean "this instance is broken": stop routing to it.
_MARK_DOWN_CODES = {
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.UNKNOWN,
    grpc.StatusCode.INTERNAL,
    grpc.StatusCode.UNIMPLEMENTED,
    grpc.StatusCode.DATA_LOSS,
}
# Prefill answers that are about the request itself: the client gets them, no fallback.
_REFUSAL_CODES = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE, grpc.StatusCode.FAILED_PRECONDITION}
_RELEASE_TIMEOUT_S = 5.0
# Put in a run's queue by a timer at its deadline (one timer per request, not one per awaited message).
_DEADLINE = object()


@dataclass(frozen=True)
class RunDeps:
    """What a request run uses of the gateway: routing, instance health, detokenizing, background tasks."""

    router: Router
    registry: Registry
    tokenizer: Any
    spawn: Callable[[Coroutine], None]  # runs a cleanup coroutine in the background
    stream_interval: int = 1  # least tokens a message carries after the stream's first (GatewayConfig)
    # (share, requests waiting at a decode) -> how many of them a request of that share waits behind (None: all)
    waiting_ahead: Callable[[int, int], int] | None = None


def sampling_to_proto(params: SamplingParams, seed: int) -> common_pb2.SamplingParams:
    """The wire form sent to prefill and decode, with the effective seed."""
    return wire.sampling_to_proto(dataclasses.replace(params, seed=seed))


class RequestRun:
    """State of one request from routing to its single terminal message."""

    def __init__(
        self,
        deps: RunDeps,
        *,
        request_id: str,
        params: SamplingParams,
        prompt_token_ids: list[int],
        seed: int,
        priority: int,
        arrival_ns: int,
        deadline: float,
        budget_s: float,
        trace_carrier: dict[str, str] | None = None,
        internal_id: str = "",
        echo_text: str | None = None,
        drop_output: bool = False,
        structured_field: str = "",
        index: int = 0,
        fork_ids: Sequence[str] = (),
        share: int = 0,
    ) -> None:
        """`echo_text`: completions' echo, the prompt's text that starts the first message's text (and that
        message then carries the prompt's ids); `drop_output`: answer no output tokens or text (echo with
        max_tokens 0; usage still counts the token computed, as vLLM's). `index`: the sequence this run is
        (n > 1, gateway/sequences.py); `fork_ids`: the internal ids of the request's other sequences, which
        the decode forks from this one's prompt KV. `share`: the caller's sequences in flight when the request
        was admitted, sent on both hops (the engines run lower shares first)."""
        self._deps = deps
        self.request_id = request_id  # the caller's: in its responses and in logs
        # on every internal hop (prefill, decode, KV lease): unique across the gateways that share them
        self.internal_id = internal_id or request_id
        self._params = params
        self._structured_field = structured_field or "structured_output"
        self._prompt = prompt_token_ids
        self._seed = seed
        self._priority = priority
        self._share = share
        self._index = index
        self._fork_ids = list(fork_ids)
        # resolved with (the decode, its link) once the request is on a decode (None if it never gets there):
        # the other sequences of the request follow their fork ids on that link
        self.submitted: asyncio.Future[tuple[Instance, DecodeLink] | None] = asyncio.get_running_loop().create_future()
        self._owns_decode = True  # holds the router's assignment of the decode (sequence runs do not)
        self._waiting_at_decode: int | None = None  # the decode's num_describes when assigned, until it runs
        self._abort_once_forked: DecodeLink | None = None  # ended at its first token: abort it after the fork
        self._arrival_ns = arrival_ns
        self._deadline = deadline  # time.monotonic() seconds
        self._budget_s = budget_s
        self._sampling = sampling_to_proto(params, seed)
        self._detok = IncrementalDetokenizer(
            deps.tokenizer,
            skip_special_tokens=params.skip_special_tokens,
            stop=params.stop,
            include_stop_str_in_output=params.include_stop_str_in_output,
            prompt_token_ids=prompt_token_ids,
        )
        self.num_output_tokens = 0
        self.cached_prompt_tokens = 0
        self.finished = False
        self._last_token: int | None = None
        self._prefill_timings: common_pb2.Timings | None = None
        self._held: tuple[Instance, common_pb2.KvHandle] | None = None  # lease not handed to a decode
        self._decode: Instance | None = None
        self._link: DecodeLink | None = None  # the stream the request was sent on
        self._queue: asyncio.Queue | None = None
        self._local_prefill = False
        self._stashed: LinkFailure | object | None = None  # a failure or _DEADLINE queued behind merged deltas
        self._deadline_timer: asyncio.TimerHandle | None = None
        self._handed: tuple[Instance, common_pb2.KvHandle] | None = None  # lease given to a decode, unclaimed yet
        self._span = tracing.start_span(  # a child of the front end's SERVER span
            "request",
            tracing.extract(trace_carrier),
            {"request_id": request_id, "prompt_tokens": len(prompt_token_ids), "max_tokens": params.max_tokens or 0},
            kind="internal",
        )
        self._first_message_ns = 0
        self._error: str | None = None
        self._echo_text = echo_text
        self._drop_output = drop_output
        self._prompt_logprobs: Sequence[common_pb2.TokenLogprobs] = ()  # from the prefill, for the first message
        self._num_messages = 0

    async def stream(self) -> AsyncIterator[generation_pb2.GenerateResponse]:
        """Yield the run's messages; always cleans up, also when closed early."""
        try:
            async with aclosing(self._run()) as messages:
                async for message in messages:
                    yield message
        finally:
            self._cleanup()

    # -- routing -------------------------------------------------------------------------

    async def _run(self) -> AsyncIterator[generation_pb2.GenerateResponse]:
        router = self._deps.router
        self._check_decode_room()
        prefill = router.pick_prefill(self._prompt)
        if prefill is not None:  # a seat on a decode first, so a full decode delays the first token, not the second
            await self._take_seat(prefill)
            prefill = router.pick_prefill(self._prompt, self._decode)  # loads changed while it waited
        first = await self._prefill(prefill) if prefill is not None else None
        if (
            first is None
            and prefill is not None
            and (other := router.pick_prefill(self._prompt, self._decode)) not in (None, prefill)
        ):
            prefill, first = other, await self._prefill(other)  # once: the failed one is marked down
        if first is not None:
            message = self._first_message(first)
            link_down = None
            if not message.finish_reason:  # chosen before the first token goes out: a refusal is still a 503
                decode = self._seated_decode() or router.pick_decode(
                    router.decode_candidates(prefill) or router.overflow_candidates(prefill), self._prompt
                )
                if decode is None:  # every decode left while the prompt was prefilled; _cleanup frees the lease
                    raise GatewayError(
                        "unavailable",
                        f"no decode instance compatible with prefill {prefill.name} is up and not draining; "
                        "retry later",
                        retry_after_s=1,
                    )
                try:  # handed over before the first token is written: the decode pulls meanwhile
                    self._submit(decode, self._decode_request(first))
                except LinkDown as exc:
                    link_down = str(exc)
            yield message
            if message.finish_reason:
                if self._fork_ids:  # the other sequences still need the prompt on a decode
                    self._submit_forks(prefill, first)
                return
            if link_down is not None:
                yield self._final(FR.FINISH_REASON_ERROR, error=link_down)
                return
        else:  # prefilled locally: on the decode seating it, else a colocated worker, else any decode
            candidates = router.decode_candidates(None, colocated_only=True) or router.decode_candidates(None)
            decode = self._seated_decode() or router.pick_decode(candidates, self._prompt)
            if decode is None:
                raise GatewayError("resource_exhausted", "no decode instance is up; retry later", retry_after_s=1)
            self._local_prefill = True
            try:
                self._submit(decode, self._decode_request(None))
            except LinkDown as exc:
                raise GatewayError("resource_exhausted", f"{exc}; retry later", retry_after_s=1) from None
        async with aclosing(self._follow()) as messages:
            async for message in messages:
                yield message

    async def _take_seat(self, prefill: Instance) -> None:
        """Reserve the request's seats on a decode compatible with `prefill` and wait until that decode grants them
        (decode_service/seats.py): the wait for a full batch comes before the first token. A decode that fails or
        drains meanwhile is left for another; with none left, UNAVAILABLE / 503 with Retry-After."""
        router, tried, why = self._deps.router, [], ""
        while True:
            candidates = router.decode_candidates(prefill) or router.overflow_candidates(prefill)
            decode = router.pick_decode([d for d in candidates if d not in tried], self._prompt)
            if decode is None:
                raise GatewayError(
                    "unavailable",
                    f"no decode instance compatible with prefill {prefill.name} is up and not draining{why}; "
                    "retry later",
                    retry_after_s=1,
                )
            tried.append(decode)
            try:
                if decode.link is None:
                    raise LinkDown(f"decode instance {decode.name} is not connected")
                seqs, hold_s = 1 + len(self._fork_ids), self._remaining_s()
                self._queue = decode.link.reserve(self.internal_id, seqs, hold_s, self._share)
            except LinkDown as exc:
                why = f" ({exc})"
                continue
            self._decode, self._link = decode, decode.link
            router.seat(decode)
            self._start_deadline_timer()
            item = await self._queue.get()
            if item is SEAT_GRANTED:
                return
            self._leave_seat()
            if item is _DEADLINE or self._remaining_s() <= 0:  # (the decode lapses it at the same deadline)
                raise GatewayError("deadline_exceeded", self._timeout_message())
            if isinstance(item, LinkFailure) or item.unavailable:
                why = f" ({item.message if isinstance(item, LinkFailure) else item.error})"
                continue
            raise GatewayError("internal", f"decode instance {decode.name} refused a seat: {item.error}")

    def _seated_decode(self) -> Instance | None:
        """The decode that granted the request's seats, while it is up; one that left meanwhile is given up."""
        if self._decode is not None and not self._decode.up:
            self._leave_seat()
        return self._decode

    def _leave_seat(self) -> None:
        """Give back a seat reservation that ended unused (its decode failed, refused, or left)."""
        assert self._decode is not None and self._link is not None
        if self._deadline_timer is not None:
            self._deadline_timer.cancel()
            self._deadline_timer = None
        self._link.abort(self.internal_id)  # forgets the id; the decode dropped it already
        self._deps.router.release(self._decode)
        self._decode = self._link = self._queue = None

    def _check_decode_room(self) -> None:
        """RESOURCE_EXHAUSTED / 503 with Retry-After when no decode is up, or every up one is full."""
        router = self._deps.router
        up = router.decode_candidates(None, with_room=False)
        if not up:
            raise GatewayError("resource_exhausted", "no decode instance is up; retry later", retry_after_s=1)
        waiting_ahead = self._deps.waiting_ahead
        ahead = functools.partial(waiting_ahead, self._share) if waiting_ahead is not None else None
        if not any(router.has_room(d, ahead) for d in up):
            full = ", ".join(
                f"{d.name} is draining" if d.describe.draining else f"{d.name} has {router.num_waiting(d)} waiting"
                for d in up
            )
            raise GatewayError(
                "resource_exhausted",
                f"every decode instance is full ({full}; "
                f"max_waiting_per_decode={router.max_waiting_per_decode}); retry later",
                retry_after_s=1,
            )

    def _engine_fields(self) -> dict:
        """The fields PrefillRequest and DecodeRequest share: one id, prompt, sampling, seed, priority and fair
        share on both hops, so the decode continues exactly what the prefill started."""
        return dict(
            request_id=self.internal_id,
            prompt_token_ids=self._prompt,
            sampling=self._sampling,
            seed=self._seed,
            priority=self._priority,
            share=self._share,
        )

    async def _prefill(self, prefill: Instance) -> prefill_pb2.PrefillResponse | None:
        """Call Prefill; None when it failed in a way a local prefill on a decode can cover."""
        router = self._deps.router
        request = prefill_pb2.PrefillRequest(**self._engine_fields())
        router.assign(prefill, self._prompt)
        span = tracing.start_span(
            "gateway.prefill", tracing.context_of(self._span), {"prefill": prefill.name}, kind="client"
        )
        call = prefill.prefill_stub.Prefill(
            request, timeout=max(0.001, self._remaining_s()), metadata=tuple(tracing.inject(span).items()) or None
        )
        try:
            response = await call
        except asyncio.CancelledError:
            call.cancel()
            raise
        except grpc.aio.AioRpcError as exc:
            tracing.end_span(span, f"{exc.code().name}: {exc.details()}")
            span = None
            return self._prefill_failed(prefill, exc)
        finally:
            tracing.end_span(span)
            router.release(prefill)
        if response.HasField("kv") and not response.finish_reason:
            self._held = (prefill, response.kv)
        self.cached_prompt_tokens = response.cached_prompt_tokens
        self._prefill_timings = response.timings
        return response

    def _prefill_failed(self, prefill: Instance, exc: grpc.aio.AioRpcError) -> None:
        """Raise when the client must see the failure; else mark the prefill down if broken."""
        code = exc.code()
        if code in _REFUSAL_CODES:
            self._raise_if_grammar_refused(exc.details() or "")
            raise invalid(f"prefill instance {prefill.name} refused the request: {exc.details()}", "prompt")
        if code == grpc.StatusCode.DEADLINE_EXCEEDED and self._remaining_s() <= 0:
            raise GatewayError("deadline_exceeded", self._timeout_message())
        reason = f"prefill instance {prefill.name} failed: {code.name}: {exc.details()}"
        if code in _MARK_DOWN_CODES:
            self._deps.registry.mark_down(prefill, reason)
        log.warning(
            "request_id=%s internal_id=%s %s; trying another prefill, else a local prefill on a decode",
            self.request_id,
            self.internal_id,
            reason,
        )
        return None

    def _raise_if_grammar_refused(self, error: str) -> None:
        """400 naming the request field, when an engine service refused the structured output spec."""
        detail = refusal_detail(error) if self._params.structured_output is not None else None
        if detail is not None:
            field = self._structured_field
            raise invalid(f"{field}: {detail}", field.split(".", 1)[0])

    def _decode_request(self, first: prefill_pb2.PrefillResponse | None) -> decode_pb2.DecodeRequest:
        request = decode_pb2.DecodeRequest(**self._engine_fields(), fork_ids=self._fork_ids)
        if first is not None:
            request.first_token_id = first.first_token_id
            if first.HasField("first_logprobs"):
                request.first_logprobs.CopyFrom(first.first_logprobs)
            request.kv.CopyFrom(first.kv)
        request.trace_context.update(tracing.inject(self._span))
        return request

    def _submit(self, decode: Instance, request: decode_pb2.DecodeRequest) -> None:
        """Send the request to `decode`: the one seating it (its reservation is claimed) or, unseated, another."""
        assert decode.link is not None
        self._queue = decode.link.submit(request)  # raises LinkDown
        self._deps.router.assign(decode, self._prompt, seated=self._decode is decode)
        self._decode, self._waiting_at_decode = decode, decode.num_describes
        if self._link is not decode.link:  # else its deadline is set on this queue since the reservation
            if self._deadline_timer is not None:
                self._deadline_timer.cancel()
            self._start_deadline_timer()
            self._link = decode.link
        self._handed, self._held = self._held, None  # the decode owns the lease now
        if not self.submitted.done():
            self.submitted.set_result((decode, decode.link))

    def _submit_forks(self, prefill: Instance, first: prefill_pb2.PrefillResponse) -> None:
        """This sequence ended at its first token, the others have not started: hand the prompt (its KV
        if the prefill kept it, else for a local prefill) to a decode, then stop this sequence there."""
        router = self._deps.router
        source = prefill if self._held else None
        decode = self._seated_decode() or router.pick_decode(
            router.decode_candidates(source) or router.overflow_candidates(source), self._prompt
        )
        if decode is None:
            return  # the other sequences end with this run's error-free end: no decode (see SequenceRun)
        try:
            self._submit(decode, self._decode_request(first if self._held else None))
        except LinkDown:
            return
        # this sequence's output is complete, but aborting it now could drop the forks with it (an import not
        # begun yet): the first sequence run that hears from the decode aborts it (`forked`)
        self._abort_once_forked = self._link

    def forked(self) -> None:
        """A sequence forked from this run's prompt has output: the decode no longer needs this one."""
        link, self._abort_once_forked = self._abort_once_forked, None
        if link is not None:
            link.abort(self.internal_id, running=True)

    def _start_deadline_timer(self) -> None:
        assert self._queue is not None
        loop = asyncio.get_running_loop()
        self._deadline_timer = loop.call_at(loop.time() + self._remaining_s(), self._queue.put_nowait, _DEADLINE)

    @property
    def prompt_logprobs(self) -> Sequence[common_pb2.TokenLogprobs]:
        """The prompt logprobs the prefill (or a decode prefilling locally) computed, once they came."""
        return self._prompt_logprobs

    @property
    def local_prefill(self) -> bool:
        return self._local_prefill

    @property
    def error(self) -> str | None:
        return self._error

    # -- streaming -----------------------------------------------------------------------

    async def _follow(self) -> AsyncIterator[generation_pb2.GenerateResponse]:
        assert self._queue is not None and self._decode is not None
        while True:
            item = await self._next_item()
            if item is None:
                yield self._final(FR.FINISH_REASON_ERROR, error=self._timeout_message())
                return
            if isinstance(item, LinkFailure):
                if self._handed is not None and self.num_output_tokens <= 1:
                    # the decode died before it could claim the blocks: free them now, not at expiry
                    # (ReleaseKv is idempotent: a lease the decode did claim answers released=false)
                    self._deps.spawn(_release_kv(*self._handed))
                yield self._final(FR.FINISH_REASON_ERROR, error=item.message)
                return
            if item.refused and self.num_output_tokens == 0:  # refused before any work: a 400, not a stream
                self._raise_if_grammar_refused(item.error)
            if item.unavailable:  # the decode took nothing (draining, starting): 503 and a retry, not a 500
                if self._handed is not None:  # nobody claimed the prefill's blocks: free them now, not at expiry
                    self._deps.spawn(_release_kv(*self._handed))
                raise GatewayError("unavailable", f"decode instance {self._decode.name}: {item.error}", retry_after_s=1)
            if self._waiting_at_decode is not None and self._owns_decode:
                self._deps.router.started(self._decode, self._waiting_at_decode)
            self._waiting_at_decode = None
            message = self._delta_message(item)
            yield message
            if message.finish_reason:
                return

    async def _next_item(self) -> decode_pb2.TokenDelta | LinkFailure | None:
        """The next TokenDelta (those already queued merged into one, so a slow client gets
        fewer, larger messages; after the stream's first output, deltas are gathered until they hold
        stream_interval tokens or one ends the request) or LinkFailure; None when the deadline passed first."""
        queue = self._queue
        assert queue is not None
        if self._stashed is not None:
            item, self._stashed = self._stashed, None
        else:
            item = await queue.get() if queue.empty() else queue.get_nowait()
        if item is _DEADLINE:
            return None
        if isinstance(item, LinkFailure):
            return item
        deltas = [item]
        wanted = self._deps.stream_interval if self.num_output_tokens else 1  # the first output goes at once
        num_tokens = len(item.token_ids)
        while not deltas[-1].finish_reason and (num_tokens < wanted or not queue.empty()):
            following = queue.get_nowait() if not queue.empty() else await queue.get()
            if following is _DEADLINE or isinstance(following, LinkFailure):
                self._stashed = following  # after the tokens that came before it
                break
            deltas.append(following)
            num_tokens += len(following.token_ids)
        return deltas[0] if len(deltas) == 1 else _merge_deltas(deltas)

    def _first_message(self, first: prefill_pb2.PrefillResponse) -> generation_pb2.GenerateResponse:
        self._prompt_logprobs = first.prompt_logprobs
        logprobs = [first.first_logprobs] if first.HasField("first_logprobs") else []
        ids, lps, text = self._accept([first.first_token_id], logprobs)
        if self._detok.stop_str is not None:
            return self._final(FR.FINISH_REASON_STOP, ids, lps, text, stop_reason=self._detok.stop_str)
        if first.finish_reason:
            return self._final(first.finish_reason, ids, lps, text + self._detok.flush())
        message = self._message(ids, lps, text)
        message.timings.CopyFrom(self._timings(None))
        return message

    def _delta_message(self, delta: decode_pb2.TokenDelta) -> generation_pb2.GenerateResponse:
        assert self._decode is not None and self._link is not None
        first_output = self.num_output_tokens == 0
        if self._local_prefill and first_output and delta.cached_prompt_tokens:
            self.cached_prompt_tokens = delta.cached_prompt_tokens
        if first_output:
            self._prompt_logprobs = delta.prompt_logprobs  # prefilled by the decode itself
        ids, lps, text = self._accept(delta.token_ids, delta.logprobs)
        if self._detok.stop_str is not None:
            self._link.abort(self.internal_id)
            return self._final(
                FR.FINISH_REASON_STOP, ids, lps, text, stop_reason=self._detok.stop_str, decode_timings=delta.timings
            )
        if delta.finish_reason:
            self._link.finish(self.internal_id)
            text += self._detok.flush()
            if self._detok.stop_str is not None:
                return self._final(
                    FR.FINISH_REASON_STOP,
                    ids,
                    lps,
                    text,
                    stop_reason=self._detok.stop_str,
                    decode_timings=delta.timings,
                )
            error = f"decode instance {self._decode.name}: {delta.error}" if delta.error else ""
            return self._final(delta.finish_reason, ids, lps, text, error=error, decode_timings=delta.timings)
        message = self._message(ids, lps, text)
        if first_output and ids:
            message.timings.CopyFrom(self._timings(None))
        return message

    def _accept(
        self, token_ids: Sequence[int], logprobs: Sequence[common_pb2.TokenLogprobs]
    ) -> tuple[list[int], list[common_pb2.TokenLogprobs], str]:
        """Detokenize token by token; keep tokens up to the one that completes a stop string."""
        ids: list[int] = []
        pieces: list[str] = []
        for token_id in token_ids:
            if self._detok.finished:
                break
            ids.append(token_id)
            pieces.append(self._detok.push([token_id]).text)
        self.num_output_tokens += len(ids)
        if ids:
            self._last_token = ids[-1]
        kept_logprobs = list(logprobs[: len(ids)]) if len(logprobs) >= len(ids) else list(logprobs)
        return ids, kept_logprobs, "".join(pieces)

    def _message(
        self, ids: Sequence[int], logprobs: Sequence[common_pb2.TokenLogprobs], text: str
    ) -> generation_pb2.GenerateResponse:
        if ids and not self._first_message_ns:
            self._first_message_ns = time.time_ns()
        if self._drop_output:
            ids, logprobs, text = (), (), ""
        message = generation_pb2.GenerateResponse(
            request_id=self.request_id, text=text, token_ids=ids, logprobs=logprobs, index=self._index
        )
        self._num_messages += 1
        if self._num_messages == 1:
            self._add_prompt_parts(message)
        message.usage.prompt_tokens = len(self._prompt)  # counts so far (vLLM's continuous_usage_stats)
        message.usage.completion_tokens = self.num_output_tokens
        return message

    def _add_prompt_parts(self, message: generation_pb2.GenerateResponse) -> None:
        """The first message: echo's prompt text before the output, the prompt's ids (echo or prompt
        logprobs) and the prompt logprobs the prefill computed."""
        if self._echo_text is not None:
            message.text = self._echo_text + message.text
        if self._echo_text is not None or self._params.prompt_logprobs is not None:
            message.prompt_token_ids.extend(self._prompt)
        if self._params.prompt_logprobs is not None:
            message.prompt_logprobs.extend(self._prompt_logprobs)

    def _final(
        self,
        finish_reason: int,
        ids: Sequence[int] = (),
        logprobs: Sequence = (),
        text: str = "",
        *,
        stop_reason: str = "",
        error: str = "",
        decode_timings: common_pb2.Timings | None = None,
    ) -> generation_pb2.GenerateResponse:
        """The terminal message: finish_reason, usage, timings, stop_reason or error."""
        self.finished = True
        if (
            finish_reason == FR.FINISH_REASON_STOP
            and not stop_reason
            and self._last_token is not None
            and self._last_token in self._params.stop_token_ids
        ):
            stop_reason = str(self._last_token)
        message = self._message(ids, logprobs, text)
        message.finish_reason = finish_reason
        message.stop_reason = stop_reason
        message.error = error
        message.usage.cached_prompt_tokens = self.cached_prompt_tokens
        message.timings.CopyFrom(self._timings(decode_timings))
        if error:
            log.warning("request_id=%s failed: %s", self.request_id, error)
            self._error = error
        return message

    def _timings(self, decode: common_pb2.Timings | None) -> common_pb2.Timings:
        """Prefill's and decode's stage times added up; total_ns measured by the gateway."""
        timings = common_pb2.Timings()
        for part in (self._prefill_timings, decode):
            if part is not None:
                timings.queue_ns += part.queue_ns
                timings.prefill_ns += part.prefill_ns
                timings.transfer_ns += part.transfer_ns
                timings.decode_ns += part.decode_ns
        timings.total_ns = time.monotonic_ns() - self._arrival_ns
        return timings

    # -- ending --------------------------------------------------------------------------

    def _remaining_s(self) -> float:
        return self._deadline - time.monotonic()

    def _timeout_message(self) -> str:
        return (
            f"request {self.request_id} timed out after {self._budget_s:g} s "
            "(request_timeout_s or the client's deadline)"
        )

    def _cleanup(self) -> None:
        """Abort the decode request if it still runs; release a lease nobody claimed; end the trace."""
        if self._first_message_ns:
            tracing.record_span(
                "gateway.stream",
                self._first_message_ns,
                time.time_ns(),
                self._span,
                {"output_tokens": self.num_output_tokens},
            )
        tracing.end_span(self._span, self._error)
        if not self.submitted.done():
            self.submitted.set_result(None)
        if self._deadline_timer is not None:
            self._deadline_timer.cancel()
            self._deadline_timer = None
        if self._link is not None:
            if self._abort_once_forked is not None:
                self._link.finish(self.internal_id)  # its deltas are dropped; `forked` aborts it
            else:
                self._link.abort(self.internal_id)  # no-op once finished or failed
            self._link = None
        if self._decode is not None and self._owns_decode:
            self._deps.router.release(self._decode)
        self._decode = None
        if self._held is not None:
            prefill, kv = self._held
            self._held = None
            self._deps.spawn(_release_kv(prefill, kv))


def _merge_deltas(deltas: Sequence[decode_pb2.TokenDelta]) -> decode_pb2.TokenDelta:
    """One delta holding the tokens of consecutive deltas; the end state of the last one."""
    first, last = deltas[0], deltas[-1]
    merged = decode_pb2.TokenDelta(
        request_id=first.request_id,
        cached_prompt_tokens=first.cached_prompt_tokens,
        num_blocks_pulled=first.num_blocks_pulled,
        finish_reason=last.finish_reason,
        error=last.error,
        prompt_logprobs=first.prompt_logprobs,
    )
    for delta in deltas:
        merged.token_ids.extend(delta.token_ids)
        merged.logprobs.extend(delta.logprobs)
    if last.HasField("timings"):
        merged.timings.CopyFrom(last.timings)
    return merged


async def _release_kv(prefill: Instance, kv: common_pb2.KvHandle) -> None:
    """Unpin a lease the gateway will not hand to any decode (best effort; leases expire)."""
    request = prefill_pb2.ReleaseKvRequest(lease_id=kv.lease.lease_id, epoch=kv.lease.epoch)
    try:
        await prefill.prefill_stub.ReleaseKv(request, timeout=_RELEASE_TIMEOUT_S)
    except grpc.aio.AioRpcError as exc:
        log.info(
            "ReleaseKv of lease %s on %s failed (it will expire): %s", kv.lease.lease_id, prefill.name, exc.details()
        )
    except grpc.aio.UsageError:  # the prefill left its pool and its channel is closed (members.py)
        log.info(
            "ReleaseKv of lease %s on %s skipped: it left the pool (the lease expires)", kv.lease.lease_id, prefill.name
        )
