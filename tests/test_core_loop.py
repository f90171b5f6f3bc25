"""CoreLoop on its own (fake engine, pipe and transport): what it sends, and when."""

from types import SimpleNamespace

from splitserve.engine import core_messages as m
from splitserve.engine.core_process import CoreLoop


class Conn:
    """One batch to receive; records each send."""

    def __init__(self, batch: list) -> None:
        self.inbox = [batch]
        self.sent: list[list] = []

    def poll(self, timeout: float) -> bool:
        self.polls = getattr(self, "polls", 0) + 1
        assert self.polls < 10, "the loop went on without stepping"
        return bool(self.inbox)

    def recv(self) -> list:
        return self.inbox.pop(0)

    def send(self, batch: list) -> None:
        self.sent.append(batch)


class Engine:
    """A decode with one request running: its step stops the loop and notes what had been sent by then."""

    layout = "layout-a"
    config = SimpleNamespace(block_size=16)

    def __init__(self, loop_box: list, conn: Conn, room_after_steps: int = 0) -> None:
        self.loop_box, self.conn = loop_box, conn
        self.room_after_steps = room_after_steps  # begin_import finds no room until this many steps ran
        self.steps = 0
        self.sent_before_step: list[list[str]] = []

    def has_unfinished(self) -> bool:
        return True

    def begin_import(self, *args):
        return None if self.steps < self.room_after_steps else ([7, 8], 0)  # blocks; none cached here

    def step(self):
        self.sent_before_step.append([type(msg).__name__ for batch in self.conn.sent for msg in batch])
        self.steps += 1
        if self.steps > self.room_after_steps:
            self.loop_box[0].running = False
        return []

    def stats(self) -> dict:
        return {}


def run_import(room_after_steps: int) -> tuple[Engine, Conn]:
    spec = m.PullSpec("shm", "p0", {}, [3, 4], [], 32, "layout-a", request_id="r1")
    conn = Conn([m.ImportKv("r1", list(range(32)), None, 0, 5, None, 0, spec)])
    box: list = []
    engine = Engine(box, conn, room_after_steps)
    kv_io = SimpleNamespace(pull=lambda spec, indices, dst, core: 2048, last_device_ns=0)
    box.append(CoreLoop(engine, conn, kv_io))
    box[0].run()
    return engine, conn


def test_a_finished_pull_is_reported_before_the_next_step_runs():
    engine, conn = run_import(room_after_steps=0)
    assert engine.sent_before_step == [["ImportDone"]]  # the commit's round trip overlaps the step
    done = conn.sent[0][0]
    assert (done.request_id, done.ok, done.num_blocks_pulled, done.num_bytes) == ("r1", True, 2, 2048)
    assert [type(msg).__name__ for msg in conn.sent[-1]] == ["StepBatch"]


def test_an_import_retried_once_room_appears_is_reported_before_the_step_after():
    engine, conn = run_import(room_after_steps=1)  # no room at first: pending, retried after step 1
    assert engine.sent_before_step == [[], ["StepBatch", "ImportDone"]]
