"""CoreLoop on its own (fake engine, pipe and transport): what it sends, and when."""

from types import SimpleNamespace

from engine import core_messages as m
from engine.core_process import CoreLoop


class Conn:
    """One batch to receive; records each send."""

    def __init__(self, batch: list) -> None:
        self.inbox = [batch]
        self.sent: list[list] = []

    def poll(self, timeout: float) -> bool:
        return bool(self.inbox)

    def recv(self) -> list:
        return self.inbox.pop(0)

    def send(self, batch: list) -> None:
        self.sent.append(batch)


class Engine:
    """A decode with one request running: its step stops the loop and notes what had been sent by then."""

    layout = "layout-a"
    config = SimpleNamespace(block_size=16)

    def __init__(self, loop_box: list, conn: Conn) -> None:
        self.loop_box, self.conn = loop_box, conn
        self.sent_before_step: list | None = None

    def has_unfinished(self) -> bool:
        return True

    def begin_import(self, *args):
        return [7, 8], 0  # blocks for the prompt, none cached here

    def step(self):
        self.sent_before_step = [type(msg).__name__ for batch in self.conn.sent for msg in batch]
        self.loop_box[0].running = False
        return []

    def stats(self) -> dict:
        return {}


def test_a_finished_pull_is_reported_before_the_next_step_runs():
    spec = m.PullSpec("shm", "p0", {}, [3, 4], [], 32, "layout-a", request_id="r1")
    conn = Conn([m.ImportKv("r1", list(range(32)), None, 0, 5, None, 0, spec)])
    box: list = []
    engine = Engine(box, conn)
    kv_io = SimpleNamespace(pull=lambda spec, indices, dst, core: 2048, last_device_ns=0)
    loop = CoreLoop(engine, conn, kv_io)
    box.append(loop)
    loop.run()
    assert engine.sent_before_step == ["ImportDone"]  # the commit's round trip overlaps the step
    done = conn.sent[0][0]
    assert (done.request_id, done.ok, done.num_blocks_pulled, done.num_bytes) == ("r1", True, 2, 2048)
    assert [type(msg).__name__ for msg in conn.sent[-1]] == ["StepBatch"]
