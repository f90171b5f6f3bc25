"""A mapped pull's validity without a round trip: the prefill's lease table (shared-memory slots) read by the
decode's PullCoordinator after the copy. A prefill that releases or expires the lease, then reuses its blocks, at
any point of the pull is never read as valid; a valid pull commits before ReleaseKv answers; every lease and slot
returns to baseline."""

import asyncio
import os
import time
import uuid
from types import SimpleNamespace

import pytest
import torch

from splitserve.decode_service.pulls import PendingPull
from splitserve.engine.core_process import messages as m
from splitserve.engine_service.lease_slots import LeaseSlotReader, LeaseSlots
from splitserve.prefill_service.leases import LeaseTable
from splitserve.protos import common_pb2, prefill_pb2
from tests.decode_service.test_decode_pulls import ENDPOINT, coordinator, wait_for
from tests.service_harness import wait_until

NUM_SLOTS = 8
BLOCKS = [2, 3, 5]  # the lease's blocks in the prefill's pool


class Prefill:
    """A prefill in this process: its lease table with a real slot table, a pool of 8 blocks (4 values each)
    and a core that reuses a lease's blocks once told to free them. ReleaseKv releases (answering only once
    `go` is set, when `hold` is on), as the prefill service does."""

    def __init__(self, hold: bool = False, heartbeat_s: float = 0.1) -> None:
        name = f"test-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.slots = LeaseSlots(name, time.time_ns(), NUM_SLOTS, heartbeat_s=heartbeat_s)
        self.table = LeaseTable(30.0, self.slots)
        self.pool = torch.arange(32, dtype=torch.float32).view(8, 4)
        self.go = asyncio.Event() if hold else None
        self.released: list[tuple[str, int]] = []

    def grant(self) -> common_pb2.KvHandle:
        lease = self.table.grant("r", BLOCKS, [], 12)
        return common_pb2.KvHandle(
            prefill_instance="p0",
            prefill_address="127.0.0.1:1",
            block_ids=BLOCKS,
            num_tokens=12,
            transport="shm",
            endpoint=ENDPOINT,
            lease=self.table.to_proto(lease),
        )

    def end(self, how: str, handle: common_pb2.KvHandle) -> None:
        """Release or expire the lease as the service does (the table first), then the core frees the blocks and
        a new prompt overwrites them."""
        if how == "release":
            ended = [self.table.release(handle.lease.lease_id, handle.lease.epoch)]
        else:
            ended = self.table.pop_expired(now_ns=handle.lease.expires_unix_ns)
        assert [lease.request_id for lease in ended] == ["r"]
        self.pool[BLOCKS] = -1.0  # reused

    async def ReleaseKv(self, request, timeout=None, wait_for_ready=None):
        if self.go is not None:
            await self.go.wait()
        self.released.append((request.lease_id, request.epoch))
        return prefill_pb2.ReleaseKvResponse(released=self.table.release(request.lease_id, request.epoch) is not None)

    def close(self) -> None:
        self.slots.close()


# the slot is read within the ImportDone's handling (no await between them): "after the copy" is the last point
POINTS = ("before the copy", "during the copy", "after the copy")


def pull(prefill: Prefill, end_at: str | None, how: str) -> tuple[list, torch.Tensor, object]:
    """One pull of the lease's blocks into a decode pool, block by block; the prefill ends the lease (`how`) at
    `end_at`. Returns (the core messages the coordinator sent, the decode pool, its counters)."""
    sent = []
    dst = torch.zeros(4, 4)

    async def main():
        pulls = coordinator(SimpleNamespace(send=sent.append, flush=lambda: None), kv_load_failure_policy="recompute")
        pulls.stub = lambda address: prefill
        handle = prefill.grant()
        pulls.pending["r"] = PendingPull("r", handle)
        for i, block in enumerate(BLOCKS):  # the copy (the core's worker; a device copy synchronized)
            if (i, end_at) in ((0, "before the copy"), (1, "during the copy")):
                prefill.end(how, handle)
            dst[i] = prefill.pool[block]
        if end_at == "after the copy":
            prefill.end(how, handle)
        pulls.on_core_message(m.ImportDone("r", ok=True, num_blocks_pulled=3, num_bytes=48))
        await wait_for(lambda: sent, 2.0, "the pull's commit")
        await asyncio.gather(*pulls._tasks)
        pulls.slots.close()
        return pulls.counters

    counters = asyncio.run(main())
    return sent, dst, counters


