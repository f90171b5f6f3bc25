"""The decode gRPC service (role decode) and the colocated worker (role both).

One bidirectional `Generate` stream per gateway:

    in:  DecodeRequest ─▶ with kv: ImportKv ─▶ core pulls blocks ─▶ ImportDone
                                   ─▶ Prefill.ReleaseKv(lease) ─▶ released? CommitImport(ok)
                                                                 : recompute | fail (policy)
                          without kv: AddRequest (local prefill)
         SeatRequest   ─▶ a seat in the batch, granted in turn (seats.py); its DecodeRequest claims it
         AbortRequest  ─▶ core: Abort (or the seat reservation dropped)
         OutputsRead   ─▶ pacing: at most a few messages unread by the gateway (stream_pacing.py)
    out: one DecodeOut per engine step per stream, carrying every request's new tokens (the steps queued
         while the gateway is behind merged into one)

A broken stream aborts every request it owns.
"""

from __future__ import annotations

import asyncio
import logging
from typing import NoReturn

from splitserve.common.process_exit import exit_now
from splitserve.common.sampling_params import MAX_SEQUENCES
from splitserve.common.structured_output import refusal_detail
from splitserve.common.wire import FINISH_REASONS, logprobs_to_proto, sampling_from_proto
from splitserve.decode_service.pulls import PullCoordinator, PullHooks
from splitserve.decode_service.request_timing import RequestTimes
from splitserve.decode_service.seats import SeatDesk
from splitserve.decode_service.stream_pacing import OutputPacer, merge_outs
from splitserve.engine.core_process import messages as m
from splitserve.engine.grammar import check_spec
from splitserve.engine_service.base import ServiceBase, setup_logging
from splitserve.protos import common_pb2, decode_pb2, decode_pb2_grpc
from splitserve.runtime import tracing

log = logging.getLogger("splitserve.decode")


class Unavailable(ValueError):
    """This decode cannot take a request now (draining, starting): the gateway answers 503, not 500."""


class GatewayStream:
    """Requests owned by one gateway stream and the per-step messages waiting to go out."""

    def __init__(self) -> None:
        self.request_ids: set[str] = set()
        self.out: asyncio.Queue = asyncio.Queue()
        self.first_info: dict[str, tuple[int, int]] = {}  # request_id -> (cached tokens, blocks pulled)
        self.pacer = OutputPacer()  # how many of its messages the gateway has read (if it says)


