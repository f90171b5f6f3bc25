"""A decode core commits a pull by itself where its lease's slot (the prefill's shared-memory table,
kv_connectors/lease_slots.py) says the copy is valid: the request runs in the loop turn that sees the copy end, with
no CommitImport from the service. A lease released, expired, or whose slot holds a later lease by the time the core
reads it is never committed: the core reports it lost (ImportDone.lease_lost) and the request waits for the service's
verdict; under policy recompute it prefills the prompt itself, so the tokens are exact even when the prefill reused
the blocks under the copy. An import whose every block is cached here reads nothing of the prefill's and runs at once.

Real decode engine on a thread, the transport's real connector gated (test_core_loop's fixtures); the prefill's
lease table is a real slot table in this process. Block counts are the decode pool's free blocks."""

# ruff: noqa: F811 -- the fixtures (model, prefill, decode, device) are test_core_loop's, imported by name
import itertools
import os
import time
import uuid

import pytest

from splitserve.engine.core_process import messages as m
from splitserve.engine.kv_connectors.lease_slots import LeaseSlots
from tests.engine.test_core_loop import (  # noqa: F401 (fixtures)
    ENGINES,
    Gate,
    decode,
    device,
    model,
    num_prompt_blocks,
    prefill,
    prefilled,
)
from tests.engine.test_kv_load_states import counts
from tests.service_harness import wait_until


class Leases:
    """The prefill service's side of lease slots, for the module's prefill engine: a slot per lease holding its
    epoch (epochs only grow), cleared when the lease ends."""

    def __init__(self) -> None:
        self.slots = LeaseSlots(f"lease-commit-{os.getpid()}-{uuid.uuid4().hex[:8]}", time.time_ns(), num_slots=8)
        self.epochs = itertools.count(1)

    def grant(self, x: m.ImportKv, lease_s: float = 30.0) -> m.ImportKv:
        """`x` (a prefilled ImportKv) with its lease's slot, as a decode service passes it to its core."""
        epoch = next(self.epochs)
        slot = self.slots.take(epoch)
        x.spec.lease = m.LeaseRef(self.slots.name, slot, epoch, time.time_ns() + int(lease_s * 1e9))
        return x


@pytest.fixture
def leases():
    table = Leases()
    yield table
    table.slots.close()


def reuse_blocks(prefill, x: m.ImportKv) -> None:
    """The prefill frees x's blocks (its lease ended) and a later prompt overwrites them; no prompt of later tests
    may find them in its prefix cache."""
    engine = prefill[0]
    assert engine.release_kv(x.request_id)
    engine.runner.kv_cache[x.spec.block_ids] = 7.0
    assert engine.pool.reset_prefix_cache() >= len(x.spec.block_ids) - 1  # the full blocks were cached


def test_a_pull_whose_lease_holds_is_committed_by_the_core_and_stepped_in_the_same_turn(
    model, prefill, decode, device, leases
):
    _, prompts, greedy = model
    gate = Gate()
    d = decode(gate)
    x = leases.grant(prefilled(prefill, "x", prompts[2]))
    n = num_prompt_blocks(prompts[2], device)
    d.send(x)
    d.until(lambda: gate.entered.is_set(), 10, "the pull never started")
    assert counts(d) == (d.baseline - n, 1, 0)
    gate.gate.set()
    d.until(lambda: "x" in d.finished, 30, "x never finished, with no CommitImport sent")
    (done,) = d.done["x"]
    assert (done.ok, done.committed, done.lease_lost, done.num_blocks_pulled) == (True, True, False, n)
    assert [x.first_token_id, *d.tokens["x"]] == greedy[2] and d.finished["x"].finish_reason == "length"
    after = d.received[d.received.index(done) + 1]  # the same turn's step: x's first decoded token
    assert [(out.request_id, len(out.new_token_ids)) for out in after.outputs] == [("x", 1)]
    assert "x" in prefill[0].held  # it ran while the prefill still held the lease: no ReleaseKv awaited
    assert counts(d) == (d.baseline, 0, 0)