@pytest.mark.parametrize("how", ["release", "expire"])
@pytest.mark.parametrize("end_at", POINTS)
def test_a_lease_ended_at_any_point_of_the_pull_is_never_read_as_valid(end_at, how):
    prefill = Prefill()
    try:
        sent, _, counters = pull(prefill, end_at, how)
        assert [(c.request_id, c.ok, c.recompute) for c in sent] == [("r", False, True)]
        assert sent[0].error.endswith("was no longer valid after the copy")
        assert counters.values == {"kv_pull_recomputes": 1}
        assert prefill.released == []  # nothing left to release: the prefill ended it
        assert prefill.table.active == {} and prefill.slots.num_free == NUM_SLOTS - 1
    finally:
        prefill.close()


def test_a_valid_pull_commits_at_once_and_releases_after():
    prefill = Prefill()
    try:
        sent, dst, counters = pull(prefill, None, "release")
        assert [(c.request_id, c.ok) for c in sent] == [("r", True)]
        assert dst[:3].tolist() == [[8.0, 9.0, 10.0, 11.0], [12.0, 13.0, 14.0, 15.0], [20.0, 21.0, 22.0, 23.0]]
        assert counters.values["kv_blocks_pulled"] == 3 and "kv_pull_recomputes" not in counters.values
        assert len(prefill.released) == 1  # released on the side
        assert prefill.table.active == {} and prefill.slots.num_free == NUM_SLOTS - 1
    finally:
        prefill.close()


def test_a_valid_pull_is_committed_and_sent_within_its_import_done():
    """No event-loop turn between the core's ImportDone and the commit it waits for: the slot is read, the commit
    queued and the pipe flushed before on_core_message returns; a lease ended after that does not undo it."""
    events = []

    async def main():
        prefill = Prefill()
        try:
            client = SimpleNamespace(send=events.append, flush=lambda: events.append("flush"))
            pulls = coordinator(client)
            pulls.stub = lambda address: prefill
            handle = prefill.grant()
            pulls.pending["r"] = PendingPull("r", handle)
            pulls.on_core_message(m.ImportDone("r", ok=True, num_blocks_pulled=3, num_bytes=48))
            at_return = [e if e == "flush" else (e.request_id, e.ok) for e in events]
            prefill.end("release", handle)  # after the check: the copy was valid all through
            await asyncio.gather(*pulls._tasks)
            pulls.slots.close()
            return at_return, pulls.pending, pulls.counters.values["kv_blocks_pulled"]
        finally:
            prefill.close()

    at_return, pending, pulled = asyncio.run(main())
    assert at_return == [("r", True), "flush"] and pending == {} and pulled == 3
    assert len(events) == 2  # nothing more: no second verdict


def test_a_valid_pull_does_not_wait_for_a_held_release():
    """The prefill holds its ReleaseKv answer (a busy event loop): the request is committed meanwhile, and the
    lease is released once the held call goes through."""
    sent = []

    async def main():
        prefill = Prefill(hold=True)
        try:
            pulls = coordinator(SimpleNamespace(send=sent.append, flush=lambda: None))
            pulls.stub = lambda address: prefill
            handle = prefill.grant()
            pulls.pending["r"] = PendingPull("r", handle)
            pulls.on_core_message(m.ImportDone("r", ok=True, num_blocks_pulled=3, num_bytes=48))
            await wait_for(lambda: sent, 2.0, "the commit, while ReleaseKv is held")
            held = (list(prefill.table.active), list(prefill.released), prefill.slots.num_free)
            prefill.go.set()
            await asyncio.gather(*pulls._tasks)
            pulls.slots.close()
            after = (list(prefill.table.active), prefill.released, prefill.slots.num_free)
            return handle, held, after
        finally:
            prefill.close()

    handle, held, after = asyncio.run(main())
    assert [(c.request_id, c.ok) for c in sent] == [("r", True)]
    assert held == ([handle.lease.lease_id], [], NUM_SLOTS - 2)  # committed with the lease still held
    assert after == ([], [(handle.lease.lease_id, handle.lease.epoch)], NUM_SLOTS - 1)