class DecodeService(ServiceBase, decode_pb2_grpc.DecodeServicer):
    role = "decode"
    service_names = ["splitserve.v1.Decode"]

    def __init__(self, engine_config, service_config) -> None:
        super().__init__(engine_config, service_config)
        self.role = engine_config.role
        self.owner: dict[str, GatewayStream] = {}
        self.prefill_peers = tuple(a.strip() for a in service_config.prefill_peers.split(",") if a.strip())
        self.timing = RequestTimes()  # request_id (and fork ids) -> its times and counts, for the metrics
        self.spans: dict[str, object] = {}  # request_id -> its "decode" span (tracing on)
        hooks = PullHooks(span_of=self.spans.get, on_imported=self._on_imported, fail_request=self.fail_request)
        self.pulls = PullCoordinator(self.client, service_config, self.name, self.internal_auth, self.counters, hooks)
        self.shares: dict[str, int] = {}  # sequence id -> its request's fair share (seats are counted by share)
        self.seats = SeatDesk(self._in_flight_at_or_below, lambda: self.draining or self.starting or self.client.dead)

    async def before_serving(self) -> None:
        """Prepare the configured prefills before serving: pair (nccl: the communicator is built then)
        or map their KV pools (shm, cuda_ipc), so no first request waits for it. Waits at most one
        transfer timeout; a peer that is not up yet is prepared in the background."""
        self.seats.book.max_num_seqs = self.client.info.max_num_seqs
        peers = list(self.prefill_peers)
        if peers:
            self._preparing = asyncio.create_task(self.pulls.prepare_peers(peers))
            try:
                await asyncio.wait_for(asyncio.shield(self._preparing), self.config.kv_transfer_timeout_s)
            except TimeoutError:
                log.info("%s: still preparing prefill peers %s; serving meanwhile", self.name, ", ".join(peers))

    async def on_stopping(self) -> None:
        await self.pulls.settle()  # leases released on the way reach their prefills, rather than expire there

    # -- core → streams --------------------------------------------------------------------

    def on_core_message(self, msg) -> None:
        if isinstance(msg, m.StepBatch):
            self._route_outputs(msg)
        else:
            self.pulls.on_core_message(msg)

    def _route_outputs(self, batch: m.StepBatch) -> None:
        per_stream: dict[int, tuple[GatewayStream, list]] = {}
        for out in batch.outputs:
            stream = self.owner.get(out.request_id)
            if stream is None:
                continue
            delta = token_delta(out, stream)
            per_stream.setdefault(id(stream), (stream, []))[1].append(delta)
            self.counters.count("generation_tokens", len(out.new_token_ids))
            self.timing.observe(out, self.metrics)
            if out.finished:
                self.finish_request(out.request_id, out.error)
        for stream, deltas in per_stream.values():
            stream.out.put_nowait(decode_pb2.DecodeOut(deltas=deltas, step_ns=batch.step_ns))

    def finish_request(self, request_id: str, error: str | None = None) -> None:
        self.timing.pop(request_id)
        tracing.end_span(self.spans.pop(request_id, None), error)
        self.pulls.cancel(request_id)  # releases the prefill's lease if a pull was still pending
        stream = self.owner.pop(request_id, None)
        if stream is not None:
            stream.request_ids.discard(request_id)
            stream.first_info.pop(request_id, None)
            self.shares.pop(request_id, None)
            self.inflight -= 1
            self.seats.pump()

    def _in_flight_at_or_below(self, share: int) -> int:
        """Sequences in flight here of that fair share or lower (the seats a reservation of that share counts)."""
        return sum(1 for s in self.shares.values() if s <= share)

    def _reserve(self, seat: decode_pb2.SeatRequest, stream: GatewayStream) -> None:
        """A gateway asks for seats before prefilling a request (seats.py); answered when granted."""
        rid, refusal = seat.request_id, ""
        if self.client.dead:
            refusal = f"{self.name}: the engine core process exited"
        elif self.draining or self.starting:
            refusal = f"{self.name} is {'draining' if self.draining else 'starting'}"
        elif not rid or rid in self.owner or self.seats.book.holds(rid):
            refusal = f"request_id {rid!r} is already in use"
        elif seat.num_seqs > MAX_SEQUENCES:
            refusal = f"num_seqs: at most {MAX_SEQUENCES}, got {seat.num_seqs}"
        self.seats.reserve(stream, seat, refusal)

    def _on_imported(self, request_id: str, num_cached_tokens: int, num_blocks_pulled: int) -> None:
        """A pull committed: its first delta reports what was cached and what moved."""
        stream = self.owner.get(request_id)
        if stream is not None:
            stream.first_info[request_id] = (num_cached_tokens, num_blocks_pulled)

    def fail_request(self, request_id: str, error: str, unavailable: bool = False) -> None:
        """End a request with an error delta (the core holds nothing for it any more); `unavailable`: this
        instance failed, not the request (the gateway answers 503 with Retry-After, as for a draining decode)."""
        stream = self.owner.get(request_id)
        if stream is None:
            return
        self.counters.count("requests_failed")
        self.timing.failed(request_id, self.metrics)
        tracing.end_span(self.spans.pop(request_id, None), error)
        stream.out.put_nowait(
            decode_pb2.DecodeOut(
                deltas=[
                    decode_pb2.TokenDelta(
                        request_id=request_id,
                        finish_reason=common_pb2.FINISH_REASON_ERROR,
                        error=error,
                        unavailable=unavailable,
                    )
                ]
            )
        )
        self.finish_request(request_id)

    def _check_prefill_address(self, req) -> None:
        """With --prefill-peers set, a KV handle may name only one of them: a decode never dials an
        address a caller chose (a forged handle could point it anywhere)."""
        peers = self.prefill_peers
        if peers and req.HasField("kv") and req.kv.prefill_address not in peers:
            raise ValueError(
                f"kv.prefill_address {req.kv.prefill_address[:128]!r} is not one of this decode's "
                f"--prefill-peers ({', '.join(peers)})"
            )

    def on_core_death(self, why: str) -> None:
        for request_id in list(self.owner):
            self.fail_request(request_id, f"{self.name}: {why}", unavailable=True)

    async def ConfirmPair(self, request, context):
        """A prefill with --decode-peers checks a PairKv with us: confirmed only when we are the instance it
        names and our own pairing with that prefill, through that store, is in flight now."""
        store = self.pulls.link.pairing_store(request.prefill_instance)
        confirmed = request.decode_instance == self.name and store == (request.store_host, request.store_port)
        if not confirmed:
            log.warning(
                "%s: a PairKv as %r with store %s:%d reached %s; not ours (we pair through %s)",
                self.name,
                request.decode_instance[:128],
                request.store_host[:128],
                request.store_port,
                request.prefill_instance[:128],
                f"{store[0]}:{store[1]}" if store else "no store now",
            )
        return decode_pb2.ConfirmPairResponse(confirmed=confirmed)

    # -- gateway → core --------------------------------------------------------------------
    async def Generate(self, request_iterator, context):
        stream = GatewayStream()
        reader = asyncio.create_task(self._read(request_iterator, stream))
        inbound_closed = False
        try:
            while True:
                msg = await stream.out.get()
                if msg is None:  # the gateway closed its side: finish what it owns, then end
                    inbound_closed = True
                else:
                    await stream.pacer.wait_for_room()
                    outs = [msg]  # and every step queued meanwhile, in one message (stream_pacing.py)
                    while not stream.out.empty():
                        queued = stream.out.get_nowait()
                        if queued is None:
                            inbound_closed = True
                        else:
                            outs.append(queued)
                    yield merge_outs(outs)
                    stream.pacer.num_sent += 1
                if inbound_closed and not stream.request_ids:
                    break
        finally:
            reader.cancel()
            self._abort_stream(stream)

    def _abort_stream(self, stream: GatewayStream) -> None:
        if self.seats.book.drop_owner(stream):
            self.seats.pump()
        ids = list(stream.request_ids)
        if ids:
            log.warning("gateway stream closed with %d requests in flight: aborting them", len(ids))
            self.client.send(m.Abort(ids))
            for request_id in ids:
                self.finish_request(request_id)

    async def _read(self, request_iterator, stream: GatewayStream) -> None:
        try:
            await self._read_items(request_iterator, stream)
        finally:
            stream.pacer.on_closed()
            stream.out.put_nowait(None)

    async def _read_items(self, request_iterator, stream: GatewayStream) -> None:
        async for item in request_iterator:
            kind = item.WhichOneof("kind")
            if kind == "request":
                self._admit(item.request, stream)
            elif kind == "reserve":
                self._reserve(item.reserve, stream)
            elif kind == "outputs_read":
                stream.pacer.on_read(item.outputs_read.num_outputs)
            elif kind == "abort":
                request_id = item.abort.request_id
                if self.seats.book.cancel(stream, request_id):
                    self.seats.pump()
                elif self.owner.get(request_id) is stream:
                    self.pulls.cancel(request_id)
                    self.client.send(m.Abort([request_id]))

    def _admit(self, req, stream: GatewayStream) -> None:
        rid = req.request_id
        forks = list(req.fork_ids)
        claimed = self.seats.book.claim(stream, rid)  # its seats count as sequences in flight below, or end refused
        try:
            if self.draining or self.starting:
                raise Unavailable(f"{self.name} is {'draining' if self.draining else 'starting'}")
            if len(forks) >= MAX_SEQUENCES:  # the gateway sends n - 1 of them; a forged list must not flood the batch
                raise ValueError(f"fork_ids: at most {MAX_SEQUENCES - 1} (n <= {MAX_SEQUENCES}), got {len(forks)}")
            if len({rid, *forks}) != 1 + len(forks):
                raise ValueError(f"fork_ids must be distinct and differ from request_id {rid!r}")
            if any(i in self.owner or self.seats.book.holds(i) for i in (rid, *forks)):
                raise ValueError(f"request_id {rid!r} or one of its fork_ids is already in use")
            check_token_ids(req, self.client.info.vocab_size)
            self._check_prefill_address(req)
            params = sampling_from_proto(req.sampling)
            if params.structured_output is not None:
                # refused here, before any work is queued
                check_spec(params.structured_output, self.engine_config.structured_output_max_spec_bytes)
        except Exception as exc:  # noqa: BLE001 - one bad request ends alone, never the gateway's whole stream
            unavailable = isinstance(exc, Unavailable)
            if not isinstance(exc, ValueError):
                log.exception("admitting request %r failed", rid)
                exc = f"the decode could not admit the request: {type(exc).__name__}: {exc}"
            deltas = []
            for sequence_id in dict.fromkeys((rid, *forks)):  # the request's other sequences end with it
                delta = decode_pb2.TokenDelta(
                    request_id=sequence_id, finish_reason=common_pb2.FINISH_REASON_ERROR, error=str(exc)
                )
                delta.refused = refusal_detail(str(exc)) is not None  # the gateway answers 400
                delta.unavailable = unavailable  # 503: another time, or another decode
                deltas.append(delta)
            stream.out.put_nowait(decode_pb2.DecodeOut(deltas=deltas))
            if claimed:
                self.seats.pump()
            return
        imported = req.HasField("kv") and req.HasField("first_token_id")
        self.timing.start(rid, forks, len(req.prompt_token_ids), params.max_tokens, imported)
        for sequence_id in (rid, *forks):  # fork ids: the request's other sequences (n > 1), outputs of their own
            self.owner[sequence_id] = stream
            self.shares[sequence_id] = req.share
            stream.request_ids.add(sequence_id)
            self.inflight += 1
        if tracing.enabled():
            self.spans[rid] = tracing.start_span(
                "decode",
                tracing.extract(req.trace_context),
                {"request_id": rid, "prompt_tokens": len(req.prompt_token_ids), "kv.imported": req.HasField("kv")},
            )
        self.counters.count("requests_received")
        if imported:
            # the prefill's first token is generated, but the request ends here: this decode reports it
            self.counters.count("generation_tokens", 1)
            self.pulls.start(req, params)
        else:
            self.counters.count("prompt_tokens", len(req.prompt_token_ids))
            self.client.send(
                m.AddRequest(rid, list(req.prompt_token_ids), params, req.priority, req.seed, forks, share=req.share)
            )


