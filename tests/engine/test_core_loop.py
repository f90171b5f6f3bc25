"""CoreLoop: what it sends, and when; a KV pull or send runs on a worker while the loop steps on.

The first tests drive the loop with a fake engine; the rest run it on a thread around a real decode engine (tiny
model), with the transport's real connector wrapped so that its pulls wait on an Event (shm on CPU, float64; the
cuda_ipc copy on a GPU), and compare tokens with an in-process engine."""

import multiprocessing
import os
import threading
import time
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from splitserve.common.sampling_params import SamplingParams
from splitserve.engine import LLM
from splitserve.engine.core_process import loop as loop_module
from splitserve.engine.core_process import messages as m
from splitserve.engine.core_process.loop import CoreLoop
from splitserve.engine.kv_connectors.base import KvConnector, Moved
from splitserve.engine.kv_connectors.factory import connector_class, make_connector
from splitserve.engine.kv_connectors.shm import ShmConnector
from tests.engine.test_engine_exact import make_prompts
from tests.model_factory import make_tiny_model_dir
from tests.service_harness import wait_until


class Gate:
    """What a fake or gated transfer waits on: `entered` when it starts, `gate` to go on, `ended` when done."""

    def __init__(self, opened: bool = False) -> None:
        self.entered, self.gate, self.ended = threading.Event(), threading.Event(), threading.Event()
        if opened:
            self.gate.set()

    def pass_through(self, then):
        self.entered.set()
        try:
            assert self.gate.wait(30), "the test never opened the gate"
            return then()
        finally:
            self.ended.set()


class Pipe:
    """The core's end of a real pipe, noting how long each poll may wait and each batch sent; the test holds
    the other end."""

    def __init__(self) -> None:
        self.core_end, self.test_end = multiprocessing.Pipe()
        self.waits: list[float | str] = []  # each poll's timeout, and "recv" for each batch received
        self.batches: list[list[str]] = []  # type names of each batch the core sent

    def poll(self, timeout: float) -> bool:
        self.waits.append(timeout)
        return self.core_end.poll(timeout)

    def fileno(self) -> int:  # the loop's wait with transfers in flight selects on it
        return self.core_end.fileno()

    def recv(self) -> list:
        self.waits.append("recv")
        return self.core_end.recv()

    def send(self, batch: list) -> None:
        self.batches.append([type(msg).__name__ for msg in batch])
        self.core_end.send(batch)


class Driver:
    """The service's side of a CoreLoop running on a thread: sends commands, files what comes back."""

    def __init__(self, engine, connector, pipe: Pipe | None = None) -> None:
        self.pipe = pipe or Pipe()
        self.loop = CoreLoop(engine, self.pipe, connector)
        self.tokens: dict[str, list[int]] = defaultdict(list)
        self.finished: dict[str, object] = {}  # request_id -> its last RequestOutput
        self.done: dict[str, list[m.ImportDone]] = defaultdict(list)
        self.replies: dict[int, m.Reply] = {}
        self.received: list = []
        self.errors: list[BaseException] = []
        self._call_ids = iter(range(1, 10**6))
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        try:
            self.loop.run()
        except BaseException as exc:  # reported by stop()
            self.errors.append(exc)

    def start(self) -> "Driver":
        self.thread.start()
        return self

    def send(self, *msgs) -> None:
        self.pipe.test_end.send(list(msgs))

    def read(self, timeout_s: float = 0.01) -> None:
        while self.pipe.test_end.poll(timeout_s):
            timeout_s = 0
            for msg in self.pipe.test_end.recv():
                self.received.append(msg)
                if isinstance(msg, m.StepBatch):
                    for out in msg.outputs:
                        self.tokens[out.request_id].extend(out.new_token_ids)
                        if out.finished:
                            self.finished[out.request_id] = out
                elif isinstance(msg, m.ImportDone):
                    self.done[msg.request_id].append(msg)
                elif isinstance(msg, m.Reply):
                    self.replies[msg.call_id] = msg

    def until(self, condition, timeout_s: float, message: str):
        def check():
            self.read()
            if self.errors:
                raise AssertionError(f"the core loop failed: {self.errors[0]!r}")
            return condition()

        return wait_until(check, timeout_s, message, poll_s=0)

    def stats(self) -> dict:
        call_id = next(self._call_ids)
        self.send(m.Query(call_id, "stats"))
        return self.until(lambda: self.replies.get(call_id), 10, "no stats reply").value

    def stop(self, timeout_s: float = 10) -> float:
        started = time.monotonic()
        self.send(m.Shutdown())
        self.thread.join(timeout_s)
        assert not self.thread.is_alive(), "the core loop did not exit"
        assert not self.errors, self.errors
        return time.monotonic() - started


