"""How a decode reaches its prefills, per transport: the decode service's part of a KV connector's scheduler
side (the core's connector moves the bytes; engine/kv_connectors/base.py). Chosen once, from
`--kv-transport`, by `PEER_LINKS`:

    transport       at start (--prefill-peers)         before each pull                      after a failed pull
    shm, cuda_ipc   map the pool it reports (MapPeer)  the pool endpoint from its own Describe  -
    nccl            pair (patient: waits for a peer)   pair once; the handle's endpoint          drop the pair (rebuilt)
    nixl            load its agent, connect (MapPeer)  its agent's metadata, from its Describe   (the core drops it)
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Callable

import torch

from splitserve.common.wire import layout_from_proto
from splitserve.engine.core_process import messages as m
from splitserve.engine.core_process.client import EngineClient
from splitserve.engine.kv_connectors.nccl import pair_name
from splitserve.engine_service.config import ServiceConfig
from splitserve.protos import prefill_pb2, prefill_pb2_grpc
from splitserve.runtime.metrics import ServiceCounters

log = logging.getLogger("splitserve.decode.pulls")


class PeerLink:
    """One transport's way to its prefills: the engine client, config, this decode's instance name, the counters
    sink, and `stub(address)` (a prefill's gRPC stub)."""

    def __init__(
        self,
        client: EngineClient,
        config: ServiceConfig,
        instance: str,
        counters: ServiceCounters,
        stub: Callable[[str], prefill_pb2_grpc.PrefillStub],
    ) -> None:
        self.client = client
        self.config = config
        self.instance = instance
        self.counters = counters
        self.stub = stub

    async def prepare_peer(self, name: str, address: str, info) -> None:
        """At start: make the prefill at `address` (its Describe answer `info`) ready for its first pull."""

    async def endpoint_for(self, request_id: str, handle) -> dict[str, str]:
        """Before a pull: the prefill's endpoint the core's connector gets in its PullSpec."""
        return dict(handle.endpoint)

    def endpoint_now(self, handle) -> dict[str, str] | None:
        """`endpoint_for`'s answer when it is known without waiting (a pool mapped, a pair built): the import goes
        to the core within the request's admission; None: await `endpoint_for`."""
        return None

    def pull_failed(self, handle) -> None:
        """A pull from the handle's prefill failed (the failure policy applies besides)."""

    def pairing_store(self, prefill_instance: str) -> tuple[str, int] | None:
        """The store (host, port) of this decode's PairKv to that prefill in flight now; None when none is."""
        return None


class MappedPools(PeerLink):
    """shm, cuda_ipc, nixl: the decode maps the prefill's pool (nixl: loads its agent), only ever from the endpoint
    the prefill reports in its own Describe (mapping hands its fields to the shared-memory and CUDA drivers, loading
    hands them to UCX), never a handle's copy."""

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self._endpoints: dict[str, dict[str, str]] = {}  # prefill address -> its pool endpoint, from its Describe

    async def prepare_peer(self, name: str, address: str, info) -> None:
        transport = self.config.kv_transport
        if transport not in info.transports or not info.kv_endpoint:
            return  # its requests fail by policy (the gateway pairs only common transports)
        self._endpoints[address] = dict(info.kv_endpoint)
        await self.client.call(
            lambda cid: m.MapPeer(cid, name, transport, dict(info.kv_endpoint), layout_from_proto(info.layout)),
            timeout_s=60.0,
        )
        self.counters.count("peers_mapped")
        log.info("mapped %s's KV pool (%s)", name, transport)

    async def endpoint_for(self, request_id: str, handle) -> dict[str, str]:
        return await self._pool_endpoint(request_id, handle)

    def endpoint_now(self, handle) -> dict[str, str] | None:
        known = self._endpoints.get(handle.prefill_address)
        return known if known == dict(handle.endpoint) else None

    async def _pool_endpoint(self, request_id: str, handle) -> dict[str, str]:
        """The pool endpoint the prefill at the handle's address reports in Describe (kept; asked again when
        a handle names another pool, as after a restart). A handle's own copy is never mapped: mapping
        hands its fields to the shared-memory and CUDA drivers. {"error": ...} when the prefill cannot say."""
        from splitserve.protos import common_pb2

        address, claimed = handle.prefill_address, dict(handle.endpoint)
        known = self._endpoints.get(address)
        if known == claimed:
            return known
        try:  # the handle came from a live prefill: a channel still backing off from its restart may reconnect
            info = await self.stub(address).Describe(
                common_pb2.DescribeRequest(), timeout=self.config.kv_transfer_timeout_s, wait_for_ready=True
            )
        except Exception as exc:
            return {"error": f"cannot ask {address} for its KV pool: {exc}"}
        known = self._endpoints[address] = dict(info.kv_endpoint)
        if known != claimed:
            log.warning(
                "request_id=%s: the KV handle names a pool %s does not report; using the one it reports",
                request_id,
                handle.prefill_instance,
            )
        return known


class Pairs(PeerLink):
    """nccl (gloo on CPU): a 2-rank communicator per prefill/decode pair, built once (the decode's core hosts the
    store; the prefill joins through PairKv); a pull that failed drops it, the next pull pairs again."""

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self._pairs: dict[str, asyncio.Task] = {}
        self.pairing: dict[str, tuple[str, int]] = {}  # prefill instance -> the store of a PairKv in flight

    async def prepare_peer(self, name: str, address: str, info) -> None:
        await self.ensure_pair(name, address, patient=True)

    async def endpoint_for(self, request_id: str, handle) -> dict[str, str]:
        try:
            await self.ensure_pair(handle.prefill_instance, handle.prefill_address)
        except Exception as exc:  # the core's pull then fails and the policy applies
            log.warning("request_id=%s pairing with %s failed: %s", request_id, handle.prefill_instance, exc)
        return dict(handle.endpoint)

    def endpoint_now(self, handle) -> dict[str, str] | None:
        task = self._pairs.get(handle.prefill_instance)
        paired = task is not None and task.done() and not task.cancelled() and task.exception() is None
        return dict(handle.endpoint) if paired else None

    def pull_failed(self, handle) -> None:
        self._pairs.pop(handle.prefill_instance, None)  # rebuilt on the next pull

    def pairing_store(self, prefill_instance: str) -> tuple[str, int] | None:
        return self.pairing.get(prefill_instance)

    async def ensure_pair(self, prefill_instance: str, prefill_address: str, patient: bool = False) -> None:
        """Pair with a prefill (once). `patient` (start-up) waits up to 30 s for a peer that is still coming
        up; on a request's path the wait is one transfer timeout, then the failure policy applies."""
        task = self._pairs.get(prefill_instance)
        if task is None or (task.done() and task.exception() is not None):
            task = asyncio.create_task(self._pair(prefill_instance, prefill_address, patient))
            self._pairs[prefill_instance] = task
        await task

    async def _peer_gpu(self, prefill_address: str) -> str:
        """The GPU UUID a prefill reports in its own Describe ("" when it says none or cannot answer)."""
        from splitserve.protos import common_pb2

        try:
            info = await self.stub(prefill_address).Describe(common_pb2.DescribeRequest(), timeout=2.0)
        except Exception:
            return ""
        return info.kv_endpoint.get("gpu_uuid", "")

    async def _pair(self, prefill_instance: str, prefill_address: str, patient: bool) -> None:
        host = self.config.peer_host  # the prefill dials the store here
        with socket.socket() as s:
            s.bind((self.config.host, 0))
            port = s.getsockname()[1]
        backend = "nccl" if torch.cuda.is_available() and self.client.info.device.startswith("cuda") else "gloo"
        pair = pair_name(prefill_instance, self.instance)
        keepalive = backend == "nccl" and self.config.kv_link_keepalive_ms > 0  # a GPU decode's own link
        peer_gpu = await self._peer_gpu(prefill_address) if keepalive else ""
        mine = asyncio.create_task(
            self.client.call(
                lambda cid: m.Pair(cid, pair, 0, host, port, backend, peer_gpu_uuid=peer_gpu), timeout_s=60.0
            )
        )
        await asyncio.sleep(0.05)  # let the store come up before the peer connects
        self.pairing[prefill_instance] = (host, port)  # what ConfirmPair answers the prefill meanwhile
        try:
            await self.stub(prefill_address).PairKv(
                prefill_pb2.PairKvRequest(
                    decode_instance=self.instance, store_host=host, store_port=port, backend=backend
                ),
                timeout=30.0 if patient else self.config.kv_transfer_timeout_s,
                wait_for_ready=True,
            )
        finally:
            self.pairing.pop(prefill_instance, None)
        await mine
        self.counters.count("pairs_created")
        log.info("paired with %s over %s", prefill_instance, backend)


# nixl: like a mapped pool, the prefill's agent metadata is only ever taken from its own Describe
PEER_LINKS: dict[str, type[PeerLink]] = {
    "shm": MappedPools,
    "cuda_ipc": MappedPools,
    "nccl": Pairs,
    "nixl": MappedPools,
}
