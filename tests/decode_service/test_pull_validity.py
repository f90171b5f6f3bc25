"""A mapped pull's validity without a round trip: the prefill's lease table (shared-memory slots), named in the
handle, passed to the decode's core (`lease_ref`), read by the core after the copy (`KvScheduler.lease_held`); the
decode's PullCoordinator acts on the core's verdict. A prefill that releases or expires the lease, then reuses its
blocks, at any point of the pull is never read as valid; a valid pull is committed by the core, and the service
sends no commit and releases the lease after, never waiting for it; every lease and slot returns to baseline."""

import asyncio
import os
import time
import uuid
from types import SimpleNamespace

import pytest
import torch

from splitserve.decode_service.pulls import PendingPull, PullHooks, lease_ref
from splitserve.engine.core_process import messages as m
from splitserve.engine.core_process.kv_scheduler import KvScheduler
from splitserve.engine.kv_connectors.lease_slots import LeaseSlotReader, LeaseSlots
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


POINTS = ("before the copy", "during the copy", "after the copy")  # "after": before the core reads the slot


def spec_of(handle: common_pb2.KvHandle) -> m.PullSpec:
    """The PullSpec a decode service's ImportKv carries for `handle` (the fields the lease check reads)."""
    return m.PullSpec(
        handle.transport,
        handle.prefill_instance,
        ENDPOINT,
        list(handle.block_ids),
        [],
        12,
        None,
        request_id="r",
        lease=lease_ref(handle),
    )


def core_check(spec: m.PullSpec) -> bool | None:
    """The decode core's read of the lease after the copy (its KV scheduler, with nothing else of a core)."""
    kv = KvScheduler(engine=None, connector=None, emit=None, send_now=None)
    try:
        return kv.lease_held(spec)
    finally:
        kv.close()


def import_done(held: bool | None) -> m.ImportDone:
    """What the core reports for the ended copy given its read of the lease."""
    return m.ImportDone(
        "r", ok=True, num_blocks_pulled=3, num_bytes=48, committed=held is True, lease_lost=held is False
    )


def pull(prefill: Prefill, end_at: str | None, how: str) -> tuple[bool | None, list, torch.Tensor, object]:
    """One pull of the lease's blocks into a decode pool, block by block; the prefill ends the lease (`how`) at
    `end_at`; the core reads the slot; the coordinator acts on the core's ImportDone. Returns (the core's read, the
    core messages the coordinator sent, the decode pool, its counters)."""
    sent = []
    dst = torch.zeros(4, 4)

    async def main():
        pulls = coordinator(SimpleNamespace(send=sent.append, flush=lambda: None), kv_load_failure_policy="recompute")
        pulls.stub = lambda address: prefill
        handle = prefill.grant()
        spec = spec_of(handle)
        pulls.pending["r"] = PendingPull("r", handle)
        for i, block in enumerate(BLOCKS):  # the copy (the core's worker; a device copy synchronized)
            if (i, end_at) in ((0, "before the copy"), (1, "during the copy")):
                prefill.end(how, handle)
            dst[i] = prefill.pool[block]
        if end_at == "after the copy":
            prefill.end(how, handle)
        held = core_check(spec)
        pulls.on_core_message(import_done(held))
        await asyncio.gather(*pulls._tasks)
        return held, pulls.counters

    held, counters = asyncio.run(main())
    return held, sent, dst, counters


@pytest.mark.parametrize("how", ["release", "expire"])
@pytest.mark.parametrize("end_at", POINTS)
def test_a_lease_ended_at_any_point_of_the_pull_is_never_read_as_valid(end_at, how):
    prefill = Prefill()
    try:
        held, sent, _, counters = pull(prefill, end_at, how)
        assert held is False  # lost: the core does not commit
        assert [(c.request_id, c.ok, c.recompute) for c in sent] == [("r", False, True)]
        assert sent[0].error.endswith("was no longer valid after the copy")
        assert counters.values == {"kv_pull_recomputes": 1}
        assert prefill.released == []  # nothing left to release: the prefill ended it
        assert prefill.table.active == {} and prefill.slots.num_free == NUM_SLOTS - 1
    finally:
        prefill.close()


def test_a_valid_pull_is_committed_by_the_core_and_the_service_only_releases_after():
    prefill = Prefill()
    try:
        held, sent, dst, counters = pull(prefill, None, "release")
        assert held is True and sent == []  # the core runs it already: no CommitImport
        assert dst[:3].tolist() == [[8.0, 9.0, 10.0, 11.0], [12.0, 13.0, 14.0, 15.0], [20.0, 21.0, 22.0, 23.0]]
        assert counters.values["kv_blocks_pulled"] == 3 and "kv_pull_recomputes" not in counters.values
        assert len(prefill.released) == 1  # released on the side
        assert prefill.table.active == {} and prefill.slots.num_free == NUM_SLOTS - 1
    finally:
        prefill.close()