# -- a fake engine ---------------------------------------------------------------------------
class Engine:
    """A decode's engine with one request always running (while `has_work`); every step notes what had been sent
    by then. begin_import finds room after `room_after_steps` steps and gives blocks [7, 8], none cached here; the
    steps in `frees_at` free a block (the pool's num_blocks_freed, which waiting imports retry on)."""

    layout = "layout-a"
    config = SimpleNamespace(block_size=16)
    runner = SimpleNamespace(kv_cache="kv-cache")
    num_free_blocks = 30  # pins are only noted: never changes
    last_step_num_tokens = 1  # one running request, one token a step

    def __init__(self, pipe: Pipe, room_after_steps: int = 0, has_work: bool = True, frees_at=()) -> None:
        self.pipe, self.room_after_steps, self.has_work = pipe, room_after_steps, has_work
        self.frees_at = set(frees_at)
        self.pool = SimpleNamespace(num_blocks_freed=0)
        self.steps = 0
        self.sent_before_step: list[list[str]] = []
        self.pins: list[tuple[str, list[int]]] = []
        self.import_steps: list[int] = []  # steps run by each begin_import call
        self.rooms_made: list[tuple[int, int]] = []  # (blocks, share) the scheduler was asked to free
        self.scheduler = SimpleNamespace(
            import_share=None, make_room=lambda n, share: self.rooms_made.append((n, share))
        )
        self.dead_rank: Exception | None = None  # what check_ranks raises (a tensor-parallel rank that exited)
        self.turns = 0  # loop turns (each checks the ranks once)

    def has_unfinished(self) -> bool:
        return self.has_work

    def check_ranks(self) -> None:
        self.turns += 1
        if self.dead_rank is not None:
            raise self.dead_rank

    def begin_import(self, *args, share=0):
        self.import_steps.append(self.steps)
        return None if self.steps < self.room_after_steps else ([7, 8], 0)

    def import_blocks_needed(self, prompt_token_ids):
        return len(prompt_token_ids) // self.config.block_size

    def pin_blocks(self, blocks):
        self.pins.append(("pin", list(blocks)))

    def unpin_blocks(self, blocks):
        self.pins.append(("unpin", list(blocks)))

    def step(self):
        self.steps += 1
        self.pool.num_blocks_freed += self.steps in self.frees_at
        self.sent_before_step.append([name for batch in self.pipe.batches for name in batch])
        time.sleep(0.002)  # a step takes time
        return []

    def stats(self) -> dict:
        return {"steps": self.steps}


class FakeConnector(ShmConnector):
    """The shm connector, with a pull that waits on `gate.gate`, then moves 2048 bytes."""

    def __init__(self, gate: Gate) -> None:
        super().__init__({"timeout_s": 5.0, "role": "decode"})
        self.gate = gate

    def prepare_pull(self, spec):
        return "source-pool"

    def pull(self, spec, indices, dst_blocks, target):
        return self.gate.pass_through(lambda: Moved(2048))


