"""The decode side's control of KV pulls: one PendingPull per request waiting for its KV (the lease part of the
connector's scheduler side; reaching the prefills per transport: decode_service/peers.py).

    start(req) ─▶ core: ImportKv (shm, cuda_ipc: with the lease's slot) ─(nccl: NeedSend ─▶ Prefill.SendKv)─▶
               ImportDone (the copy ended)
               ─▶ committed: the core read the lease's slot after the copy and runs the request already
                             (engine/core_process/kv_scheduler.py): the pull is recorded, Prefill.ReleaseKv sent
                             on the side (never awaited)
                  otherwise, is the copy valid?  the slot said no (lease_lost): lost
                                                 nccl: SendKv answered that it sent (the sender checked its lease)
                                                 no slot to read (nixl, a full table, a stale one): ReleaseKv's
                                                 answer, awaited
               ─▶ valid: CommitImport(ok), then ReleaseKv on the side
                  lost / pull failed: policy recompute → local prefill, policy fail → error to the client
An nccl pull needs the prefill's SendKv to have answered ok: a receive that ended because its communicator was
torn down is no transfer, and the sender is the side that knows.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import grpc

from splitserve.common.wire import layout_from_proto, logprobs_from_proto
from splitserve.decode_service.peers import PEER_LINKS
from splitserve.engine.core_process import messages as m
from splitserve.engine.core_process.client import EngineClient
from splitserve.engine.kv_connectors.factory import MAPPED_TRANSPORTS
from splitserve.engine.kv_connectors.nccl import transfer_tag
from splitserve.engine_service.config import ServiceConfig
from splitserve.protos import prefill_pb2, prefill_pb2_grpc
from splitserve.runtime import tracing
from splitserve.runtime.grpc_server import InternalAuth, internal_channel
from splitserve.runtime.metrics import ServiceCounters

log = logging.getLogger("splitserve.decode.pulls")

# Where no slot is published, ReleaseKv's answer says whether a copy counts (once a lease lapses the prefill may
# reuse its blocks), so it is worth waiting for while the lease could still hold: in a burst a prefill answers
# seconds late (its event loop works through the queued Prefill calls first), and a 1 s limit threw valid copies
# away (docs/performance.md, "Findings that set defaults": ReleaseKv waits until the lease expires). A prefill
# that is gone fails the call at once (no wait_for_ready): a restarted one knows none of the old leases anyway.
MIN_RELEASE_TIMEOUT_S = 1.0


def release_timeout_s(lease, now_unix_ns: int) -> float:
    """How long to wait for ReleaseKv: until `lease` (common_pb2.Lease) expires, and at least MIN_RELEASE_TIMEOUT_S
    (the prefill's clock may run ahead of ours)."""
    return max(MIN_RELEASE_TIMEOUT_S, (lease.expires_unix_ns - now_unix_ns) / 1e9)


def lease_ref(handle) -> m.LeaseRef | None:
    """The handle's lease slot for its core to check the copy against, where the decode reads the prefill's pool
    itself (shm, cuda_ipc) and the prefill published one; None: the service decides after the copy."""
    lease = handle.lease
    if handle.transport not in MAPPED_TRANSPORTS or not lease.slot or not lease.slots_name:
        return None
    return m.LeaseRef(lease.slots_name, lease.slot, lease.epoch, lease.expires_unix_ns)


@dataclass
class PendingPull:
    request_id: str
    handle: object  # common_pb2.KvHandle
    cancelled: bool = False
    send: asyncio.Task | None = None  # nccl: the SendKv call; its result is None (sent) or why it failed


@dataclass(frozen=True)
class PullHooks:
    """What a pull needs to know of, or tell, the decode service's request bookkeeping."""

    span_of: Callable[[str], object | None]  # request_id -> its "decode" span, or None
    on_imported: Callable[[str, int, int], None]  # (request_id, cached prompt tokens, blocks pulled)
    fail_request: Callable[[str, str], None]  # (request_id, error): end it with that error


class PullCoordinator:
    """Pulls of one decode service: its engine client, its config, its instance name and internal
    auth, the counters sink, and the hooks above; nothing else of the service."""

    def __init__(
        self,
        client: EngineClient,
        config: ServiceConfig,
        instance: str,
        internal_auth: InternalAuth | None,
        counters: ServiceCounters,
        hooks: PullHooks,
    ) -> None:
        self.client = client
        self.config = config
        self.instance = instance
        self.internal_auth = internal_auth
        self.counters = counters
        self.hooks = hooks
        self.pending: dict[str, PendingPull] = {}
        self._stubs: dict[str, prefill_pb2_grpc.PrefillStub] = {}
        self._tasks: set[asyncio.Task] = set()
        # how this decode reaches its prefills: chosen once, by transport (the stub looked up at each call)
        self.link = PEER_LINKS[config.kv_transport](client, config, instance, counters, lambda a: self.stub(a))

    @property
    def recompute(self) -> bool:
        return self.config.kv_load_failure_policy == "recompute"

    def stub(self, address: str) -> prefill_pb2_grpc.PrefillStub:
        if address not in self._stubs:
            self._stubs[address] = prefill_pb2_grpc.PrefillStub(internal_channel(address, self.internal_auth))
        return self._stubs[address]

    def _spawn(self, coro) -> asyncio.Task:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def settle(self, timeout_s: float = 1.0) -> None:
        """At stop: give the calls on their way (a ReleaseKv sent after a commit) up to `timeout_s` to end."""
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=timeout_s)

    # -- lifecycle -------------------------------------------------------------------------
    def start(self, req, params) -> None:
        self.pending[req.request_id] = PendingPull(req.request_id, req.kv)
        endpoint = self.link.endpoint_now(req.kv)
        if endpoint is not None:  # the usual case: the import leaves within this call, no task's turn awaited
            self._send_import(req, params, endpoint)
        else:
            self._spawn(self._start(req, params))

    async def _start(self, req, params) -> None:
        endpoint = await self.link.endpoint_for(req.request_id, req.kv)  # nccl: paired first
        if req.request_id not in self.pending:
            return  # cancelled while pairing or asking: its lease is released, the core never hears of it
        self._send_import(req, params, endpoint)

    def _send_import(self, req, params, endpoint: dict[str, str]) -> None:
        handle = req.kv
        spec = m.PullSpec(
            transport=handle.transport,
            prefill_instance=handle.prefill_instance,
            endpoint=endpoint,
            block_ids=list(handle.block_ids),
            block_hashes=list(handle.block_hashes),
            num_tokens=handle.num_tokens,
            layout=layout_from_proto(handle.layout),
            request_id=req.request_id,
            tag=transfer_tag(handle.lease.epoch),
            lease=lease_ref(handle),
        )
        first_lp = logprobs_from_proto(req.first_logprobs) if req.HasField("first_logprobs") else None
        self.client.send(
            m.ImportKv(
                req.request_id,
                list(req.prompt_token_ids),
                params,
                req.seed,
                req.first_token_id,
                first_lp,
                req.priority,
                spec,
                list(req.fork_ids),
                share=req.share,
            )
        )
        self.client.flush()  # now, not at the event loop's next turn: the pull starts when the core has it

    def cancel(self, request_id: str) -> None:
        pull = self.pending.pop(request_id, None)
        if pull is not None:
            pull.cancelled = True
            self._spawn(self._release(pull.handle))

    def on_core_message(self, msg) -> None:
        if isinstance(msg, m.ImportDone):
            if msg.committed:
                self._committed(msg)
            else:
                self._spawn(self._finish(msg))
        elif isinstance(msg, m.NeedSend):
            pull = self.pending.get(msg.request_id)
            if pull is not None:
                pull.send = self._spawn(self._ask_send(pull, msg))

    async def _ask_send(self, pull: PendingPull, msg: m.NeedSend) -> str | None:
        """Ask the prefill to send; None when it answered that it sent, else why not."""
        h = pull.handle
        span = self.hooks.span_of(msg.request_id)
        metadata = tuple(tracing.inject(span).items()) if span is not None else None
        try:
            await self.stub(h.prefill_address).SendKv(
                prefill_pb2.SendKvRequest(
                    decode_instance=self.instance,
                    lease_id=h.lease.lease_id,
                    epoch=h.lease.epoch,
                    block_indices=msg.block_indices,
                ),
                timeout=self.config.kv_transfer_timeout_s,
                metadata=metadata,
                wait_for_ready=True,
            )
        except grpc.aio.AioRpcError as exc:
            log.warning("request_id=%s SendKv failed: %s", msg.request_id, exc.details())
            return f"the prefill's send failed: {exc.details()}"
        return None

    async def _release(self, handle) -> bool:
        try:
            response = await self.stub(handle.prefill_address).ReleaseKv(
                prefill_pb2.ReleaseKvRequest(lease_id=handle.lease.lease_id, epoch=handle.lease.epoch),
                timeout=release_timeout_s(handle.lease, time.time_ns()),
                wait_for_ready=False,
            )
            return response.released
        except grpc.aio.AioRpcError as exc:
            log.warning("ReleaseKv to %s failed: %s", handle.prefill_address, exc.details())
            return False

    def _committed(self, done: m.ImportDone) -> None:
        """The core committed the import itself (the lease's slot said the copy is valid, or nothing was copied):
        the request runs already, its first step's outputs in the same batch as `done`, after it. Only what its
        first delta reports is done now; the rest once those outputs are on their way."""
        pull = self.pending.pop(done.request_id, None)
        if pull is None:
            return  # cancelled meanwhile: cancel() released the lease, the core's Abort ends the request
        self.hooks.on_imported(done.request_id, done.num_cached_tokens, done.num_blocks_pulled)
        self._spawn(self._after_commit(pull, done))

    async def _after_commit(self, pull: PendingPull, done: m.ImportDone) -> None:
        """Record the pull and release its lease (the prefill unpins the blocks whenever it gets to it). This task's
        first turn comes before the stream's that sends the first token, its second after: the bookkeeping and the
        ReleaseKv call's Python work held the first token back 0.2-0.3 ms on a 2-core CPU."""
        await asyncio.sleep(0)
        self._record_transfer(pull, done)
        self._count(done)
        await self._release(pull.handle)

    async def _finish(self, done: m.ImportDone) -> None:
        pull = self.pending.pop(done.request_id, None)
        if pull is None:
            return  # cancelled; its lease was released by cancel()
        self._record_transfer(pull, done)
        if done.ok and pull.send is not None:  # nccl: the receive ended; did the sender finish its send?
            why = await pull.send
            if why is not None:
                done = replace(done, ok=False, error=why)
        if not done.ok:  # the pull itself failed: on by the policy at once; its lease is released on the side
            self._spawn(self._release(pull.handle))
            self._pull_failed(pull, done)
            return
        valid = self._copy_valid(pull, done)
        if valid is None:  # the prefill publishes no validity for this lease: its ReleaseKv answer decides
            valid = await self._release(pull.handle)
        elif valid:
            # the request joins the next step first; the prefill unpins the blocks whenever it gets to it
            self._commit(done)
            self._spawn(self._release(pull.handle))
            return
        if valid:
            self._commit(done)
        else:
            self._lease_lost(pull, done)

    @staticmethod
    def _copy_valid(pull: PendingPull, done: m.ImportDone) -> bool | None:
        """Whether an ended copy the core did not commit counts, known without a round trip; None when only
        ReleaseKv can tell."""
        if pull.send is not None or pull.handle.transport == "nccl":
            return True  # the prefill checked the lease before it sent (SendKv answered ok), or nothing was sent
        return False if done.lease_lost else None  # the core read the lease's slot after the copy: lost

    def _record_transfer(self, pull: PendingPull, done: m.ImportDone) -> None:
        end_ns = done.ended_unix_ns or time.time_ns()
        tracing.record_span(
            "kv.transfer",
            end_ns - done.transfer_ns,
            end_ns,
            self.hooks.span_of(done.request_id),
            {
                "kv.transport": pull.handle.transport,
                "kv.bytes": done.num_bytes,
                "kv.blocks": done.num_blocks_pulled,
                "kv.cached_prompt_tokens": done.num_cached_tokens,
                "kv.ok": done.ok,
            },
        )

    def _commit(self, done: m.ImportDone) -> None:
        self.hooks.on_imported(done.request_id, done.num_cached_tokens, done.num_blocks_pulled)
        self._count(done)
        self.client.send(m.CommitImport(done.request_id, ok=True))

    def _count(self, done: m.ImportDone) -> None:
        """A committed pull, counted."""
        self.counters.count("kv_blocks_pulled", done.num_blocks_pulled)
        self.counters.count("kv_bytes_pulled", done.num_bytes)
        self.counters.count("kv_transfer_ns", done.transfer_ns)
        self.counters.count("kv_copy_device_ns", done.device_ns)
        self.counters.observe_transfer(done.transfer_ns / 1e9)

    def _lease_lost(self, pull: PendingPull, done: m.ImportDone) -> None:
        """The copy happened but the lease lapsed (or was released) meanwhile: discard it, by the policy."""
        reason = f"KV lease {pull.handle.lease.lease_id} was no longer valid after the copy"
        self.client.send(m.CommitImport(done.request_id, ok=False, recompute=self.recompute, error=reason))
        if not self.recompute:
            self.hooks.fail_request(done.request_id, reason)
        else:
            self.counters.count("kv_pull_recomputes")

    def _pull_failed(self, pull: PendingPull, done: m.ImportDone) -> None:
        """The pull itself failed: recompute locally or fail, by policy."""
        reason = done.error or "the KV pull failed"
        self.link.pull_failed(pull.handle)
        self.counters.count("kv_pull_failures")
        log.warning("request_id=%s %s (policy %s)", done.request_id, reason, self.config.kv_load_failure_policy)
        self.client.send(m.CommitImport(done.request_id, ok=False, recompute=self.recompute, error=reason))
        if self.recompute:
            self.counters.count("kv_pull_recomputes")
        else:
            self.hooks.fail_request(done.request_id, reason)

    # -- peers ---------------------------------------------------------------------------
    async def prepare_peers(self, addresses: list[str]) -> None:
        """At start, for each configured prefill (retrying until it answers Describe): make it ready for its
        first pull (decode_service/peers.py: map its pool, or pair with it), so that its first request waits for
        neither."""
        from splitserve.protos import common_pb2

        for address in addresses:
            for attempt in range(600):
                try:
                    info = await self.stub(address).Describe(common_pb2.DescribeRequest(), timeout=2.0)
                except Exception as exc:
                    if attempt % 20 == 0:
                        log.info("waiting for prefill %s: %s", address, exc)
                    await asyncio.sleep(0.5)
                    continue
                name = info.instance_id.split("@")[0]
                try:
                    await self.link.prepare_peer(name, address, info)
                except Exception as exc:  # its requests will pair or map on their way (or fail by policy)
                    log.warning("preparing prefill %s (%s) failed: %s", name, address, exc)
                break
