"""Ending a process that imported torch without the interpreter's teardown.

A finished engine core or service process has nothing left to do at exit but what its atexit handlers do (flush
logs, export the last spans, reap children), yet CPython's teardown then frees every module's objects one at a
time: for a process that imported torch, transformers and xgrammar that took 2-4 s of CPU (more on a loaded
machine), during which a draining service had not exited and its core held its process slot.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
from typing import NoReturn


def exit_now(code: int) -> NoReturn:
    """Exit with `code` as a normal exit would, less the teardown: wait for the threads that are not daemons,
    run the atexit handlers, flush stdout and stderr, then `os._exit`. Only for a process's own last step (the
    caller's `finally` blocks and context managers must have run); never in a process that hosts other work."""
    for thread in threading.enumerate():
        if thread is not threading.current_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (AttributeError, OSError, ValueError):  # closed or replaced by something without flush
            pass
    os._exit(code)