def import_msg(rid: str = "r1") -> m.ImportKv:
    spec = m.PullSpec("shm", "p0", {}, [3, 4], [], 32, "layout-a", request_id=rid)
    return m.ImportKv(rid, list(range(32)), None, 0, 5, None, 0, spec)


def fake_driver(gate: Gate, **engine_args) -> tuple[Driver, Engine]:
    pipe = Pipe()
    engine = Engine(pipe, **engine_args)
    return Driver(engine, FakeConnector(gate), pipe), engine


def test_the_loop_steps_while_a_pull_waits_and_reports_it_before_the_next_step():
    gate = Gate()
    driver, engine = fake_driver(gate)
    driver.start()
    driver.send(import_msg())
    driver.until(lambda: gate.entered.is_set(), 10, "the pull never started")
    steps_then = len(engine.sent_before_step)
    driver.until(lambda: len(engine.sent_before_step) >= steps_then + 20, 10, "the loop stopped stepping")
    assert not driver.done  # 20 steps while the pull waits, and no ImportDone yet
    gate.gate.set()
    done = driver.until(lambda: driver.done.get("r1"), 10, "no ImportDone")
    driver.stop()
    assert [(d.ok, d.num_blocks_pulled, d.num_bytes) for d in done] == [(True, 2, 2048)]
    # flushed on its own before the step of the turn that saw it end (the commit's round trip overlaps that
    # step), not with the step's outputs after it
    assert ["ImportDone"] in driver.pipe.batches
    assert engine.pins == [("pin", [7, 8]), ("unpin", [7, 8])]


def test_an_import_without_room_is_tried_again_after_each_free_and_pulled_once_room_appears():
    driver, engine = fake_driver(Gate(opened=True), room_after_steps=3, frees_at=(2, 3))
    driver.send(import_msg())  # there at the first turn
    driver.start()
    done = driver.until(lambda: driver.done.get("r1"), 10, "no ImportDone")
    driver.stop()
    # no room on arrival; not tried again in that turn nor after step 1 (nothing freed); tried after step 2 (a
    # free, still no room) and step 3 (a free, room)
    assert done[0].ok and engine.import_steps == [0, 2, 3]


def test_every_batch_in_the_pipe_is_taken_in_before_the_next_step():
    """Three batches queued while the loop was busy: one turn handles all three, then steps once (a prefill's
    requests go into one step, not one step each)."""
    driver, engine = fake_driver(Gate(opened=True))
    for call_id in (1, 2, 3):
        driver.send(m.Query(call_id, "stats"))
    driver.start()
    driver.until(lambda: len(driver.replies) == 3, 10, "three stats replies")
    driver.stop()
    assert [driver.replies[i].value for i in (1, 2, 3)] == [{"steps": 0}] * 3
    assert driver.pipe.waits[:7] == [0, "recv", 0, "recv", 0, "recv", 0]  # the last: the pipe is empty now


def test_a_tensor_parallel_rank_that_exits_ends_an_idle_loop():
    from splitserve.engine.worker.tensor_parallel import TensorParallelError

    driver, engine = fake_driver(Gate(opened=True), has_work=False)
    driver.start()
    driver.until(lambda: engine.pipe.waits, 10, "the loop never waited on the pipe")
    engine.dead_rank = TensorParallelError("tensor-parallel rank 1 of 2 exited (exit code -9)")
    wait_until(lambda: not driver.thread.is_alive(), 5, "an idle loop did not notice the dead rank")
    assert [str(e) for e in driver.errors] == ["tensor-parallel rank 1 of 2 exited (exit code -9)"]
    assert engine.steps == 0


