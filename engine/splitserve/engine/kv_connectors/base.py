"""The KV connector: one class per transport, the one object a core process moves KV through.

    transport   class (factory.py)                  the prefill's pool    a pull
    shm         shm.ShmConnector                    shared memory         copies out of the mapped segment
    cuda_ipc    cuda_ipc.CudaIpcConnector           CUDA IPC export       copies from the mapped pool
    nccl        nccl.NcclConnector (gloo on CPU)    its own               receives what the prefill sends
    nixl        nixl.NixlConnector                  registered with NIXL  a one-sided READ over UCX

The transport is chosen once (`factory.make_connector`); the core loop and its scheduler side
(core_process/kv_scheduler.py) talk to this interface only, in vLLM v1's spirit; a connector reports through
its own types (`Completion`, `Moved`, `SendWanted`), which the core process turns into its messages:

    core loop thread                                  lane worker thread (one per peer, lanes.py)
    ────────────────                                  ──────────────────────────────────────────
    kv_cache_factory(layout, n, device)  at start: the pool, placed where peers can reach it (`endpoint`)
    start_load(Load)  ─ prepare_pull (map) ─▶         pull(spec, indices, block_ids, target) -> Moved
    start_send(Send)  ─────────────────────▶          send(pair, block_ids, kv_cache, tag) -> dict
    poll() -> [Completion]  ◀── ended transfers, and those past their deadline
    forget(request_id)      an aborted load: it runs to its end and is never reported

A Completion says whether to tell the service (`report`: once per transfer) and whether the transfer's work
has ended (`ended`: whatever its blocks hold may be reused). A transfer past its deadline is reported failed at
once and ends later (`report` then `ended`); a forgotten load only ends. Subclasses implement the transport:
`prepare_pull`, `pull`, `send`, and, where the transport has them, `map_source`, `pair`, `drop_pair`.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar, NamedTuple

import torch

from splitserve.common.kv_layout import KvLayout, transfer_plan
from splitserve.engine.kv_connectors.lanes import Transfer, TransferLanes
from splitserve.engine.kv_connectors.link_keepalive import CudaLink, LinkKeepalive
from splitserve.engine.worker.kv_cache import allocate_kv_cache

log = logging.getLogger("splitserve.kv")

# The transports give up by themselves after kv_transfer_timeout_s; this much later a connector reports a
# transfer failed whatever it is doing (a copy that never returns).
TIMEOUT_GRACE_S = 1.0
CLOSE_WAIT_S = 1.0  # at shutdown, how long running transfers get to end


class Moved(NamedTuple):
    """What one pull moved: bytes, and the copy's device time (CUDA events; cuda_ipc only, else 0)."""

    num_bytes: int
    device_ns: int = 0


@dataclass
class SendWanted:
    """A receive is about to start on its transfer worker (nccl): the prefill must be asked now to send these
    blocks of the request's handle on the pair's communicator. The core process turns it into its message."""

    request_id: str
    pair: str
    block_indices: list[int]


@dataclass
class PullTarget:
    """What one pull needs besides its spec, gathered on the core thread: the decode's pool, the prefill's
    mapped pool (shm, cuda_ipc: `prepare_pull`), and how a receive asks the prefill to send
    (`ask_send(SendWanted)`, called on the worker: the core process passes it on at once)."""

    kv_cache: torch.Tensor  # (N, L, 2, bs, Hkv, D), this process's pool
    ask_send: Callable[[SendWanted], None] | None
    source: torch.Tensor | None = None  # the prefill's pool, mapped here; None for nccl


@dataclass(eq=False)
class Load:
    """One pull: the handle's blocks at `indices` (those past the prefix cached here) into `block_ids`."""

    request_id: str
    spec: Any  # the core process's PullSpec: prefill_instance, block_ids, tag, ...
    indices: list[int]
    block_ids: list[int]  # this pool's blocks, one per index
    kv_cache: torch.Tensor
    ask_send: Callable[[SendWanted], None] | None = None  # nccl: have the prefill asked to send
    start_ns: int = field(default_factory=time.perf_counter_ns)


@dataclass(eq=False)
class Send:
    """One send (prefill): the pool's `block_ids` to the pair's decode; `call_id` is the service's call."""

    call_id: int
    pair: str
    block_ids: list[int]
    kv_cache: torch.Tensor
    tag: int = 0


@dataclass
class Completion:
    """What `poll` says about one transfer: its result or error, whether to tell the service now (`report`)
    and whether its work has ended (`ended`: the blocks it reads or writes are free to reuse)."""

    transfer: Load | Send
    result: Any = None  # Moved (a load) or the send's {"num_bytes", "transfer_ns", "device_ns"}
    error: BaseException | None = None
    report: bool = True
    ended: bool = True


