"""TransferLanes: transfers run on their lane's worker in order, and a worker's report reaches a loop that is busy
running Python within about a switch interval once the process hands the GIL to its helper threads (gil.py)."""

import statistics
import sys
import threading
import time

import pytest

from splitserve.engine.core_process.gil import SWITCH_INTERVAL_S, hand_gil_to_helpers
from splitserve.engine.kv_connectors.lanes import TransferLanes
from tests.service_harness import wait_until


def test_transfers_of_a_lane_run_in_order_on_its_worker_and_report_through_poll():
    lanes = TransferLanes()
    ran: list[tuple[str, str]] = []
    done: list[tuple[str, object, str | None]] = []

    def work(name: str):
        ran.append((name, threading.current_thread().name))
        if name == "bad":
            raise ValueError("no such block")
        return name.upper()

    def on_done(transfer, result, error):
        done.append((transfer.lane, result, None if error is None else str(error)))

    for name in ("a", "bad", "c"):
        lanes.submit("peer-1", lambda name=name: work(name), on_done, lambda t: None, timeout_s=5.0)
    assert lanes.num_in_flight == 3
    wait_until(lambda: lanes.poll() or len(done) == 3, 10, "the lane's three transfers were not all reported")
    assert ran == [("a", "kv-peer-1"), ("bad", "kv-peer-1"), ("c", "kv-peer-1")]
    assert done == [("peer-1", "A", None), ("peer-1", None, "no such block"), ("peer-1", "C", None)]
    assert lanes.num_in_flight == 0
    assert lanes.close(wait_s=5.0) == 0


def _round_trips_beside_busy_python(n: int) -> list[float]:
    """Seconds from submitting a no-op transfer to the loop's poll seeing it, while the loop runs Python."""
    lanes = TransferLanes()
    times = []
    for _ in range(n):
        seen: list[bool] = []
        start = time.perf_counter()
        lanes.submit("peer", lambda: None, lambda t, r, e: seen.append(True), lambda t: None, timeout_s=5.0)
        deadline = start + 10
        while not seen:
            sum(range(2000))  # the loop preparing a step: Python holding the GIL
            lanes.poll()
            assert time.perf_counter() < deadline, "a no-op transfer was not reported within 10 s"
        times.append(time.perf_counter() - start)
    lanes.close(wait_s=5.0)
    return times


@pytest.fixture
def restore_switch_interval():
    before = sys.getswitchinterval()
    yield
    sys.setswitchinterval(before)


def test_a_worker_reports_within_a_short_interval_beside_a_busy_loop(restore_switch_interval):
    sys.setswitchinterval(0.005)  # the interpreter's default
    slow = statistics.median(_round_trips_beside_busy_python(15))
    hand_gil_to_helpers()
    assert sys.getswitchinterval() == pytest.approx(SWITCH_INTERVAL_S)
    fast = statistics.median(_round_trips_beside_busy_python(15))
    # a worker takes the GIL twice (to start, to report): about two intervals each way
    assert slow > 0.005, f"at the default interval a report waited {slow * 1e3:.2f} ms, not a whole interval"
    assert fast < slow / 3, f"{fast * 1e3:.2f} ms with the short interval vs {slow * 1e3:.2f} ms at the default"
