"""Grammar compiles on trial in worker processes, so that one can be stopped: xgrammar's compile is one C++ call
that no thread can interrupt, and a schema may take minutes.

    engine core (GrammarBackend's slot thread)            worker process (python -m this module)
    ──────────────────────────────────────────            ──────────────────────────────────────
    CompileWorker(): spawned (imports xgrammar, torch)
    trial(spec, timeout_s) ─ the tokenizer info (first) ▶ a GrammarCompiler (no cache) of that tokenizer
                           ─ the spec ─────────────────▶  Begin (the budget starts now, not at its start-up)
                           ◀──── Trial ───────────────── compile_spec: refusal, or seconds + bytes it holds
    kill(): past the budget, or when nobody waits for it (its requests were aborted); a new one replaces it

A compiled grammar does not come back: xgrammar's serialize_json / deserialize_json take several times longer than
the compile itself (a 19 KB schema: 1 s to compile, 15 s to serialize to 125 MB, 8 s to read back), so the core
compiles a spec that passed its trial again for itself, which takes as long as the trial did (under the budget).
The trial also measures what the grammar really holds (the worker's resident memory with it, less without it, in a
process doing nothing else), which is what the core's cache counts; xgrammar's own count can be 30 times less.
"""

from __future__ import annotations

import ctypes
import subprocess
import sys
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection

WORKER_START_S = 300.0  # a worker that does not take its first spec in this long (importing torch) is broken


@dataclass(frozen=True)
class Begin:
    """The worker took the spec and starts compiling: the time budget counts from here."""


@dataclass(frozen=True)
class Trial:
    """A worker's answer for one spec: `error` (the refusal, REFUSAL_PREFIX ...) or None, how long the compile
    took, and the resident bytes the compiled grammar held in the worker."""

    error: str | None
    compile_s: float
    held_bytes: int


class CompileTimeout(Exception):
    """The worker did not answer within the budget; it was killed."""


class WorkerGone(Exception):
    """The worker's pipe closed: it was killed (an abort) or it crashed."""


def rss_bytes() -> int:
    """This process's resident memory."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def trim_heap() -> None:
    """Hand freed heap pages back to the system (glibc keeps them otherwise, and resident memory never falls)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass  # not glibc: nothing to trim


class CompileWorker:
    """One worker process and its pipe; driven by one thread at a time (`trial`), killed from any thread."""

    def __init__(self, tokenizer_info_json: str) -> None:
        import socket

        ours, theirs = socket.socketpair()
        fd = theirs.fileno()
        self.process = subprocess.Popen(
            [sys.executable, "-m", __name__, str(fd)], pass_fds=(fd,), stdin=subprocess.DEVNULL
        )
        theirs.close()
        self.conn = Connection(ours.detach())
        # sent with the first spec: a send this large waits for the worker to read it, after its imports (seconds),
        # and the slot thread that starts a worker must not wait for them (a vetted spec compiles without one)
        self._tokenizer_info_json: str | None = tokenizer_info_json
        self.compiling = False  # between a spec's Begin and its Trial
        self.num_trials = 0

    @property
    def pid(self) -> int:
        return self.process.pid

    def trial(self, spec, timeout_s: float) -> Trial:
        """Compile `spec` in the worker; CompileTimeout (the worker killed) past `timeout_s` from its Begin,
        WorkerGone when it is killed meanwhile or dies."""
        self.num_trials += 1
        try:
            if self._tokenizer_info_json is not None:
                self.conn.send(self._tokenizer_info_json)
                self._tokenizer_info_json = None
            self.conn.send(spec)
            if not self.conn.poll(WORKER_START_S):
                self.kill()
                raise WorkerGone(f"the grammar compile worker did not start in {WORKER_START_S:g} s")
            self.conn.recv()  # Begin
            self.compiling = True
            if not self.conn.poll(timeout_s):
                self.kill()
                raise CompileTimeout
            return self.conn.recv()
        except (EOFError, OSError) as exc:
            raise WorkerGone(f"the grammar compile worker {self.pid} ended") from exc
        finally:
            self.compiling = False

    def kill(self) -> None:
        """Stop it now (SIGKILL): a blocked `trial` on another thread then raises WorkerGone."""
        if self.process.poll() is None:
            self.process.kill()

    def close(self) -> None:
        self.kill()
        self.process.wait()
        self.conn.close()


def _serve(conn: Connection) -> None:
    import xgrammar

    from splitserve.engine.grammar import compile_spec

    info = xgrammar.TokenizerInfo.deserialize_json(conn.recv())
    compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)
    while True:
        try:
            spec = conn.recv()
        except EOFError:
            return  # the engine core is gone
        conn.send(Begin())
        trim_heap()
        before = rss_bytes()
        start = time.perf_counter()
        try:
            compiled = compile_spec(compiler, spec)
        except ValueError as exc:
            conn.send(Trial(str(exc), time.perf_counter() - start, 0))
            continue
        took = time.perf_counter() - start
        trim_heap()
        held = max(rss_bytes() - before, compiled.memory_size_bytes)
        del compiled
        conn.send(Trial(None, took, held))


def main() -> None:
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # its engine core decides when it ends (it closes the pipe)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    from splitserve.engine import grammar_workers  # by name: what it sends must unpickle in the core

    grammar_workers._serve(Connection(int(sys.argv[1])))


if __name__ == "__main__":
    main()