def test_idle_with_a_pull_in_flight_the_loop_sleeps_until_the_pull_ends_and_reports_it_at_once(monkeypatch):
    """No polling interval between a pull's end and its report: with the idle wait made 30 s long, the loop turns
    no more while the pull waits and still reports it as soon as its worker ends it."""
    monkeypatch.setattr(loop_module, "TRANSFER_WAIT_S", 30.0)
    gate = Gate()
    driver, engine = fake_driver(gate, has_work=False)
    driver.start()
    driver.send(import_msg())
    driver.until(lambda: gate.entered.is_set(), 10, "the pull never started")
    turns = engine.turns
    held = time.monotonic()
    driver.until(lambda: time.monotonic() - held > 0.2, 10, "the clock stopped")
    assert engine.turns <= turns + 1  # asleep (the turn that started the pull may end): none while the gate held
    turns = engine.turns
    gate.gate.set()
    opened = time.monotonic()
    driver.until(lambda: driver.done.get("r1"), 10, "no ImportDone")
    assert time.monotonic() - opened < 5.0  # woken by the pull's end, not by the 30 s wait's end
    assert engine.turns <= turns + 2 and engine.steps == 0
    driver.stop()


# -- a real decode engine --------------------------------------------------------------------
MAX_TOKENS = 24
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
ENGINES = {  # the decode's pull: shm on CPU (float64: ties cannot flip); on CUDA the cuda_ipc copy
    "cpu": dict(dtype="float64", device="cpu", block_size=4, num_kv_blocks=64),
    "cuda": dict(dtype="float32", device="cuda", block_size=16, num_kv_blocks=64, max_num_seqs=8),
}
TRANSPORTS = {"cpu": "shm", "cuda": "cuda_ipc"}
ON_CUDA = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.fixture(scope="session", params=["cpu", pytest.param("cuda", marks=ON_CUDA)])
def device(request) -> str:
    return request.param


@pytest.fixture(scope="session")
def model(tmp_path_factory, device):
    """(model directory, prompts, each prompt's greedy tokens from an in-process engine on `device`); once per
    session, for every module that imports these fixtures (its prefill engine is its own: module scope)."""
    dtype = torch.float64 if device == "cpu" else torch.float32
    path = make_tiny_model_dir(tmp_path_factory.mktemp("core-loop"), dtype=dtype)
    prompts = make_prompts(n=14)[10:14]  # no shared prefixes
    outs = LLM(model=str(path), **ENGINES[device]).generate(prompt_token_ids=prompts, sampling_params=GREEDY)
    return path, prompts, [o.token_ids for o in outs]


def engine_core(model, device: str, role: str, kv_cache_factory=None, **overrides):
    from splitserve.common.config import EngineConfig
    from splitserve.engine.engine_core import EngineCore

    config = EngineConfig(model=str(model[0]), role=role, **(ENGINES[device] | overrides))
    return EngineCore(config, kv_cache_factory=kv_cache_factory)


@pytest.fixture(scope="module")
def prefill(model, device):
    """A prefill engine; on CPU its pool is a shared-memory segment (what a decode's shm pull copies from)."""
    io = make_connector({"transport": TRANSPORTS[device], "instance": f"p-loop-{os.getpid()}", "role": "prefill"})
    yield engine_core(model, device, "prefill", io.kv_cache_factory), io
    io.close()


class GatedPulls:
    """Mixed in before a connector class (gated_connector, below)."""

    def prepare_pull(self, spec):
        return self.prefill_pool if spec.transport == "cuda_ipc" else super().prepare_pull(spec)

    def pull(self, spec, indices, dst_blocks, target):
        return self.gate.pass_through(lambda: self._pull(spec, indices, dst_blocks, target))

    def _pull(self, spec, indices, dst_blocks, target):
        if self.fail is not None:
            raise self.fail
        return super().pull(spec, indices, dst_blocks, target)


