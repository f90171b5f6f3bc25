"""Lease validity in host shared memory: where the decode reads the prefill's pool itself (shm, cuda_ipc: same
host), its core checks a copy against this table as it sees the copy end, with no round trip to the prefill or to
its own service (a seqlock on the lease's epoch), and commits the import in the same loop turn.

    prefill service (writer, LeaseSlots)              decode core (reader, LeaseSlotReader: kv_scheduler.py)
    ────────────────────────────────────              ──────────────────────────────────────────────────────
    grant:    slot k <- lease epoch                   the copy ended (its worker reported; a device copy synchronized)
    release / expiry: slot k <- 0,                    read slot k: == epoch, before expiry -> valid: finish_import now
              THEN ReleaseHeld to the core            else the lease was lost: ImportDone says so, the decode service
              (the core unpins, may reuse)            applies the policy (recompute / fail)

Why a read after the copy suffices: a lease's slot holds its epoch from its grant (before any decode hears of
it) until the prefill clears it, and clearing comes before the core may free the blocks. Epochs only grow
within a table and a table is named per instance, start and process, so a cleared slot never shows that epoch
again: equal after the copy means equal during all of it, so no block was freed or reused under it.

A prefill killed (SIGKILL) clears nothing, and a CUDA pool dies with its process: slot 0 holds the owner's
heartbeat (Unix ns, written by a thread of its own every HEARTBEAT_S, so a busy event loop does not stop it), and
a table whose heartbeat is older than STALE_AFTER_S (the same host's clock) tells nothing. Nor does a slot 0 in a
handle (a full table, an nccl prefill). Then the core leaves the verdict to its service, which asks the prefill
(ReleaseKv): a dead one fails the call, and the policy decides. The lease's expiry is checked too.
"""

from __future__ import annotations

import logging
import mmap
import os
import threading
import time
from multiprocessing import shared_memory

from splitserve.engine.kv_connectors.shm_pool import segment_name, unlink_stale

log = logging.getLogger("splitserve.leases")

PREFIX = "splitserve-leases-"
SLOT_BYTES = 8  # one uint64 epoch per slot; an aligned 8-byte store and load are single accesses on x86-64
DEFAULT_NUM_SLOTS = 65536  # leases held at once; past it a lease gets slot 0 (validated by ReleaseKv)
HEARTBEAT_S = 0.1
STALE_AFTER_S = 1.0  # a heartbeat this old: the owner is gone or stopped (or starved past any use)


class LeaseSlots:
    """The prefill's table (owner): one slot per active lease holding its epoch, 0 when free. Owned by the
    service process's event loop; the table's name goes to decodes in every lease (`Lease.slots_name`)."""

    def __init__(
        self, instance: str, start_epoch: int, num_slots: int = DEFAULT_NUM_SLOTS, heartbeat_s: float = HEARTBEAT_S
    ) -> None:
        for stale in unlink_stale(instance, prefix=PREFIX):
            log.info("unlinked stale lease table %s", stale)
        self.name = segment_name(instance, start_epoch, prefix=PREFIX)
        self._shm = shared_memory.SharedMemory(name=self.name, create=True, size=num_slots * SLOT_BYTES)
        self._slots = self._shm.buf.cast("Q")  # zero-filled: every slot free
        self._free = list(range(num_slots - 1, 0, -1))  # pop() hands out 1, 2, ...; slot 0: the heartbeat
        self._slots[0] = time.time_ns()
        self._stopped = threading.Event()
        self._beat = threading.Thread(target=self._beat_until_closed, args=(heartbeat_s,), daemon=True)
        self._beat.name = "lease-heartbeat"
        self._beat.start()

    def _beat_until_closed(self, period_s: float) -> None:
        while not self._stopped.wait(period_s):
            self._slots[0] = time.time_ns()

    @property
    def num_free(self) -> int:
        return len(self._free)

    def take(self, epoch: int) -> int:
        """A free slot now holding `epoch`; 0 (no slot) when the table is full."""
        if not self._free:
            return 0
        slot = self._free.pop()
        self._slots[slot] = epoch
        return slot

    def clear(self, slot: int) -> None:
        """The lease in `slot` ends: cleared here before the caller lets the core free its blocks."""
        if slot:
            self._slots[slot] = 0
            self._free.append(slot)

    def close(self) -> None:
        self._stopped.set()
        self._beat.join()
        self._slots.release()
        self._shm.close()
        try:
            self._shm.unlink()
        except FileNotFoundError:
            pass


class LeaseSlotReader:
    """The decode's side: prefills' tables mapped read-only by name, one per prefill instance (a restarted
    prefill's new table replaces its old mapping)."""

    def __init__(self, stale_after_s: float = STALE_AFTER_S) -> None:
        self.stale_after_ns = int(stale_after_s * 1e9)
        self._tables: dict[str, tuple[mmap.mmap, memoryview]] = {}  # name -> (mapping, its slots)
        self._by_instance: dict[str, str] = {}  # prefill instance -> its current table's name

    def check(self, prefill_instance: str, lease) -> bool | None:
        """Whether `lease` (common_pb2.Lease) still holds, read now: True / False, or None when its prefill
        publishes no validity for it (slot 0, no table, a table that cannot be mapped, a stale heartbeat): ask the
        prefill."""
        if not lease.slot or not lease.slots_name:
            return None
        slots = self._slots(prefill_instance, lease.slots_name)
        if slots is None or lease.slot >= len(slots):
            return None
        held = slots[lease.slot] == lease.epoch  # read before the heartbeat: a beat seen after it covers it
        now_ns = time.time_ns()
        if now_ns - slots[0] > self.stale_after_ns:
            return None
        return held and now_ns < lease.expires_unix_ns

    def _slots(self, prefill_instance: str, name: str) -> memoryview | None:
        table = self._tables.get(name)
        if table is None:
            try:  # read-only and without Python's resource tracker: the prefill owns the segment
                fd = os.open(f"/dev/shm/{name}", os.O_RDONLY)
            except OSError as exc:  # gone with its prefill (a restart unlinks it)
                log.info("lease table %s of %s cannot be mapped: %s", name, prefill_instance, exc)
                return None
            try:
                mapped = mmap.mmap(fd, 0, prot=mmap.PROT_READ)
            finally:
                os.close(fd)
            table = self._tables[name] = (mapped, memoryview(mapped).cast("Q"))
            stale = self._by_instance.get(prefill_instance)
            if stale is not None and stale != name:
                self._unmap(stale)
            self._by_instance[prefill_instance] = name
        return table[1]

    def _unmap(self, name: str) -> None:
        mapped, slots = self._tables.pop(name)
        slots.release()
        mapped.close()

    def close(self) -> None:
        for name in list(self._tables):
            self._unmap(name)
        self._by_instance.clear()
