"""Leases: a prefill's promise to keep a request's blocks until released or expired.

A lease is (lease_id, epoch, expiry). The epoch increases with every lease this
instance grants, so a handle from an earlier lease (or an earlier run: ids embed the
start time) can never name blocks that were freed and reused.
"""

from __future__ import annotations

import itertools
import time
import uuid
from dataclasses import dataclass


@dataclass
class Lease:
    lease_id: str
    epoch: int
    request_id: str
    block_ids: list[int]
    block_hashes: list[bytes]
    num_tokens: int
    expires_unix_ns: int


class LeaseTable:
    """Active leases of one prefill instance (owned by its server process)."""

    def __init__(self, lease_s: float) -> None:
        self.lease_ns = int(lease_s * 1e9)
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
        self.active[lease.lease_id] = lease
        self.num_granted += 1
        return lease

    def get(self, lease_id: str, epoch: int) -> Lease | None:
        lease = self.active.get(lease_id)
        return lease if lease is not None and lease.epoch == epoch else None

    def release(self, lease_id: str, epoch: int) -> Lease | None:
        lease = self.get(lease_id, epoch)
        if lease is not None:
            del self.active[lease_id]
        return lease

    def pop_expired(self, now_ns: int | None = None) -> list[Lease]:
        now_ns = time.time_ns() if now_ns is None else now_ns
        expired = [lease for lease in self.active.values() if lease.expires_unix_ns <= now_ns]
        for lease in expired:
            del self.active[lease.lease_id]
        return expired