class KvConnector:
    """One per core process; a subclass per transport. `options`: transport, instance, start_epoch, role,
    timeout_s (each send or receive gives up after it), link_keepalive_ms."""

    transport: ClassVar[str] = ""
    moves_tensor_parallel: ClassVar[bool] = False  # whether it moves heads between ranks by a transfer plan

    def __init__(self, options: dict) -> None:
        self.instance = options.get("instance", "local")
        self.start_epoch = int(options.get("start_epoch", time.time_ns()))
        self.role = options.get("role", "both")
        self.timeout_s = float(options.get("timeout_s", 10.0))
        self.deadline_s = self.timeout_s + TIMEOUT_GRACE_S  # a transfer's deadline, from its start
        self.endpoint: dict[str, str] = {}  # what peers need to reach this pool (reported in Describe)
        keepalive_ms = float(options.get("link_keepalive_ms") or 0)
        self.keepalive = LinkKeepalive(keepalive_ms / 1000) if keepalive_ms > 0 else None
        self.device: torch.device | None = None  # this process's KV pool device
        self._core_stream: torch.cuda.Stream | None = None  # the core thread's stream on that device
        self.lanes = TransferLanes()
        self._unreported: set[Transfer] = set()
        self._loads: dict[str, Transfer] = {}  # request_id -> its load, until reported or forgotten
        self._completed: list[Completion] = []
        self._closed = False

    @property
    def exports(self) -> bool:
        """Whether peers read this pool (a prefill's)."""
        return self.role in ("prefill", "both")

    # -- pool placement (core thread, once) -------------------------------------------------
    def kv_cache_factory(self, layout: KvLayout, num_blocks: int, device: torch.device) -> torch.Tensor:
        """The engine's KV pool, placed where this transport's peers reach it; sets `endpoint`."""
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        if self.device.type == "cuda":  # called on the core thread: its stream is the one steps run on
            self._core_stream = torch.cuda.current_stream(self.device)
        return self.place_pool(layout, num_blocks, self.device)

    def place_pool(self, layout: KvLayout, num_blocks: int, device: torch.device) -> torch.Tensor:
        return allocate_kv_cache(layout, num_blocks, device)

    def rank_pool_openers(self) -> list | None:
        """Tensor parallel: per rank, a picklable `opener(layout, num_blocks, device) -> pool` that a rank > 0
        calls for its pool where this transport placed it (None at rank 0), or None: each rank allocates its own."""
        return None

    def check_layout(self, source: KvLayout, own: KvLayout) -> None:
        """Raise ValueError (naming both) when this transport cannot move `source`'s blocks into this pool: unless
        the layouts are equal, or (a transport that `moves_tensor_parallel`) a transfer plan maps them."""
        if not self.moves_tensor_parallel and max(source.tensor_parallel_size, own.tensor_parallel_size) > 1:
            raise ValueError(
                f"the {self.transport} transport does not move KV of tensor-parallel instances (shm, cuda_ipc and "
                f"nccl do): [{source.describe()}] vs [{own.describe()}]"
            )
        if source == own:
            return
        if source.tensor_parallel_size == 1 and own.tensor_parallel_size == 1:
            raise ValueError(own.mismatch(source))
        transfer_plan(source, own)  # ValueError naming both when no plan maps them

    # -- worker side: the asynchronous interface (core thread) ------------------------------
    @property
    def num_in_flight(self) -> int:
        return self.lanes.num_in_flight

    def start_load(self, load: Load) -> None:
        """Start a pull on its prefill's lane and return at once; `poll` reports it. Raises (starting nothing)
        when the pull cannot start: a spec of another transport, a pool that cannot be mapped."""
        if load.spec.transport != self.transport:
            raise ValueError(
                f"the KV handle's transport is {load.spec.transport!r}; this decode pulls over {self.transport!r}"
            )
        target = PullTarget(load.kv_cache, load.ask_send, self.prepare_pull(load.spec))
        transfer = self._submit(
            load,
            load.spec.prefill_instance,
            functools.partial(self.pull, load.spec, load.indices, load.block_ids, target),
        )
        self._loads[load.request_id] = transfer

    def start_send(self, send: Send) -> None:
        """Start a send on its pair's lane (after the pair's earlier transfers) and return at once."""
        self._submit(send, send.pair, functools.partial(self.send, send.pair, send.block_ids, send.kv_cache, send.tag))

    def poll(self) -> list[Completion]:
        """Every transfer that ended or passed its deadline since the last poll."""
        self.lanes.poll()
        done, self._completed = self._completed, []
        return done

    def forget(self, request_id: str) -> None:
        """An aborted request's load runs on to its end (its blocks in use till then) and is never reported."""
        transfer = self._loads.pop(request_id, None)
        self._unreported.discard(transfer)

    def close(self) -> int:
        """Drop queued transfers, give running ones a moment, then free the transport's own resources (once;
        the core loop closes its connector when it exits, the process again on its way out). Returns how many
        transfers still run."""
        if self._closed:
            return 0
        self._closed = True
        alive = self.lanes.close(CLOSE_WAIT_S)
        if self.keepalive is not None:
            self.keepalive.close()
        self.release_transport()
        return alive

    def _submit(self, item: Load | Send, lane: str, work: Callable[[], Any]) -> Transfer:
        transfer = self.lanes.submit(
            lane,
            work,
            functools.partial(self._ended, item),
            functools.partial(self._overdue, item),
            self.deadline_s,
        )
        self._unreported.add(transfer)
        return transfer

    def _ended(self, item: Load | Send, transfer: Transfer, result: Any, error: BaseException | None) -> None:
        report = transfer in self._unreported
        self._close_out(item, transfer)
        self._completed.append(Completion(item, result, error, report=report, ended=True))

    def _overdue(self, item: Load | Send, transfer: Transfer) -> None:
        if transfer not in self._unreported:
            return  # forgotten
        self._close_out(item, transfer)
        error = TimeoutError(
            f"the transfer did not end within {self.deadline_s:g} s (its blocks stay held until it does)"
        )
        self._completed.append(Completion(item, None, error, report=True, ended=False))

    def _close_out(self, item: Load | Send, transfer: Transfer) -> None:
        self._unreported.discard(transfer)
        if isinstance(item, Load) and self._loads.get(item.request_id) is transfer:
            del self._loads[item.request_id]

    # -- the transport (subclasses) ---------------------------------------------------------
    def prepare_pull(self, spec) -> torch.Tensor | None:
        """Core thread, before a pull goes to its worker: what the worker needs that only the core thread may
        set up (a mapped pool). None when nothing."""
        return None

    def pull(self, spec, indices: list[int], dst_blocks: list[int], target: PullTarget) -> Moved:
        """Lane worker: copy the handle's blocks at `indices` into `dst_blocks` of `target.kv_cache`; returns
        when they are in place."""
        raise NotImplementedError

    def send(self, pair: str, block_ids: list[int], kv_cache: torch.Tensor, tag: int = 0) -> dict:
        """Lane worker (prefill): send blocks to the pair's decode."""
        raise ValueError(f"the {self.transport} transport sends nothing: its decodes read the prefill's pool")

    def map_source(self, prefill_instance: str, transport: str, endpoint: dict, layout: KvLayout) -> torch.Tensor:
        raise ValueError(f"the {self.transport} transport maps no peer pool; mapped ones: shm, cuda_ipc")

    def pair(self, pair: str, rank: int, host: str, port: int, backend: str, device, local_host=None) -> None:
        raise ValueError(f"the {self.transport} transport has no pairs; nccl pairs")

    def keep_peer_awake(self, uuid: str) -> None:
        """nccl pairs: keep the link to the prefill's GPU awake (others keep their links from map_source)."""

    def release_transport(self) -> None:
        """At close: pools, mappings, communicators."""

    # -- helpers for subclasses --------------------------------------------------------------
    def _keep_link_awake(self, peer: torch.device) -> None:
        """With link_keepalive_ms, keep the link peer -> this pool's device awake (once per peer device;
        the link is built on the keep-alive thread, and nothing of it can fail the caller)."""
        own = self.device
        if self.keepalive is None or own is None or own.type != "cuda" or peer == own:
            return
        self.keepalive.add(f"{peer}->{own}", lambda: CudaLink(peer, own))

    @contextlib.contextmanager
    def _side_stream(self, kv_cache: torch.Tensor) -> Iterator[torch.cuda.Stream | None]:
        """On CUDA: make a side stream of the pool's device current on this (worker) thread, after the work the
        core's stream has queued so far (a block an earlier step freed is done with before a copy lands in it).
        The core's stream never waits for it; the caller waits for its own work. None on CPU."""
        if not kv_cache.is_cuda:
            yield None
            return
        torch.cuda.set_device(kv_cache.device)  # the current device is per thread
        stream = torch.cuda.Stream(kv_cache.device)
        core = self._core_stream if self._core_stream is not None else torch.cuda.default_stream(kv_cache.device)
        stream.wait_stream(core)
        with torch.cuda.stream(stream):
            yield stream
