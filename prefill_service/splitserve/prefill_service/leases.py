"""Leases: a prefill's promise to keep a request's blocks until released or expired.

A lease is (lease_id, epoch, expiry). The epoch increases with every lease this
instance grants, so a handle from an earlier lease (or an earlier run: ids embed the
start time) can never name blocks that were freed and reused.

With a slot table (kv_connectors/lease_slots.py: shm, cuda_ipc), a lease's slot holds its epoch while it is
active; `release` and `pop_expired` clear it before they return, so before the caller sends the core the
message that frees the blocks.
"""

from __future__ import annotations

import itertools
import time
import uuid
from dataclasses import dataclass

from splitserve.engine.kv_connectors.lease_slots import LeaseSlots
from splitserve.protos import common_pb2


@dataclass
class Lease:
    lease_id: str
    epoch: int
    request_id: str
    block_ids: list[int]
    block_hashes: list[bytes]
    num_tokens: int
    expires_unix_ns: int
    slot: int = 0  # its slot in the table (0: none)


class LeaseTable:
    """Active leases of one prefill instance (owned by its server process); `slots` publishes which hold."""

    def __init__(self, lease_s: float, slots: LeaseSlots | None = None) -> None:
        self.lease_ns = int(lease_s * 1e9)
        self.slots = slots
        self._epochs = itertools.count(1)
        self.active: dict[str, Lease] = {}
        self.num_granted = 0

    def grant(
        self, request_id: str, block_ids: list[int], block_hashes: list[bytes], num_tokens: int, lease_ms: int = 0
    ) -> Lease:
        duration = lease_ms * 1_000_000 if lease_ms else self.lease_ns
        lease = Lease(
            uuid.uuid4().hex,
            next(self._epochs),
            request_id,
            block_ids,
            block_hashes,
            num_tokens,
            time.time_ns() + duration,
        )
        if self.slots is not None:
            lease.slot = self.slots.take(lease.epoch)
        self.active[lease.lease_id] = lease
        self.num_granted += 1
        return lease

    def to_proto(self, lease: Lease) -> common_pb2.Lease:
        """The lease as a KV handle carries it: where its slot is, when it has one."""
        return common_pb2.Lease(
            lease_id=lease.lease_id,
            epoch=lease.epoch,
            expires_unix_ns=lease.expires_unix_ns,
            slot=lease.slot,
            slots_name=self.slots.name if lease.slot and self.slots is not None else "",
        )

    def get(self, lease_id: str, epoch: int) -> Lease | None:
        lease = self.active.get(lease_id)
        return lease if lease is not None and lease.epoch == epoch else None

    def release(self, lease_id: str, epoch: int) -> Lease | None:
        lease = self.get(lease_id, epoch)
        if lease is not None:
            self._end(lease)
        return lease

    def pop_expired(self, now_ns: int | None = None) -> list[Lease]:
        now_ns = time.time_ns() if now_ns is None else now_ns
        expired = [lease for lease in self.active.values() if lease.expires_unix_ns <= now_ns]
        for lease in expired:
            self._end(lease)
        return expired

    def _end(self, lease: Lease) -> None:
        del self.active[lease.lease_id]
        if self.slots is not None:
            self.slots.clear(lease.slot)