@pytest.mark.parametrize("how", ["released", "expired", "slot taken by a later lease"])
@pytest.mark.parametrize("when", ["before the copy", "during the copy"])
def test_a_pull_whose_lease_ends_around_the_copy_is_never_decoded_from_the_copied_blocks(
    model, prefill, decode, device, leases, when, how
):
    _, prompts, greedy = model
    gate = Gate()
    d = decode(gate)
    x = leases.grant(prefilled(prefill, "x", prompts[1]), lease_s=0.05 if how == "expired" else 30.0)
    lease = x.spec.lease
    n = num_prompt_blocks(prompts[1], device)

    def end_lease():
        if how == "expired":  # its slot not cleared yet: the expiry alone voids it
            wait_until(lambda: time.time_ns() > lease.expires_unix_ns, 5, "the lease never expired")
        else:
            leases.slots.clear(lease.slot)
            if how == "slot taken by a later lease":
                assert leases.slots.take(next(leases.epochs)) == lease.slot
        reuse_blocks(prefill, x)

    if when == "before the copy":
        end_lease()
    d.send(x)
    d.until(lambda: gate.entered.is_set(), 10, "the pull never started")
    if when == "during the copy":
        end_lease()
    gate.gate.set()  # the copy now reads the overwritten blocks
    (done,) = d.until(lambda: d.done.get("x"), 10, "no ImportDone")
    assert (done.ok, done.committed, done.lease_lost, done.num_blocks_pulled) == (True, False, True, n)
    assert counts(d) == (d.baseline - n, 1, 0) and d.tokens["x"] == []  # waiting for the service's verdict
    d.send(m.CommitImport("x", ok=False, recompute=True))  # what the service sends for a lost lease
    d.until(lambda: "x" in d.finished, 30, "x never finished")
    assert [x.first_token_id, *d.tokens["x"]] == greedy[1] and d.finished["x"].finish_reason == "length"
    assert counts(d) == (d.baseline, 0, 0) and len(d.done["x"]) == 1


def test_the_overwritten_blocks_would_change_the_tokens(model, prefill, decode, device, leases):
    """The check above is not vacuous: a copy of the reused blocks, committed anyway, decodes other tokens."""
    _, prompts, greedy = model
    d = decode(Gate(opened=True))
    x = prefilled(prefill, "x", prompts[1])  # no lease slot: the service's verdict, here a wrong one
    reuse_blocks(prefill, x)
    d.send(x)
    (done,) = d.until(lambda: d.done.get("x"), 10, "no ImportDone")
    assert (done.committed, done.lease_lost) == (False, False)
    d.send(m.CommitImport("x", ok=True))
    d.until(lambda: "x" in d.finished, 30, "x never finished")
    assert [x.first_token_id, *d.tokens["x"]] != greedy[1]
    assert counts(d) == (d.baseline, 0, 0)


def test_an_import_whose_every_block_is_cached_here_runs_at_once_whatever_its_lease(
    model, prefill, decode, device, leases
):
    _, prompts, _ = model
    block_size = ENGINES[device]["block_size"]
    prompt = prompts[0][: len(prompts[0]) // block_size * block_size]  # full blocks only: all of them cacheable
    d = decode(Gate(opened=True))
    x = leases.grant(prefilled(prefill, "x", prompt))
    d.send(x)
    d.until(lambda: "x" in d.finished, 30, "x never finished")
    y = leases.grant(prefilled(prefill, "y", prompt))
    leases.slots.clear(y.spec.lease.slot)  # ended: but nothing of the prefill's is read
    d.send(y)
    d.until(lambda: "y" in d.finished, 30, "y never finished")
    (done,) = d.done["y"]
    assert (done.committed, done.num_blocks_pulled, done.num_cached_tokens) == (True, 0, len(prompt))
    assert [y.first_token_id, *d.tokens["y"]] == [x.first_token_id, *d.tokens["x"]]
    assert d.finished["y"].finish_reason == "length"
    assert counts(d) == (d.baseline, 0, 0)
