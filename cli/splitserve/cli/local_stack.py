"""The child processes of `splitserve up`: started together, logged, restarted by a policy, stopped together
(`LocalStack`, `RestartPolicy`; the order and the stack's life: supervisor.py).
"""

from __future__ import annotations

import collections
import ctypes
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Container, Sequence
from typing import Any

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass  # not Linux: children are still stopped by LocalStack.stop


MAX_RESTART_BACKOFF_S = 30.0


class RestartPolicy:
    """When up starts a child that exited by itself again: after `backoff_s`, doubled for each of its restarts
    still inside the sliding window (at most MAX_RESTART_BACKOFF_S), and only while fewer than `max_restarts`
    of them are: a crash loop stops the stack (and is reported) within a window, while a child that fails once
    in a while is restarted every time, however long up runs."""

    def __init__(self, max_restarts: int, window_s: float, backoff_s: float) -> None:
        self.max_restarts, self.window_s, self.backoff_s = max_restarts, window_s, backoff_s
        self._times: dict[str, collections.deque[float]] = collections.defaultdict(collections.deque)

    def delay(self, name: str, now: float) -> float | None:
        """Seconds to wait before restarting `name`, whose exit was seen at `now`; None: its budget is spent."""
        recent = self._times[name]
        while recent and recent[0] <= now - self.window_s:
            recent.popleft()
        if len(recent) >= self.max_restarts:
            return None
        delay = min(self.backoff_s * 2 ** len(recent), MAX_RESTART_BACKOFF_S)
        recent.append(now)
        return delay

    def count(self, name: str) -> int:
        """The restarts of `name` in the window, the one just granted included."""
        return len(self._times[name])


class LocalStack:
    """Child processes started together and always stopped together.

    Each child runs the installed splitserve with the same interpreter, with `PYTHONSAFEPATH=1` and no folder
    of ours added to its path: `python -m` and `python -c` would otherwise put the working directory first on
    `sys.path`, where a checkout's top-level folders shadow libraries of the same name (`kernels`). A child's
    stdout and stderr go to `log_dir/<name>.log`; its last `tail_lines` lines are kept for `failure_report`,
    and once `echo()` is called each new line is also written to `out`, prefixed with the child's name.
    """

    def __init__(
        self,
        env: dict[str, str] | None = None,
        die_with_parent: bool = True,
        log_dir: str | None = None,
        out: Any = None,
        tail_lines: int = 40,
    ) -> None:
        self._preexec = _die_with_parent if die_with_parent else None  # unsafe in threaded parents
        self.env = dict(os.environ if env is None else env)
        self.env["PYTHONSAFEPATH"] = "1"
        self.log_dir = log_dir or tempfile.mkdtemp(prefix="splitserve-up-")
        self.procs: dict[str, subprocess.Popen] = {}
        self.argvs: dict[str, list[str]] = {}
        self._out = out if out is not None else sys.stderr
        self._tail_lines = tail_lines
        self._tails: dict[str, collections.deque[str]] = {}
        self._readers: list[threading.Thread] = []
        self._echo = threading.Event()
        self._write_lock = threading.Lock()

    def add(self, name: str, argv: Sequence[str]) -> None:
        self.argvs[name] = list(argv)
        proc = subprocess.Popen(
            list(argv),
            env=self.env,
            start_new_session=True,
            preexec_fn=self._preexec,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        self.procs[name] = proc
        self._tails[name] = collections.deque(maxlen=self._tail_lines)
        reader = threading.Thread(target=self._read, args=(name, proc), name=f"up-log-{name}", daemon=True)
        reader.start()
        self._readers.append(reader)

    def log_path(self, name: str) -> str:
        return os.path.join(self.log_dir, f"{name}.log")

    def _read(self, name: str, proc: subprocess.Popen) -> None:
        """Copy one child's output to its log (appended across restarts) and, once echoing, to `out`."""
        with open(self.log_path(name), "ab") as log:
            for raw in iter(proc.stdout.readline, b""):
                log.write(raw)
                log.flush()
                line = raw.decode(errors="replace").rstrip("\n")
                self._tails[name].append(line)
                if self._echo.is_set():
                    with self._write_lock:
                        print(f"{name:<9} | {line}", file=self._out, flush=True)
        proc.stdout.close()

    def echo(self) -> None:
        """From now on every child's new lines are also written to `out`, prefixed with its name."""
        self._echo.set()

    def failure_report(self, name: str, code: int) -> str:
        """One block for a child that exited: its name and code, then its last lines, each prefixed."""
        proc = self.procs[name]
        for reader in self._readers:
            if reader.name == f"up-log-{name}" and proc.poll() is not None:
                reader.join(timeout=2.0)  # the pipe closes with the process: its last lines are in
        tail = list(self._tails[name])
        head = f"{name} exited with code {code}; its last {len(tail)} lines (all of them: {self.log_path(name)}):"
        return "\n".join([head, *(f"{name:<9} | {line}" for line in tail)])

    def restart(self, name: str) -> None:
        """Start child `name` again with the command it had."""
        self.add(name, self.argvs[name])

    def exited(self, skip: Container[str] = ()) -> list[tuple[str, int]]:
        """(name, exit code) of every child that has exited, less those in `skip`."""
        return [(n, p.returncode) for n, p in self.procs.items() if n not in skip and p.poll() is not None]

    def first_exit(self) -> tuple[str, int] | None:
        """(name, exit code) of a child that has exited, if any."""
        for name, proc in self.procs.items():
            if proc.poll() is not None:
                return name, proc.returncode
        return None

    def stop(self, grace_s: float, first: Sequence[str] = ()) -> dict[str, int]:
        """Stop the children named in `first`, then the rest: each stage gets SIGTERM, and SIGKILL
        for those still running after grace_s; name -> exit code."""
        stages = [[n for n in first if n in self.procs], [n for n in self.procs if n not in first]]
        for stage in stages:
            procs = [self.procs[n] for n in stage]
            for proc in procs:
                if proc.poll() is None:
                    proc.terminate()
            deadline = time.monotonic() + grace_s
            for proc in procs:
                try:
                    proc.wait(max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        for reader in self._readers:
            reader.join(timeout=2.0)
        return {name: proc.returncode for name, proc in self.procs.items()}
