"""What the whole gateway counts, however many processes it runs: requests in flight (max_concurrent_requests),
each caller's sequences in flight (its fair share, protos PrefillRequest.share) and the rate-limit buckets.

`LocalCounts` keeps them in this process (one gateway process, the default). `SharedCounts` keeps them in one
small file that every process of a gateway started with --api-server-count N maps (`gateway/processes.py` creates
it); each read-modify-write holds an exclusive `flock` on the file, a few microseconds, so the limits hold for the
gateway as a whole, exactly, never N times over. Its layout (little-endian):

    header   int64 requests in flight, int64 sequences in flight (every caller's)
    callers  share_slots x (uint64 caller key, int64 sequences): an open-addressing table (linear probing,
             backward-shift deletion). A caller's key is 8 bytes of blake2b of its name (never hash(), which
             differs per process). Only callers with a request in flight have a slot, so at most
             max_concurrent_requests do; the table has at least twice that many, and a probe always ends.
    buckets  one (float64 level, float64 stamp, int64 used) record per (client id, request | token bucket);
             used = 0 is a bucket never taken from: full. Stamps are time.monotonic(), one clock for every
             process of a machine.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import mmap
import os
import struct
from collections.abc import Iterator, Sequence

_HEADER = struct.Struct("<qq")
_ENTRY = struct.Struct("<Qq")
_BUCKET = struct.Struct("<ddq")
BUCKET_KINDS = ("requests", "tokens")


class LocalBucket:
    """A token bucket's state held in this process."""

    def __init__(self) -> None:
        self.level = 0.0
        self.stamp = 0.0
        self.used = False

    def locked(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()


class LocalCounts:
    """The gateway's counts in this one process (see the module docstring)."""

    def __init__(self) -> None:
        self.num_active = 0
        self.sequences_of: dict[str, int] = {}  # caller -> its sequences in flight

    def try_admit(self, limit: int) -> int:
        """Count one more request in flight if fewer than `limit` are; -1 when admitted, else how many run."""
        if self.num_active >= limit:
            return self.num_active
        self.num_active += 1
        return -1

    def release(self) -> None:
        self.num_active -= 1

    def add_sequences(self, caller: str, num_sequences: int) -> int:
        """`num_sequences` more (or fewer) in flight for `caller`; its count now."""
        count = self.sequences_of.get(caller, 0) + num_sequences
        if count:
            self.sequences_of[caller] = count
        else:
            del self.sequences_of[caller]
        return count

    def waiting_ahead(self, share: int, num_waiting: int) -> int:
        """Of `num_waiting` requests waiting at a decode, at most how many a request of `share` waits behind: each
        caller's up to that share (the decodes run lower shares first, and one caller's in order), and every one
        this gateway does not account for (another gateway's, of any share)."""
        counts = self.sequences_of.values()
        unknown = max(num_waiting - sum(counts), 0)
        return sum(min(count, share) for count in counts) + unknown

    def num_callers(self) -> int:
        return len(self.sequences_of)

    def bucket(self, kind: str, client_id: str) -> LocalBucket:
        return LocalBucket()


def caller_key(caller: str) -> int:
    """A caller's 64-bit key in the shared table (never 0, which marks an empty slot)."""
    return (
        int.from_bytes(hashlib.blake2b(caller.encode("utf-8", "surrogatepass"), digest_size=8).digest(), "little") or 1
    )


def share_slots_for(max_concurrent_requests: int) -> int:
    """The callers table's size: a power of two, at least twice the callers that can have a request in flight."""
    return 1 << max(4, (2 * max_concurrent_requests - 1).bit_length())


def counts_file_size(share_slots: int, client_ids: Sequence[str]) -> int:
    return _HEADER.size + share_slots * _ENTRY.size + len(client_ids) * len(BUCKET_KINDS) * _BUCKET.size


class SharedBucket:
    """A token bucket's state in the shared file (LocalBucket's fields, read and written in place)."""

    def __init__(self, counts: SharedCounts, offset: int) -> None:
        self._counts, self._offset = counts, offset

    def locked(self) -> contextlib.AbstractContextManager:
        return self._counts.locked()

    def _fields(self) -> tuple[float, float, int]:
        return _BUCKET.unpack_from(self._counts.map, self._offset)

    def _set(self, index: int, value: float | int) -> None:
        fields = list(self._fields())
        fields[index] = value
        _BUCKET.pack_into(self._counts.map, self._offset, *fields)

    level = property(lambda self: self._fields()[0], lambda self, v: self._set(0, v))
    stamp = property(lambda self: self._fields()[1], lambda self, v: self._set(1, v))
    used = property(lambda self: bool(self._fields()[2]), lambda self, v: self._set(2, int(v)))


class SharedCounts:
    """The gateway's counts in a file every one of its processes maps (see the module docstring).

    `client_ids`: every client id a rate limit can be charged to, in the same order in every process."""

    def __init__(self, path: str, share_slots: int, client_ids: Sequence[str]) -> None:
        if share_slots & (share_slots - 1):
            raise ValueError(f"share_slots must be a power of two, got {share_slots}")
        self._fd = os.open(path, os.O_RDWR)
        size = counts_file_size(share_slots, client_ids)
        if os.fstat(self._fd).st_size < size:
            raise ValueError(f"{path} holds {os.fstat(self._fd).st_size} bytes, less than the {size} its layout needs")
        self.map = mmap.mmap(self._fd, size)
        self._mask = share_slots - 1
        self._buckets_at = _HEADER.size + share_slots * _ENTRY.size
        pairs = [(kind, client_id) for client_id in client_ids for kind in BUCKET_KINDS]
        self._bucket_index = {pair: i for i, pair in enumerate(pairs)}

    @staticmethod
    def create(path: str, share_slots: int, client_ids: Sequence[str]) -> None:
        """A new file of zeros (nothing in flight, every bucket full) at `path`."""
        with open(path, "xb") as f:
            f.truncate(counts_file_size(share_slots, client_ids))

    def close(self) -> None:
        self.map.close()
        os.close(self._fd)

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)

    # -- requests in flight ---------------------------------------------------------------------

    def try_admit(self, limit: int) -> int:
        with self.locked():
            num_active, num_sequences = _HEADER.unpack_from(self.map, 0)
            if num_active >= limit:
                return num_active
            _HEADER.pack_into(self.map, 0, num_active + 1, num_sequences)
        return -1

    def release(self) -> None:
        with self.locked():
            num_active, num_sequences = _HEADER.unpack_from(self.map, 0)
            _HEADER.pack_into(self.map, 0, num_active - 1, num_sequences)

    @property
    def num_active(self) -> int:
        return _HEADER.unpack_from(self.map, 0)[0]

    # -- callers' sequences in flight -----------------------------------------------------------

    def _entry(self, slot: int) -> tuple[int, int]:
        return _ENTRY.unpack_from(self.map, _HEADER.size + slot * _ENTRY.size)

    def _put(self, slot: int, key: int, count: int) -> None:
        _ENTRY.pack_into(self.map, _HEADER.size + slot * _ENTRY.size, key, count)

    def add_sequences(self, caller: str, num_sequences: int) -> int:
        key = caller_key(caller)
        with self.locked():
            slot = key & self._mask
            while True:
                found, count = self._entry(slot)
                if found in (key, 0):
                    break
                slot = (slot + 1) & self._mask
            count = (count if found else 0) + num_sequences
            if count:
                self._put(slot, key, count)
            else:
                self._delete(slot)
            num_active, total = _HEADER.unpack_from(self.map, 0)
            _HEADER.pack_into(self.map, 0, num_active, total + num_sequences)
        return count

    def _delete(self, hole: int) -> None:
        """Empty `hole`, moving back every later entry of its probe run that may not sit past a hole."""
        slot = hole
        while True:
            slot = (slot + 1) & self._mask
            key, count = self._entry(slot)
            if not key:
                break
            home = key & self._mask
            # the entry may move into the hole unless its home lies cyclically in (hole, slot]
            if (slot - home) & self._mask >= (slot - hole) & self._mask:
                self._put(hole, key, count)
                hole = slot
        self._put(hole, 0, 0)

    def _counts(self) -> list[int]:
        table = self.map[_HEADER.size : self._buckets_at]
        return [count for key, count in _ENTRY.iter_unpack(table) if key]

    def waiting_ahead(self, share: int, num_waiting: int) -> int:
        with self.locked():
            counts, total = self._counts(), _HEADER.unpack_from(self.map, 0)[1]
        return sum(min(count, share) for count in counts) + max(num_waiting - total, 0)

    def num_callers(self) -> int:
        with self.locked():
            return len(self._counts())

    # -- rate-limit buckets ---------------------------------------------------------------------

    def bucket(self, kind: str, client_id: str) -> SharedBucket | LocalBucket:
        """The shared state of `client_id`'s `kind` bucket; a client id the parent did not list (an API keys
        file changed between the parent's start and this process's) gets a bucket of this process alone."""
        index = self._bucket_index.get((kind, client_id))
        if index is None:
            return LocalBucket()
        return SharedBucket(self, self._buckets_at + index * _BUCKET.size)