def gated_connector(transport: str, gate: Gate, fail: Exception | None, prefill_pool) -> KvConnector:
    """The transport's real connector, wrapped as a test wraps one (a subclass): its pulls pass `gate` first,
    and raise `fail` (when set) instead of copying. On CUDA the prefill's pool is in this process, so it stands
    for the mapping (CUDA IPC cannot map a process's own)."""
    real = connector_class(transport)
    gated = type(f"Gated{real.__name__}", (GatedPulls, real), {})
    connector = gated({"transport": transport, "instance": "d-loop", "role": "decode", "timeout_s": 5})
    connector.gate, connector.fail, connector.prefill_pool = gate, fail, prefill_pool
    return connector


@pytest.fixture
def decode(model, prefill, device, monkeypatch):
    """Start a CoreLoop on a fresh decode engine with a gated connector: `decode(gate, fail=None, **engine config
    overrides)` -> Driver."""
    # owner and reader share this process: the reader must not drop the owner's resource-tracker entry
    monkeypatch.setattr("splitserve.engine.kv_connectors.shm_pool._untrack", lambda shm: None)
    drivers = []

    def start(gate: Gate, fail: Exception | None = None, **overrides) -> Driver:
        io = gated_connector(TRANSPORTS[device], gate, fail, prefill[0].runner.kv_cache)
        engine = engine_core(model, device, "decode", io.kv_cache_factory, **overrides)
        driver = Driver(engine, io)
        driver.baseline = engine.num_free_blocks
        drivers.append(driver)
        return driver.start()

    yield start
    for driver in drivers:
        driver.loop.connector.gate.gate.set()  # a test that failed may have left a pull waiting
        if driver.thread.is_alive():
            driver.stop()
        driver.loop.connector.close()
    for rid in list(prefill[0].held):  # what each test's prefill still holds (its "lease")
        prefill[0].release_kv(rid)


def prefilled(prefill, rid: str, prompt: list[int]) -> m.ImportKv:
    """Prefill `prompt` on the prefill engine; the ImportKv a decode service would send for it."""
    engine, io = prefill
    engine.add_request(rid, prompt, GREEDY)
    while not (outs := [o for o in engine.step() if o.finish_reason == "prefilled"]):
        pass
    blocks, hashes, num_tokens = engine.held_kv(rid)
    spec = m.PullSpec(io.transport, "p0", io.endpoint, blocks, hashes, num_tokens, engine.layout, request_id=rid)
    return m.ImportKv(rid, prompt, GREEDY, 0, outs[0].new_token_ids[0], None, 0, spec)


