"""Typed messages between a service process and its engine core process.

They travel pickled over one multiprocessing pipe, batched: each send carries a list
of messages (every command the server collected in one event-loop turn; every output
of one engine step), so per-token work never costs one pipe round trip per request.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from splitserve.common.sampling_params import SamplingParams
from splitserve.engine.outputs import RequestOutput


# -- server → core -------------------------------------------------------------------------
@dataclass
class AddRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int = 0
    seed: int | None = None
    fork_ids: list[str] = field(default_factory=list)  # more sequences of this prompt (n > 1)
    share: int = 0  # the caller's fair share (its sequences in flight at the gateway): lower runs first


@dataclass
class Abort:
    request_ids: list[str]


@dataclass
class ReleaseHeld:
    """Prefill role: unpin a parked request's blocks."""

    request_id: str


@dataclass(frozen=True)
class LeaseRef:
    """A lease's slot in its prefill's shared-memory table (kv_connectors/lease_slots.py), from the KV handle: what
    the core reads after the copy to know, by itself, whether the copy counts."""

    slots_name: str
    slot: int
    epoch: int
    expires_unix_ns: int  # the prefill's clock (the same host's)


@dataclass
class PullSpec:
    """Where the prompt's KV lives on the prefill (from the KV handle)."""

    transport: str
    prefill_instance: str
    endpoint: dict[str, str]
    block_ids: list[int]
    block_hashes: list[bytes]
    num_tokens: int
    layout: Any  # KvLayout of the prefill
    request_id: str = ""
    tag: int = 0  # message tag of an nccl/gloo transfer (the lease epoch), so transfers never cross
    # shm, cuda_ipc with a slot published: the core checks the copy against it and commits a valid one itself
    lease: LeaseRef | None = None


@dataclass
class ImportKv:
    """Decode role: allocate blocks for a prompt and pull its KV."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int
    first_token_id: int
    first_logprobs: Any
    priority: int
    spec: PullSpec
    fork_ids: list[str] = field(default_factory=list)  # more sequences of this prompt, forked once imported
    share: int = 0  # the caller's fair share, as AddRequest's


@dataclass
class CommitImport:
    """Decode role: the service's verdict on an import its core did not commit itself (ImportDone.committed): the
    lease was still valid after the copy (ok) or not, or the pull failed (recompute/fail)."""

    request_id: str
    ok: bool
    recompute: bool = True
    error: str = ""  # not ok and not recompute: what the request (and its forks) end with; empty: the lease's


@dataclass
class SendBlocks:
    """Prefill role: send blocks to a paired decode over its communicator."""

    call_id: int
    pair: str
    block_ids: list[int]
    tag: int = 0


@dataclass
class Pair:
    """Join a 2-rank communicator named `pair` (rank 0 = decode hosts the store)."""

    call_id: int
    pair: str
    rank: int
    store_host: str
    store_port: int
    backend: str
    local_host: str = ""  # this side's own reachable address (gloo binds its pair sockets there)
    peer_gpu_uuid: str = ""  # decode: the prefill's GPU from its Describe (a link to keep awake, if seen here)


@dataclass
class MapPeer:
    """Decode role: map a prefill's KV pool now (shm, cuda_ipc), not on its first pull."""

    call_id: int
    prefill_instance: str
    transport: str
    endpoint: dict[str, str]
    layout: Any


@dataclass
class Query:
    call_id: int
    what: str


@dataclass
class Shutdown:
    pass


# -- core → server -------------------------------------------------------------------------
@dataclass
class HeldKv:
    request_id: str
    block_ids: list[int]
    block_hashes: list[bytes]
    num_tokens: int


@dataclass
class StepBatch:
    outputs: list[RequestOutput]
    held: list[HeldKv] = field(default_factory=list)
    stats: dict[str, int] = field(default_factory=dict)
    step_ns: int = 0
    num_tokens: int = 0  # tokens the step computed (prompt and generated); 0 for a batch that is no step


@dataclass
class ImportDone:
    request_id: str
    ok: bool
    num_blocks_pulled: int = 0
    num_cached_tokens: int = 0
    num_bytes: int = 0
    transfer_ns: int = 0  # from the pull's start in the core to the loop turn that saw it end
    device_ns: int = 0  # the copy on the device (CUDA events), cuda_ipc only
    error: str | None = None
    # the core committed the import itself (its lease's slot said the copy is valid, or nothing was copied): the
    # request runs already, no CommitImport is wanted; the service records the pull and releases the lease
    committed: bool = False
    lease_lost: bool = False  # the lease's slot said the copy is not valid: the policy applies (CommitImport)
    ended_unix_ns: int = 0  # when the core saw the copy end (time.time_ns(); a committed one is reported later)


@dataclass
class NeedSend:
    """A decode receive is starting (on its transfer worker): the server must ask the prefill to send these
    blocks. Sent at once, not with the loop's next batch."""

    request_id: str
    pair: str
    block_indices: list[int]


@dataclass
class Reply:
    call_id: int
    value: Any = None
    error: str | None = None


@dataclass
class Ready:
    info: Any  # RuntimeInfo
    layout: Any  # KvLayout
    endpoint: dict[str, str]


@dataclass
class Fatal:
    message: str


@dataclass
class Heartbeat:
    """The core is alive: sent when it has sent nothing else for loop.HEARTBEAT_S (a step's outputs say so too),
    between steps by the loop, and during a long step by a thread of the core's with `in_step_s`, how long that
    step has run. A service that hears nothing for its --core-stall-timeout-s, or whose core has been in one step
    that long, takes its core as hung."""

    in_step_s: float = 0.0
