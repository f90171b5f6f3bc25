"""Every transition of a prefill's asynchronous send (the nccl transport's prefill side; gloo on CPU): the core
loop pins the lease's blocks, a lane worker sends, the loop prefills on meanwhile, and the Reply comes from a later
turn. Exact replies and exact block accounting (the prefill pool's free blocks) in each:

    SendBlocks ─▶ pin (blocks not held: Reply(error) at once, nothing pinned)
               ─▶ lane worker sends ─▶ ended: unpin, Reply(result) | Reply(error)
                                    └▶ past its deadline: Reply(error) now; blocks pinned until the send ends
    sends to one pair run one after another, in the order they came (NCCL matches them by order alone)

The lease is the prefill engine's held request (`ReleaseHeld` is what the service sends when it ends).
"""

# ruff: noqa: F811 -- the fixtures (model, device) are test_core_loop's, imported by name
import threading

import pytest

from splitserve.engine.core_process import messages as m
from splitserve.engine.kv_connectors.base import KvConnector
from tests.engine.test_core_loop import GREEDY, Driver, Gate, device, engine_core, model, num_prompt_blocks  # noqa: F401


class GatedSends(KvConnector):
    """A prefill's connector whose sends pass their pair's gate (`gates[pair]`), then raise `fail` or answer what a
    send reports; `order` notes each send as it starts."""

    transport = "test-send"

    def __init__(self, gates: dict[str, Gate], fail: Exception | None = None) -> None:
        super().__init__({"timeout_s": 5.0, "role": "prefill"})
        self.gates, self.fail = gates, fail
        self.order: list[int] = []
        self._lock = threading.Lock()

    def send(self, pair, block_ids, kv_cache, tag=0):
        with self._lock:
            self.order.append(tag)

        def then():
            if self.fail is not None:
                raise self.fail
            return {"num_bytes": len(block_ids), "transfer_ns": 1, "device_ns": 0}

        return self.gates[f"{pair}:{tag}"].pass_through(then)


@pytest.fixture
def start_prefill(model, device):
    """`start_prefill(connector)` -> a Driver around a CoreLoop on a fresh prefill engine; stopped at the end."""
    drivers = []

    def start(connector: "GatedSends") -> Driver:
        engine = engine_core(model, device, "prefill")
        d = Driver(engine, connector)
        d.baseline = engine.num_free_blocks
        drivers.append(d)
        return d.start()

    yield start
    for d in drivers:
        for gate in d.loop.connector.gates.values():
            gate.gate.set()  # a test that failed may have left a send waiting
        if d.thread.is_alive():
            d.stop()


def held(d: Driver, rid: str, prompt: list[int]) -> list[int]:
    """Prefill `rid` on the running loop; its held (leased) block ids."""
    d.send(m.AddRequest(rid, prompt, GREEDY))
    d.until(lambda: rid in d.finished, 10, f"{rid} was not prefilled")
    return next(h for b in d.received if isinstance(b, m.StepBatch) for h in b.held if h.request_id == rid).block_ids


def free(d: Driver) -> int:
    return d.stats()["num_free_blocks"]


def test_a_send_that_fails_answers_the_error_and_unpins_its_blocks_the_lease_keeps_them(model, start_prefill):
    _, prompts, _ = model
    gate = Gate()
    d = start_prefill(GatedSends({"p->d:1": gate}, fail=RuntimeError("injected: peer gone")))
    blocks = held(d, "x", prompts[0])
    d.send(m.SendBlocks(7, "p->d", blocks, tag=1))
    d.until(lambda: gate.entered.is_set(), 10, "the send never started")
    assert free(d) == d.baseline - len(blocks) and 7 not in d.replies
    gate.gate.set()
    reply = d.until(lambda: d.replies.get(7), 10, "no reply to the send")
    assert (reply.value, reply.error) == (None, "send to p->d failed: injected: peer gone")
    assert free(d) == d.baseline - len(blocks)  # unpinned; the lease still holds them
    d.send(m.ReleaseHeld("x"))
    d.until(lambda: free(d) == d.baseline, 10, "the lease's blocks were never freed")


