"""The prefill gRPC service.

Prefill(request) ─▶ core: AddRequest ─▶ step(s) ─▶ first token + HeldKv
                 ◀─ PrefillResponse{first token, KvHandle(blocks, hashes, lease)}
ReleaseKv(lease) ─▶ lease slot cleared ─▶ core: ReleaseHeld   (blocks stay in the prefix cache)
PairKv / SendKv  ─▶ core: Pair / SendBlocks   (the nccl transport's send side; with --decode-peers a
                    PairKv counts only once a listed decode confirms it: pair_check.py)
every 50 ms: expired leases ─▶ lease slot cleared ─▶ ReleaseHeld, counted

shm and cuda_ipc: each lease's validity is published in a shared-memory slot table (kv_connectors/lease_slots.py)
that decodes read after their copy instead of waiting for ReleaseKv's answer; a slot is cleared before the core
hears that it may free the lease's blocks.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import NoReturn

import grpc

from splitserve.common.process_exit import exit_now
from splitserve.common.wire import FINISH_REASONS, layout_to_proto, logprobs_to_proto, sampling_from_proto
from splitserve.engine.core_process import messages as m
from splitserve.engine.grammar import check_spec
from splitserve.engine.kv_connectors.factory import MAPPED_TRANSPORTS
from splitserve.engine.kv_connectors.lease_slots import LeaseSlots
from splitserve.engine.kv_connectors.nccl import pair_name, transfer_tag
from splitserve.engine_service.base import Refuse, ServiceBase, setup_logging
from splitserve.prefill_service.leases import LeaseTable
from splitserve.prefill_service.pair_check import DecodePeers, PairRefused
from splitserve.protos import common_pb2, prefill_pb2, prefill_pb2_grpc
from splitserve.runtime import tracing
from splitserve.runtime.metrics import RequestEnd

log = logging.getLogger("splitserve.prefill")
SUSPECT_POLL_S = 0.1  # how often a Prefill call waiting on the core looks at how long the core has been silent


class PrefillService(ServiceBase, prefill_pb2_grpc.PrefillServicer):
    role = "prefill"
    service_names = ["splitserve.v1.Prefill"]

    def __init__(self, engine_config, service_config) -> None:
        super().__init__(engine_config, service_config)
        mapped = service_config.kv_transport in MAPPED_TRANSPORTS
        self.slots = LeaseSlots(self.name, self.start_unix_ns) if mapped else None
        self.leases = LeaseTable(service_config.lease_s, self.slots)
        self.held: dict[str, m.HeldKv] = {}
        self.decode_peers = DecodePeers(service_config.decode_peers, self.name, self.internal_auth)

    def on_core_message(self, msg) -> None:
        if isinstance(msg, m.StepBatch):
            for held in msg.held:
                self.held[held.request_id] = held

    def on_core_stall(self, why: str) -> None:
        """Fail the Prefill calls waiting on the hung core (UNAVAILABLE: the gateway prefills them on a decode
        instead) and queue their abort, so the core frees their blocks if it comes back."""
        from splitserve.engine.outputs import RequestOutput

        for request_id, stream in list(self.client.streams.items()):
            self.client.send(m.Abort([request_id]))
            self.client.send(m.ReleaseHeld(request_id))
            stream.put_nowait(RequestOutput(request_id, [], finished=True, finish_reason="error", error=why))

    async def on_started(self) -> None:
        self._expiry_task = asyncio.create_task(self._expire_leases())

    async def on_stopping(self) -> None:
        """Before the core stops (and its pool goes): no lease reads as valid any more."""
        if self.slots is not None:
            for lease in self.leases.active.values():
                self.slots.clear(lease.slot)
                lease.slot = 0

    async def _expire_leases(self) -> None:
        while True:
            await asyncio.sleep(0.05)
            for lease in self.leases.pop_expired():
                log.info(
                    "request_id=%s lease %s expired; freeing %d blocks",
                    lease.request_id,
                    lease.lease_id,
                    len(lease.block_ids),
                )
                self.client.send(m.ReleaseHeld(lease.request_id))
                self.counters.count("leases_expired")

    async def Prefill(self, request, context):
        parent = tracing.extract(tracing.metadata_carrier(context.invocation_metadata()))
        with tracing.span(
            "prefill",
            parent,
            {"request_id": request.request_id, "prompt_tokens": len(request.prompt_token_ids)},
            kind="server",
        ) as sp:
            return await self._prefill(request, context, sp)

    async def _prefill(self, request, context, sp):
        try:
            self.check_accepting(context)
            params = sampling_from_proto(request.sampling)
            if params.structured_output is not None:
                # refused here, before any work is queued
                check_spec(params.structured_output, self.engine_config.structured_output_max_spec_bytes)
            max_lease_ms = int(self.config.lease_s * 1000)
            if request.lease_ms > max_lease_ms:
                raise ValueError(
                    f"lease_ms is {request.lease_ms}, but this prefill grants at most {max_lease_ms} ms (--lease-s)"
                )
        except Refuse as exc:
            await context.abort(exc.code, exc.message)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        rid = request.request_id
        arrival = time.monotonic_ns()
        arrival_wall = time.time_ns()
        queue = self.client.open_stream(rid)
        self.inflight += 1
        try:
            self.client.send(
                m.AddRequest(
                    rid, list(request.prompt_token_ids), params, request.priority, request.seed, share=request.share
                )
            )
            out = await self._first_output(queue)
        except (asyncio.CancelledError, Refuse) as exc:
            self.client.send(m.Abort([rid]))
            self.client.send(m.ReleaseHeld(rid))
            if isinstance(exc, asyncio.CancelledError):
                raise
            out = exc
        finally:
            self.inflight -= 1
            self.client.close_stream(rid)
        if isinstance(out, Refuse):  # handed back: its abort waits in the pipe for the core, if it comes back
            log.warning("request_id=%s %s", rid, out.message)
            await context.abort(out.code, out.message)
        if out.finish_reason == "error":
            code = grpc.StatusCode.UNAVAILABLE if out.error == self.core_stalled else grpc.StatusCode.INVALID_ARGUMENT
            await context.abort(code, out.error or "request refused")
        total_ns = time.monotonic_ns() - arrival
        response = prefill_pb2.PrefillResponse(
            request_id=rid,
            first_token_id=out.new_token_ids[0],
            cached_prompt_tokens=out.num_cached_tokens,
            timings=common_pb2.Timings(prefill_ns=total_ns, total_ns=total_ns),
        )
        if out.new_logprobs:
            response.first_logprobs.CopyFrom(logprobs_to_proto(out.new_logprobs[0]))
        if out.prompt_logprobs:
            response.prompt_logprobs.extend(logprobs_to_proto(lp) for lp in out.prompt_logprobs)
        self.counters.count("prompt_tokens", len(request.prompt_token_ids))
        queue_s, total_s = out.queue_ns / 1e9, total_ns / 1e9
        self.metrics.prompt_done(len(request.prompt_token_ids), queue_s, max(total_s - queue_s, 0.0), total_s)
        response.timings.queue_ns = out.queue_ns
        tracing.record_span("prefill.queue", arrival_wall, arrival_wall + out.queue_ns, sp)
        tracing.record_span(
            "prefill.compute",
            arrival_wall + out.queue_ns,
            arrival_wall + total_ns,
            sp,
            {"cached_prompt_tokens": out.num_cached_tokens},
        )
        if out.finish_reason != "prefilled":  # its first token is its last: the request ends here
            response.finish_reason = FINISH_REASONS[out.finish_reason]
            self.counters.count("generation_tokens", len(out.new_token_ids))
            end = RequestEnd(
                out.finish_reason, len(out.new_token_ids), total_s, max(total_s - queue_s, 0.0), 1, params.max_tokens
            )
            self.metrics.request_done(end)
            return response
        held = self.held.pop(rid)
        lease = self.leases.grant(rid, held.block_ids, held.block_hashes, held.num_tokens, request.lease_ms)
        response.kv.CopyFrom(
            common_pb2.KvHandle(
                prefill_instance=self.name,
                prefill_address=f"{self.config.peer_host}:{self.config.port}",
                block_ids=held.block_ids,
                block_hashes=held.block_hashes,
                num_tokens=held.num_tokens,
                lease=self.leases.to_proto(lease),
                transport=self.config.kv_transport,
                layout=layout_to_proto(self.client.layout),
                endpoint=self.client.endpoint,
            )
        )
        return response

    async def _first_output(self, queue: asyncio.Queue):
        """The request's first output from the core; Refuse (UNAVAILABLE) when the core turns suspect of hanging
        meanwhile (ServiceBase.core_suspect): the gateway then serves the request elsewhere at once, not after
        --core-stall-timeout-s."""
        get = asyncio.ensure_future(queue.get())
        try:
            while True:
                done, _ = await asyncio.wait({get}, timeout=SUSPECT_POLL_S)
                if done:
                    return get.result()
                if why := self.core_suspect():
                    raise Refuse(grpc.StatusCode.UNAVAILABLE, why)
        finally:
            get.cancel()

    def _release(self, lease_id: str, epoch: int) -> bool:
        lease = self.leases.release(lease_id, epoch)
        if lease is None:
            return False
        self.client.send(m.ReleaseHeld(lease.request_id))
        self.counters.count("leases_released")
        return True

    async def ReleaseKv(self, request, context):
        return prefill_pb2.ReleaseKvResponse(released=self._release(request.lease_id, request.epoch))

    async def PairKv(self, request, context):
        if request.backend not in ("gloo", "nccl"):
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, f"backend must be gloo or nccl, got {request.backend!r}"
            )
        try:  # before the core hears of it: a pairing drops the pair's communicator first
            await self.decode_peers.check(request.decode_instance, request.store_host, request.store_port)
        except PairRefused as exc:
            self.counters.count("pairs_refused")
            log.warning("%s", exc)
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, str(exc))
        pair = pair_name(self.name, request.decode_instance)
        try:
            await self.client.call(
                lambda cid: m.Pair(
                    cid, pair, 1, request.store_host, request.store_port, request.backend, self.config.peer_host
                ),
                timeout_s=60.0,
            )
        except Exception as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        self.counters.count("pairs_created")
        return prefill_pb2.PairKvResponse(paired=True)

    async def SendKv(self, request, context):
        lease = self.leases.get(request.lease_id, request.epoch)
        if lease is None:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"lease {request.lease_id} epoch {request.epoch} is not active (released or expired)",
            )
        bad = [i for i in request.block_indices if i >= len(lease.block_ids)]
        if bad:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"block index {bad[0]} is out of range; the lease holds {len(lease.block_ids)} blocks",
            )
        block_ids = [lease.block_ids[i] for i in request.block_indices]
        pair = pair_name(self.name, request.decode_instance)
        parent = tracing.extract(tracing.metadata_carrier(context.invocation_metadata()))
        with tracing.span(
            "kv.send",
            parent,
            {"request_id": lease.request_id, "kv.blocks": len(block_ids), "kv.transport": "nccl"},
            kind="server",
        ):
            return await self._send(context, block_ids, pair, transfer_tag(lease.epoch))

    async def _send(self, context, block_ids, pair, tag):
        try:
            result = await self.client.call(
                lambda cid: m.SendBlocks(cid, pair, block_ids, tag), timeout_s=self.config.kv_transfer_timeout_s + 5
            )
        except Exception as exc:
            self.counters.count("kv_send_failures")
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        self.counters.count("kv_bytes_sent", result["num_bytes"])
        self.counters.count("kv_blocks_sent", len(block_ids))
        self.counters.count("kv_send_ns", result["transfer_ns"])
        self.counters.count("kv_send_device_ns", result["device_ns"])
        return prefill_pb2.SendKvResponse(num_bytes=result["num_bytes"], transfer_ns=result["transfer_ns"])

    async def Describe(self, request, context):
        response = await ServiceBase.Describe(self, request, context)
        response.load.num_leases = len(self.leases.active)
        response.counters["leases_active"] = len(self.leases.active)
        response.counters["leases_granted"] = self.leases.num_granted
        return response


def run(ns, configs) -> NoReturn:
    setup_logging()
    engine_config = configs["EngineConfig"]  # role prefill, set by the CLI
    service = PrefillService(engine_config, configs["ServiceConfig"])
    tracing.init_tracing("splitserve-prefill", service.name, endpoint=configs["ServiceConfig"].otlp_traces_endpoint)
    add = prefill_pb2_grpc.add_PrefillServicer_to_server
    try:
        code = asyncio.run(service.serve(lambda server: add(service, server)))
    finally:  # after the loop: no call can touch the table any more
        if service.slots is not None:
            service.slots.close()
    exit_now(code)  # the process's last step: no teardown of torch's modules (common/process_exit.py)