def test_the_reader_asks_the_prefill_when_no_slot_says_and_refuses_lapsed_or_reused_slots():
    prefill = Prefill()
    reader = LeaseSlotReader()
    try:
        first = prefill.table.grant("a", [1], [], 4)
        lease = prefill.table.to_proto(first)
        assert (lease.slot, lease.slots_name) == (1, prefill.slots.name)
        assert reader.check("p0", lease) is True
        lapsed = common_pb2.Lease()
        lapsed.CopyFrom(lease)
        lapsed.expires_unix_ns = time.time_ns() - 1  # a prefill killed before it could clear its slot
        assert reader.check("p0", lapsed) is False
        prefill.table.release(first.lease_id, first.epoch)
        second = prefill.table.grant("b", [1], [], 4)  # the same slot, a later epoch
        assert second.slot == first.slot and second.epoch > first.epoch
        assert reader.check("p0", lease) is False and reader.check("p0", prefill.table.to_proto(second)) is True
        assert reader.check("p0", common_pb2.Lease(lease_id="x", epoch=1)) is None  # no slot published
        gone = common_pb2.Lease(lease_id="x", epoch=1, slot=1, slots_name="splitserve-leases-gone-1-p1")
        assert reader.check("p1", gone) is None  # a table that cannot be mapped: ReleaseKv decides
        for i in range(NUM_SLOTS - 2):
            prefill.table.grant(f"c{i}", [1], [], 4)
        full = prefill.table.grant("d", [1], [], 4)
        assert full.slot == 0 and prefill.table.to_proto(full).slots_name == ""  # a full table: no slot
        assert reader.check("p0", prefill.table.to_proto(full)) is None
    finally:
        reader.close()
        prefill.close()


def test_a_prefill_whose_heartbeat_stopped_tells_nothing():
    """A prefill killed before it could clear its slots (its CUDA pool gone with it) beats no more: its slots
    tell nothing once the heartbeat is older than the reader allows, and ReleaseKv decides."""
    prefill = Prefill(heartbeat_s=3600.0)  # one beat, at start: then silent, as a killed one
    lenient, strict = LeaseSlotReader(), LeaseSlotReader(stale_after_s=0.05)
    try:
        lease = prefill.table.to_proto(prefill.table.grant("a", [1], [], 4))
        assert lenient.check("p0", lease) is True
        wait_until(lambda: strict.check("p0", lease) is None, 2.0, "a silent prefill's slot should tell nothing")
    finally:
        lenient.close()
        strict.close()
        prefill.close()


def test_a_restarted_prefills_table_replaces_the_old_mapping():
    old, new = Prefill(), Prefill()
    reader = LeaseSlotReader()
    try:
        assert reader.check("p0", old.table.to_proto(old.table.grant("a", [1], [], 4))) is True
        assert reader.check("p0", new.table.to_proto(new.table.grant("a", [1], [], 4))) is True
        assert list(reader._tables) == [new.slots.name]  # the old table is unmapped
    finally:
        reader.close()
        old.close()
        new.close()


def test_the_prefill_clears_a_lease_slot_before_it_lets_its_core_free_the_blocks():
    """Released, expired, or left at stop: each time the slot reads invalid by the time the core is told."""
    from splitserve.prefill_service.server import PrefillService
    from splitserve.runtime.metrics import ServiceCounters

    prefill = Prefill()
    reader = LeaseSlotReader()
    service = object.__new__(PrefillService)  # its lease bookkeeping alone: no core, no server
    service.slots, service.leases, service.counters = prefill.slots, prefill.table, ServiceCounters()
    told = []
    service.client = SimpleNamespace(send=lambda msg: told.append((msg.request_id, reader.check("p0", lease))))
    try:
        granted = prefill.table.grant("released", [1], [], 4)
        lease = prefill.table.to_proto(granted)
        assert reader.check("p0", lease) is True
        assert service._release(granted.lease_id, granted.epoch) is True
        lease = prefill.table.to_proto(prefill.table.grant("expired", [1], [], 4, lease_ms=1))

        async def expire():
            task = asyncio.create_task(service._expire_leases())
            await wait_for(lambda: len(told) == 2, 2.0, "the expired lease's release")
            task.cancel()

        asyncio.run(expire())
        lease = prefill.table.to_proto(prefill.table.grant("left", [1], [], 4))
        asyncio.run(service.on_stopping())
        assert told == [("released", False), ("expired", False)] and reader.check("p0", lease) is False
        assert prefill.slots.num_free == NUM_SLOTS - 1 and list(prefill.table.active.values())[0].slot == 0
    finally:
        reader.close()
        prefill.close()
