"""One request's run through prefill and decode, as a stream of GenerateResponse messages.

    disaggregated:  SeatRequest ──▶ decode link ──seat granted (the decode's batch has room)──▶
                    Prefill.Prefill ──first token──▶ client
                    DecodeRequest(kv, first token) ──▶ decode link ──TokenDeltas──▶ client
    local prefill:  DecodeRequest(no kv, no first token) ──▶ decode (colocated worker, or
                    any decode when no prefill is up or the prefill call failed, on another
                    prefill too when one was up)

The run's messages are built by `RunMessages` (request_messages.py: detokenizer, counters,
stop strings); on a stop string's match the run sends the decode an AbortRequest. The seat
is taken by request_seat.py, the prefill called by request_prefill.py. Whatever way the run
ends (finished, client gone, deadline, error), `_cleanup` aborts the decode request if still
running and releases a KV lease that was never handed to a decode.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from contextlib import aclosing
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import grpc

from splitserve.common import wire
from splitserve.common.sampling_params import SamplingParams
from splitserve.common.structured_output import refusal_detail
from splitserve.gateway.decode_link import DEADLINE, DecodeLink, LinkDown, LinkFailure
from splitserve.gateway.errors import GatewayError, invalid
from splitserve.gateway.registry import Instance
from splitserve.gateway.request_messages import FR, RunMessages, next_item
from splitserve.gateway.request_prefill import REFUSAL_CODES, call_prefill, prefill_failed, release_kv
from splitserve.gateway.request_seat import SeatAsk, check_decode_room, deadline_timer, take_seat
from splitserve.protos import common_pb2, decode_pb2, generation_pb2, prefill_pb2
from splitserve.runtime import tracing

if TYPE_CHECKING:
    from splitserve.gateway.registry import Registry
    from splitserve.gateway.router import Router


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
        self._fork_ids = list(fork_ids)
        # resolved with (the decode, its link) once the request is on a decode (None if it never gets there):
        # the other sequences of the request follow their fork ids on that link
        self.submitted: asyncio.Future[tuple[Instance, DecodeLink] | None] = asyncio.get_running_loop().create_future()
        self._owns_decode = True  # holds the router's assignment of the decode (sequence runs do not)
        self._waiting_at_decode: int | None = None  # the decode's num_describes when assigned, until it runs
        self._abort_once_forked: DecodeLink | None = None  # ended at its first token: abort it after the fork
        self._deadline = deadline  # time.monotonic() seconds
        self._budget_s = budget_s
        self._sampling = sampling_to_proto(params, seed)
        self._out = RunMessages(
            request_id=request_id,
            index=index,
            params=params,
            prompt_token_ids=prompt_token_ids,
            tokenizer=deps.tokenizer,
            arrival_ns=arrival_ns,
            echo_text=echo_text,
            drop_output=drop_output,
        )
        self._held: tuple[Instance, common_pb2.KvHandle] | None = None  # lease not handed to a decode
        self._decode: Instance | None = None
        self._link: DecodeLink | None = None  # the stream the request was sent on
        self._queue: asyncio.Queue | None = None
        self._local_prefill = False
        self._stashed: LinkFailure | object | None = None  # a failure or DEADLINE queued behind merged deltas
        self._deadline_timer: asyncio.TimerHandle | None = None
        self._handed: tuple[Instance, common_pb2.KvHandle] | None = None  # lease given to a decode, unclaimed yet
        self._span = tracing.start_span(  # a child of the front end's SERVER span
            "request",
            tracing.extract(trace_carrier),
            {"request_id": request_id, "prompt_tokens": len(prompt_token_ids), "max_tokens": params.max_tokens or 0},
            kind="internal",
        )

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
        check_decode_room(router, self._deps.waiting_ahead, self._share)
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
            message = self._out.first_message(first)
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
                yield self._out.final(FR.FINISH_REASON_ERROR, error=link_down)
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
        """Wait for the request's seats on a decode compatible with `prefill` (request_seat.py)."""
        ask = SeatAsk(self.internal_id, 1 + len(self._fork_ids), self._share, self._prompt, self._deadline)
        seat = await take_seat(self._deps.router, prefill, ask, self._timeout_message())
        self._decode, self._link, self._queue, self._deadline_timer = seat.decode, seat.link, seat.queue, seat.timer

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
        request = prefill_pb2.PrefillRequest(**self._engine_fields())
        response = await call_prefill(
            self._deps.router, prefill, request, parent_span=self._span, timeout_s=self._remaining_s()
        )
        if isinstance(response, grpc.aio.AioRpcError):
            if response.code() in REFUSAL_CODES:
                self._raise_if_grammar_refused(response.details() or "")
            prefill_failed(
                self._deps.registry,
                prefill,
                response,
                timeout_message=self._timeout_message() if self._remaining_s() <= 0 else None,
                request_id=self.request_id,
                internal_id=self.internal_id,
            )
            return None
        if response.HasField("kv") and not response.finish_reason:
            self._held = (prefill, response.kv)
        self._out.cached_prompt_tokens = response.cached_prompt_tokens
        self._out.prefill_timings = response.timings
        return response

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
        self._deadline_timer = deadline_timer(self._queue, self._deadline)

    @property
    def prompt_logprobs(self) -> Sequence[common_pb2.TokenLogprobs]:
        """The prompt logprobs the prefill (or a decode prefilling locally) computed, once they came."""
        return self._out.prompt_logprobs

    @property
    def local_prefill(self) -> bool:
        return self._local_prefill

    @property
    def error(self) -> str | None:
        return self._out.error

    # -- streaming -----------------------------------------------------------------------

    async def _follow(self) -> AsyncIterator[generation_pb2.GenerateResponse]:
        assert self._queue is not None and self._decode is not None
        while True:
            item = await self._next_item()
            if item is None:
                yield self._out.final(FR.FINISH_REASON_ERROR, error=self._timeout_message())
                return
            if isinstance(item, LinkFailure):
                if self._handed is not None and self._out.num_output_tokens <= 1:
                    # the decode died before it could claim the blocks: free them now, not at expiry
                    # (ReleaseKv is idempotent: a lease the decode did claim answers released=false)
                    self._deps.spawn(release_kv(*self._handed))
                yield self._out.final(FR.FINISH_REASON_ERROR, error=item.message)
                return
            if item.refused and self._out.num_output_tokens == 0:  # refused before any work: a 400, not a stream
                self._raise_if_grammar_refused(item.error)
            if item.unavailable:  # the decode took nothing (draining, starting): 503 and a retry, not a 500
                if self._handed is not None:  # nobody claimed the prefill's blocks: free them now, not at expiry
                    self._deps.spawn(release_kv(*self._handed))
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
        assert self._queue is not None
        wanted = self._deps.stream_interval if self._out.num_output_tokens else 1  # the first output goes at once
        item, self._stashed = await next_item(self._queue, self._stashed, wanted)
        return None if item is DEADLINE else item

    def _delta_message(self, delta: decode_pb2.TokenDelta) -> generation_pb2.GenerateResponse:
        assert self._decode is not None and self._link is not None
        accepted = self._out.accept_delta(delta, local_prefill=self._local_prefill)
        if self._out.stop_matched:
            self._link.abort(self.internal_id)  # the decode still runs it
        elif delta.finish_reason:
            self._link.finish(self.internal_id)
        return self._out.delta_message(delta, accepted, decode_name=self._decode.name)

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
        if self._out.first_message_ns:
            tracing.record_span(
                "gateway.stream",
                self._out.first_message_ns,
                time.time_ns(),
                self._span,
                {"output_tokens": self._out.num_output_tokens},
            )
        tracing.end_span(self._span, self._out.error)
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
            self._deps.spawn(release_kv(prefill, kv))
