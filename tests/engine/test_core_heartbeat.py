"""A core busy in one long step keeps its heartbeat going, saying how long the step has run, so its service does
not take it for a hung one; the service's client turns those heartbeats into the step's age."""

import time
from types import SimpleNamespace

import pytest

from splitserve.engine.core_process import loop as loop_module
from splitserve.engine.core_process import messages as m
from splitserve.engine.core_process.client import EngineClient
from tests.engine.test_core_loop import Driver, Engine, FakeConnector, Gate, Pipe
from tests.service_harness import wait_until_async


class LongStepEngine(Engine):
    """The fake decode engine of test_core_loop, whose second step waits on `long_step` (a long prefill)."""

    def __init__(self, pipe: Pipe, long_step: Gate) -> None:
        super().__init__(pipe)
        self.long_step = long_step

    def step(self):
        if self.steps == 1:
            self.long_step.pass_through(lambda: None)
        return super().step()


def test_a_long_step_sends_heartbeats_with_its_age_and_the_loop_goes_on_after_it(monkeypatch):
    monkeypatch.setattr(loop_module, "HEARTBEAT_S", 0.05)
    long_step, pipe = Gate(), Pipe()
    engine = LongStepEngine(pipe, long_step)
    driver = Driver(engine, FakeConnector(Gate(opened=True)), pipe).start()
    driver.until(lambda: long_step.entered.is_set(), 10, "the long step never began")

    def beats() -> list[float]:
        return [msg.in_step_s for msg in driver.received if isinstance(msg, m.Heartbeat)]

    driver.until(lambda: any(age >= 0.5 for age in beats()), 10, lambda: f"no heartbeat 0.5 s into the step: {beats()}")
    assert not long_step.ended.is_set() and engine.steps == 1  # sent from within the step, not after it
    assert all(age > 0 for age in beats())  # every one from within a step, with its age
    ages = beats()
    first = max(i for i in range(len(ages)) if i == 0 or ages[i] < ages[i - 1])  # the long step's first beat
    assert len(ages) - first >= 3, ages  # one every HEARTBEAT_S or so, its age growing (earlier ones: a loaded step)
    long_step.gate.set()
    driver.until(lambda: engine.steps >= 4, 10, "the loop did not step on after the long step")
    driver.stop()


def test_the_client_knows_how_long_the_core_has_been_in_one_step():
    client = EngineClient(config=None, kv_options={})
    assert client.in_step_s() == 0.0
    client.last_heard = time.monotonic()
    client._note_step([m.Heartbeat(in_step_s=3.0)])
    assert 3.0 <= client.in_step_s() < 13.0
    client._note_step([m.StepBatch([], [], {}, 0, 0)])  # the step's outputs end it
    assert client.in_step_s() == 0.0
    client._note_step([m.Heartbeat(in_step_s=2.0), m.Heartbeat()])  # a heartbeat between steps
    assert client.in_step_s() == 0.0


def test_a_core_ending_after_the_services_loop_closed_is_noted_quietly():
    """A service that exits before its core (a port already taken) closes its event loop; the reader thread's
    last word about the core must not raise on it ("Event loop is closed" in the service's log)."""
    import asyncio

    client = EngineClient(config=None, kv_options={})
    client.loop = asyncio.new_event_loop()
    client.loop.close()
    client._on_loop(client._dispatch, [m.Heartbeat()])  # no RuntimeError
    client.loop = asyncio.new_event_loop()
    try:
        client._on_loop(client._dispatch, [m.StepBatch([], [], {"steps": 1}, 0, 0)])
        client.loop.run_until_complete(asyncio.sleep(0))
        assert client.stats == {"steps": 1}
    finally:
        client.loop.close()


def test_the_reader_thread_hands_each_batch_to_the_loop_with_a_short_switch_interval():
    """The service's reader of the core's pipe runs beside a busy event loop: the process's switch interval is the
    short one (gil.py), and every batch it reads reaches the loop's handlers."""
    import asyncio
    import multiprocessing
    import sys

    from splitserve.engine.core_process.gil import SWITCH_INTERVAL_S

    before = sys.getswitchinterval()
    client = EngineClient(config=None, kv_options={})
    client._conn, core_end = multiprocessing.Pipe()
    client.loop = asyncio.new_event_loop()
    try:
        sys.setswitchinterval(0.005)
        client.start_reader()
        assert sys.getswitchinterval() == pytest.approx(SWITCH_INTERVAL_S)
        core_end.send([m.StepBatch([], [], {"steps": 7}, 0, 0)])

        async def dispatched() -> bool:
            return client.stats == {"steps": 7}

        client.loop.run_until_complete(wait_until_async(dispatched, 10, "the reader's batch never reached the loop"))
    finally:
        client.process = SimpleNamespace(join=lambda timeout: None, exitcode=0)  # the core "exits": the pipe closes
        core_end.close()
        client.loop.close()
        sys.setswitchinterval(before)
