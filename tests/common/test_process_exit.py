"""exit_now ends a process as a normal exit would (threads that are not daemons finished, then the atexit handlers,
buffered output written, the given code), without the interpreter's teardown."""

import os
import subprocess
import sys

import pytest

CHILD = """
import atexit, sys, threading
from splitserve.common.process_exit import exit_now

def work():
    total = sum(range(5_000_000))  # most likely still running when the main thread calls exit_now
    print("thread done", total == 12499997500000, file=sys.stderr, flush=True)

atexit.register(lambda: print("atexit ran", file=sys.stderr, flush=True))
threading.Thread(target=work).start()
sys.stdout.write("buffered, no newline")  # block-buffered (a pipe, PYTHONUNBUFFERED unset): written by the exit
exit_now(3)
print("never", file=sys.stderr)
"""


@pytest.mark.slow
def test_exit_now_waits_for_threads_runs_atexit_flushes_and_keeps_the_code():
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    out = subprocess.run([sys.executable, "-P", "-c", CHILD], capture_output=True, text=True, timeout=60, env=env)
    assert (out.returncode, out.stdout, out.stderr) == (3, "buffered, no newline", "thread done True\natexit ran\n")