def check_token_ids(req, vocab_size: int) -> None:
    """Internal callers are checked as strictly as public ones: ids the embedding would index out of
    range (a crash of the engine core) are refused here, naming the field and the limit."""
    if not req.prompt_token_ids:
        raise ValueError("prompt_token_ids is empty")
    bad = next((t for t in req.prompt_token_ids if t >= vocab_size), None)
    if bad is not None:
        raise ValueError(f"prompt_token_ids holds {bad}, not below vocab_size {vocab_size}")
    if req.HasField("first_token_id") and req.first_token_id >= vocab_size:
        raise ValueError(f"first_token_id is {req.first_token_id}, not below vocab_size {vocab_size}")


def token_delta(out, stream: GatewayStream) -> decode_pb2.TokenDelta:
    """The TokenDelta of one engine output: new tokens and logprobs; on the first, what was cached or pulled."""
    delta = decode_pb2.TokenDelta(request_id=out.request_id, token_ids=out.new_token_ids)
    for lp in out.new_logprobs:
        if lp is not None:
            delta.logprobs.append(logprobs_to_proto(lp))
    if out.prompt_logprobs:  # prefilled here (colocated, or no prefill could serve)
        delta.prompt_logprobs.extend(logprobs_to_proto(lp) for lp in out.prompt_logprobs)
    info = stream.first_info.pop(out.request_id, None)
    if info is not None:
        delta.cached_prompt_tokens, delta.num_blocks_pulled = info
    elif out.num_cached_tokens:
        delta.cached_prompt_tokens = out.num_cached_tokens
    if out.finished:
        delta.finish_reason = FINISH_REASONS.get(out.finish_reason, common_pb2.FINISH_REASON_ERROR)
        if out.error:
            delta.error = out.error
            # the engine refused the request's grammar (REFUSAL_PREFIX) before it produced anything
            delta.refused = not out.new_token_ids and refusal_detail(out.error) is not None
    return delta


def _serve(engine_config, service_config) -> NoReturn:
    service = DecodeService(engine_config, service_config)
    tracing.init_tracing(f"splitserve-{engine_config.role}", service.name, endpoint=service_config.otlp_traces_endpoint)
    code = asyncio.run(service.serve(lambda server: decode_pb2_grpc.add_DecodeServicer_to_server(service, server)))
    exit_now(code)  # the process's last step: no teardown of torch's modules (common/process_exit.py)


def run(ns, configs) -> NoReturn:
    setup_logging()
    _serve(configs["EngineConfig"], configs["ServiceConfig"])  # role decode, set by the CLI


def run_worker(ns, configs) -> NoReturn:
    setup_logging()
    _serve(configs["EngineConfig"], configs["ServiceConfig"])  # role both, set by the CLI