def num_prompt_blocks(prompt: list[int], device: str) -> int:
    return -(-len(prompt) // ENGINES[device]["block_size"])


def test_running_requests_get_tokens_while_a_pull_waits_then_it_joins_with_the_exact_tokens(
    model, prefill, decode, device
):
    _, prompts, greedy = model
    gate = Gate()
    d = decode(gate)
    x = prefilled(prefill, "x", prompts[2])
    d.send(m.AddRequest("a", prompts[0], GREEDY), m.AddRequest("b", prompts[1], GREEDY), x)
    d.until(lambda: gate.entered.is_set(), 10, "the pull never started")
    d.until(lambda: len(d.tokens["a"]) >= 8 and len(d.tokens["b"]) >= 8, 20, "a and b got no tokens during the pull")
    assert not d.done and "x" not in d.tokens and d.stats()["num_waiting_for_kv"] == 1
    gate.gate.set()
    (done,) = d.until(lambda: d.done.get("x"), 10, "no ImportDone")
    assert (done.ok, done.num_blocks_pulled, done.num_cached_tokens) == (True, num_prompt_blocks(prompts[2], device), 0)
    assert (done.device_ns > 0) == (device == "cuda")  # the cuda_ipc copy is timed on its side stream
    prefill[0].release_kv("x")  # what the service's ReleaseKv does
    d.send(m.CommitImport("x", ok=True))
    d.until(lambda: {"a", "b", "x"} <= d.finished.keys(), 30, "not every request finished")
    assert [d.tokens[r] for r in "ab"] == greedy[:2]
    assert [x.first_token_id, *d.tokens["x"]] == greedy[2]
    assert {r: d.finished[r].finish_reason for r in "abx"} == dict.fromkeys("abx", "length")
    assert d.stats()["num_free_blocks"] == d.baseline


def test_a_pull_aborted_in_flight_frees_its_blocks_once_and_only_after_the_copy_ended(model, prefill, decode, device):
    _, prompts, _ = model
    gate = Gate()
    d = decode(gate)
    x = prefilled(prefill, "x", prompts[3])
    d.send(x)
    d.until(lambda: gate.entered.is_set(), 10, "the pull never started")
    d.send(m.Abort(["x"]))
    d.until(lambda: "x" in d.finished, 10, "no abort output")
    assert d.finished["x"].finish_reason == "abort"
    held = num_prompt_blocks(prompts[3], device)
    assert d.stats()["num_free_blocks"] == d.baseline - held  # the request is gone; the copy still holds them
    gate.gate.set()
    d.until(lambda: d.stats()["num_free_blocks"] == d.baseline, 10, "the blocks were never freed")
    assert gate.ended.is_set()
    # the service heard of the freed blocks without asking (what its Describe reports): no step carried them
    last = [b.stats["num_free_blocks"] for b in d.received if isinstance(b, m.StepBatch) and b.stats]
    assert last[-2:] == [d.baseline - held, d.baseline]
    d.stop()
    free = d.loop.engine.pool.free_block_ids()
    assert sorted(free) == list(range(ENGINES[device]["num_kv_blocks"]))  # each block free exactly once
    assert not d.done and d.loop.engine.stats()["num_waiting_for_kv"] == 0  # an aborted pull reports nothing


def test_a_failed_pull_follows_the_policy_recompute_with_the_exact_tokens(model, prefill, decode):
    _, prompts, greedy = model
    d = decode(Gate(opened=True), fail=RuntimeError("injected: prefill gone"))
    x = prefilled(prefill, "x", prompts[1])
    d.send(x)
    (done,) = d.until(lambda: d.done.get("x"), 10, "no ImportDone")
    assert (done.ok, done.error) == (False, "KV pull from p0 failed: injected: prefill gone")
    prefill[0].release_kv("x")
    d.send(m.CommitImport("x", ok=False, recompute=True))  # what the service sends under policy recompute
    d.until(lambda: "x" in d.finished, 30, "x never finished")
    assert [x.first_token_id, *d.tokens["x"]] == greedy[1]
    assert d.stats()["num_free_blocks"] == d.baseline


def test_a_pull_past_its_deadline_is_reported_failed_and_keeps_its_blocks_until_it_ends(model, prefill, decode, device):
    _, prompts, greedy = model
    gate = Gate()
    d = decode(gate)
    d.loop.connector.deadline_s = 0.3
    x = prefilled(prefill, "x", prompts[0])
    sent = time.monotonic()
    d.send(x)
    (done,) = d.until(lambda: d.done.get("x"), 10, "no ImportDone")
    assert gate.entered.is_set() and 0.3 <= time.monotonic() - sent < 3
    assert (done.ok, done.error) == (
        False,
        "KV pull from p0 failed: the transfer did not end within 0.3 s (its blocks stay held until it does)",
    )
    prefill[0].release_kv("x")
    d.send(m.CommitImport("x", ok=False, recompute=True))
    d.until(lambda: "x" in d.finished, 30, "x never finished")  # recomputed in other blocks meanwhile
    assert [x.first_token_id, *d.tokens["x"]] == greedy[0]
    pinned = num_prompt_blocks(prompts[0], device)
    assert d.stats()["num_free_blocks"] == d.baseline - pinned  # the late copy still holds its blocks
    gate.gate.set()
    d.until(lambda: d.stats()["num_free_blocks"] == d.baseline, 10, "the late copy's blocks were never freed")
    assert len(d.done["x"]) == 1  # the late end reports nothing more


def test_shutdown_with_a_pull_in_flight_exits_cleanly(model, prefill, decode):
    _, prompts, _ = model
    gate = Gate()
    d = decode(gate)
    d.send(m.AddRequest("a", prompts[0], GREEDY), prefilled(prefill, "x", prompts[1]))
    d.until(lambda: gate.entered.is_set() and d.tokens["a"], 10, "the pull never started")
    assert d.stop() < 3  # the worker still waits: the loop gives it a moment, then exits


# -- a real prefill engine: sends ------------------------------------------------------------
class SendConnector(KvConnector):
    """A prefill's connector whose sends wait on `gate`, then answer what a send reports."""

    transport = "test-send"

    def __init__(self, gate: Gate) -> None:
        super().__init__({"timeout_s": 5.0, "role": "prefill"})
        self.gate = gate
        self.sent: list[list[int]] = []

    def send(self, pair, block_ids, kv_cache, tag=0):
        return self.gate.pass_through(lambda: self.sent.append(list(block_ids)) or {"num_bytes": len(block_ids)})


def test_a_prefill_prefills_while_a_send_waits_and_keeps_the_blocks_until_the_send_ended(model, device):
    _, prompts, greedy = model
    gate = Gate()
    engine = engine_core(model, device, "prefill")
    d = Driver(engine, SendConnector(gate))
    baseline = engine.num_free_blocks
    d.start()
    d.send(m.AddRequest("x", prompts[0], GREEDY))
    d.until(lambda: "x" in d.finished, 10, "x was not prefilled")
    held = next(h for b in d.received if isinstance(b, m.StepBatch) for h in b.held if h.request_id == "x")
    d.send(m.SendBlocks(7, "p->d", held.block_ids, tag=3))
    d.until(lambda: gate.entered.is_set(), 10, "the send never started")
    d.send(m.ReleaseHeld("x"), m.AddRequest("y", prompts[1], GREEDY))  # the lease ends mid-send; more work comes
    d.until(lambda: "y" in d.finished, 10, "y was not prefilled while the send waited")
    assert d.tokens["y"] == greedy[1][:1] and 7 not in d.replies
    assert d.stats()["num_free_blocks"] == baseline - len(held.block_ids) - num_prompt_blocks(prompts[1], device)
    gate.gate.set()
    reply = d.until(lambda: d.replies.get(7), 10, "no reply to the send")
    assert (reply.value, reply.error, d.loop.connector.sent) == (
        {"num_bytes": len(held.block_ids)},
        None,
        [held.block_ids],
    )
    d.send(m.ReleaseHeld("y"))
    d.until(lambda: d.stats()["num_free_blocks"] == baseline, 10, "blocks still held after the send")
    d.stop()


def test_forks_of_an_imported_prompt_share_its_pulled_kv_with_the_exact_tokens(model, prefill, decode, device):
    """n = 3 on the decode role: the prompt's KV is pulled once, the forks start when the import commits
    (greedy: each gives the same tokens as the request), every block is back at the end."""
    _, prompts, greedy = model
    d = decode(Gate(opened=True))
    x = prefilled(prefill, "x", prompts[2])
    x.fork_ids = ["x~1", "x~2"]
    d.send(x)
    (done,) = d.until(lambda: d.done.get("x"), 10, "no ImportDone")
    assert (done.ok, done.num_blocks_pulled) == (True, num_prompt_blocks(prompts[2], device))  # pulled once
    prefill[0].release_kv("x")
    d.send(m.CommitImport("x", ok=True))
    d.until(lambda: {"x", "x~1", "x~2"} <= d.finished.keys(), 30, "not every sequence finished")
    assert [x.first_token_id, *d.tokens["x"]] == greedy[2]
    assert d.tokens["x~1"] == d.tokens["x~2"] == greedy[2]
    assert d.stats()["num_free_blocks"] == d.baseline