def test_a_committed_pull_is_reported_within_its_import_done_and_sends_the_core_nothing():
    """The service learns of the core's commit with the first step's outputs (the same batch, after the ImportDone):
    what the first delta reports is noted before on_core_message returns; the counters and the lease's release
    follow once that delta is on its way (a turn later), and nothing goes back to the core."""
    events, imported = [], []

    async def main():
        prefill = Prefill()
        try:
            pulls = coordinator(SimpleNamespace(send=events.append, flush=lambda: events.append("flush")))
            pulls.hooks = PullHooks(
                span_of=lambda rid: None,
                on_imported=lambda rid, cached, pulled: imported.append((rid, cached, pulled)),
                fail_request=lambda rid, reason: None,
            )
            pulls.stub = lambda address: prefill
            pulls.pending["r"] = PendingPull("r", prefill.grant())
            pulls.on_core_message(import_done(True))
            at_return = (list(imported), dict(pulls.pending), dict(pulls.counters.values), list(prefill.released))
            await asyncio.sleep(0)  # the stream's turn (it would send the first delta): still nothing released
            after_one_turn = (dict(pulls.counters.values), list(prefill.released))
            await asyncio.gather(*pulls._tasks)
            return at_return, after_one_turn, pulls.counters.values, prefill.released
        finally:
            prefill.close()

    at_return, after_one_turn, counters, released = asyncio.run(main())
    assert at_return == ([("r", 0, 3)], {}, {}, []) and after_one_turn == ({}, [])
    assert counters["kv_blocks_pulled"] == 3 and counters["kv_bytes_pulled"] == 48 and len(released) == 1
    assert events == []


def test_a_valid_pull_does_not_wait_for_a_held_release():
    """The prefill holds its ReleaseKv answer (a busy event loop): the core committed the request meanwhile, and the
    lease is released once the held call goes through."""
    sent = []

    async def main():
        prefill = Prefill(hold=True)
        try:
            pulls = coordinator(SimpleNamespace(send=sent.append, flush=lambda: None))
            pulls.stub = lambda address: prefill
            handle = prefill.grant()
            pulls.pending["r"] = PendingPull("r", handle)
            held = core_check(spec_of(handle))
            pulls.on_core_message(import_done(held))
            await wait_for(lambda: pulls._tasks, 2.0, "the ReleaseKv call, held")
            for _ in range(20):  # the coordinator's tasks get turns while the prefill has not answered
                await asyncio.sleep(0)
            before = (held, list(sent), list(prefill.table.active), list(prefill.released), prefill.slots.num_free)
            prefill.go.set()
            await asyncio.gather(*pulls._tasks)
            after = (list(prefill.table.active), prefill.released, prefill.slots.num_free)
            return handle, before, after
        finally:
            prefill.close()

    handle, before, after = asyncio.run(main())
    assert before == (True, [], [handle.lease.lease_id], [], NUM_SLOTS - 2)  # committed with the lease still held
    assert after == ([], [(handle.lease.lease_id, handle.lease.epoch)], NUM_SLOTS - 1)


def test_only_a_mapped_pull_with_a_published_slot_is_checked_by_the_core():
    """shm and cuda_ipc handles with a slot carry it to the core; an nccl or nixl handle, or a lease without a slot
    (a full table), carries none: the core leaves the verdict to its service (SendKv's or ReleaseKv's answer)."""
    prefill = Prefill()
    try:
        handle = prefill.grant()
        ref = lease_ref(handle)
        assert (ref.slots_name, ref.slot, ref.epoch) == (prefill.slots.name, 1, handle.lease.epoch)
        assert ref.expires_unix_ns == handle.lease.expires_unix_ns
        assert core_check(spec_of(handle)) is True
        for transport in ("nccl", "nixl"):
            other = common_pb2.KvHandle()
            other.CopyFrom(handle)
            other.transport = transport
            assert lease_ref(other) is None and core_check(spec_of(other)) is None
        cuda = common_pb2.KvHandle()
        cuda.CopyFrom(handle)
        cuda.transport = "cuda_ipc"
        assert lease_ref(cuda) == ref
        no_slot = common_pb2.KvHandle()
        no_slot.CopyFrom(handle)
        no_slot.lease.slot = 0
        assert lease_ref(no_slot) is None and core_check(spec_of(no_slot)) is None
        forged = m.PullSpec("nccl", "p0", ENDPOINT, BLOCKS, [], 12, None, lease=ref)  # a slot beside a sender
        assert core_check(forged) is None
    finally:
        prefill.close()


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