def test_a_send_past_its_deadline_is_answered_failed_and_keeps_its_blocks_until_it_ends(model, device, start_prefill):
    """The lease ends while the late send still reads its blocks: they come back only when the send ends."""
    _, prompts, greedy = model
    gate = Gate()
    d = start_prefill(GatedSends({"p->d:1": gate}))
    d.loop.connector.deadline_s = 0.3
    blocks = held(d, "x", prompts[1])
    d.send(m.SendBlocks(7, "p->d", blocks, tag=1))
    reply = d.until(lambda: d.replies.get(7), 10, "no reply to the send")
    assert gate.entered.is_set() and not gate.ended.is_set()
    assert (reply.value, reply.error) == (
        None,
        "send to p->d failed: the transfer did not end within 0.3 s (its blocks stay held until it does)",
    )
    d.send(m.ReleaseHeld("x"), m.AddRequest("y", prompts[2], GREEDY))  # the lease ends; the prefill works on
    d.until(lambda: "y" in d.finished, 10, "y was not prefilled beside the late send")
    assert d.tokens["y"] == greedy[2][:1]
    assert free(d) == d.baseline - len(blocks) - num_prompt_blocks(prompts[2], device)  # x's: pinned by the send
    gate.gate.set()
    d.send(m.ReleaseHeld("y"))
    d.until(lambda: free(d) == d.baseline, 10, "the late send's blocks were never freed")
    assert len([r for r in d.received if isinstance(r, m.Reply) and r.call_id == 7]) == 1  # answered once


def test_a_send_of_blocks_no_lease_holds_is_refused_and_pins_nothing(model, start_prefill):
    _, prompts, _ = model
    gate = Gate(opened=True)
    d = start_prefill(GatedSends({"p->d:1": gate}))
    blocks = held(d, "x", prompts[0])
    d.send(m.ReleaseHeld("x"))
    d.until(lambda: free(d) == d.baseline, 10, "the lease's blocks were never freed")
    d.send(m.SendBlocks(7, "p->d", blocks, tag=1))  # a SendKv that crossed the lease's end
    reply = d.until(lambda: d.replies.get(7), 10, "no reply to the send")
    assert reply.error == (
        f"send to p->d failed: block {blocks[0]} is not held by any request (pool of {d.baseline}); "
        "a transfer pins only blocks in use"
    )
    assert not gate.entered.is_set() and free(d) == d.baseline


def test_sends_to_one_pair_run_in_the_order_they_came_and_other_pairs_do_not_wait(model, start_prefill):
    _, prompts, _ = model
    gates = {"p->d:1": Gate(), "p->d:2": Gate(opened=True), "p->e:3": Gate(opened=True)}
    d = start_prefill(GatedSends(gates))
    x, y = held(d, "x", prompts[0]), held(d, "y", prompts[1])
    d.send(m.SendBlocks(1, "p->d", x, tag=1), m.SendBlocks(2, "p->d", y, tag=2), m.SendBlocks(3, "p->e", y, tag=3))
    d.until(lambda: d.replies.get(3), 10, "the other pair's send waited")
    order = d.loop.connector.order
    assert sorted(order) == [1, 3] and 1 not in d.replies and 2 not in d.replies  # p->d's second waits its turn
    gates["p->d:1"].gate.set()
    d.until(lambda: 1 in d.replies and 2 in d.replies, 10, "the pair's sends were not answered")
    assert sorted(order) == [1, 2, 3] and order.index(1) < order.index(2)
    d.send(m.ReleaseHeld("x"), m.ReleaseHeld("y"))
    d.until(lambda: free(d) == d.baseline, 10, "blocks still held after the sends")
