"""The GIL's switch interval of the processes whose helper threads sit on a latency path: the core process (a KV
transfer's lane worker) and the service process (the reader of the core's pipe, `client.EngineClient`).

While one thread runs Python, the interpreter hands the GIL to a thread that waits for it only once a switch
interval (5 ms by default), and such a helper takes the GIL many times: every torch call releases it and takes it
back, as do a pipe's reads and writes. A core loop preparing steps held a cuda_ipc pull's worker (about 13 takes)
81.9 ms for a 0.2 ms copy on an H100, 6.7 ms at a 0.5 ms interval; on CPU a transfer's round trip beside a busy
loop took 10.9 ms at 5 ms, 1.5 at 0.5 ms, 0.9 at 0.2 ms. The busy thread pays a switch per interval only while a
helper waits.
"""

from __future__ import annotations

import sys

SWITCH_INTERVAL_S = 0.0002


def hand_gil_to_helpers() -> None:
    """Set this process's switch interval to SWITCH_INTERVAL_S (before its helper threads start)."""
    sys.setswitchinterval(SWITCH_INTERVAL_S)
