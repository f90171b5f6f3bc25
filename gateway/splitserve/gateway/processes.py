"""`--api-server-count N` (vLLM's flag): N gateway processes behind the same REST and gRPC ports.

One gateway process spends about a CPU-second per second at full load (grpc.aio's Cython and poller, the
REST shim's JSON and SSE, per-token Python), so the gateway, not the engines, limits a fast GPU. With N > 1
the command's process becomes a supervisor and starts N gateway processes, each the whole gateway
(`GatewayServer`: registry, router, both front ends, its own connections to every prefill and decode):

    splitserve gateway (supervisor: no event loop, serves nothing)
      │ reserves the ports (a bound, never-listening SO_REUSEPORT socket each), creates a temporary folder:
      │   counts      the gateway-wide admission state (gateway/admission.py: requests and each caller's
      │               sequences in flight, rate-limit buckets), under an flock
      │   metrics/    PROMETHEUS_MULTIPROC_DIR: every process's metrics, summed by whichever answers /metrics
      │   ready/      a file per process while it has a full path: /health and /ready say ready once all do
      ├── gateway process 0 ── listens with SO_REUSEPORT on the REST port (its own socket) and the gRPC port
      ├── ...                  (grpc.so_reuseport); process 0 alone also serves --metrics-port
      └── gateway process N-1  the kernel spreads new connections over the listening processes

Why a supervisor and not N peers: the ports, the shared files and the children's lives need one owner.
The supervisor holds each port from before the first process listens until the last has exited, so a
port taken by someone else is one clear error at start and no other program can join the port group
while a process restarts; it removes the folder at the end, and it is the one process `splitserve up`
(or systemd, or a container runtime) sees and signals. Why separate ports are not used: clients and
load balancers know one address.

What holds for the whole gateway: --max-concurrent-requests, the rate limits and each caller's fair share
are counted once, in the shared file, exactly as one process counts them. --max-connections is uvicorn's own
count, which cannot be shared: each process takes max_connections // N of it (at least 1), so the gateway
never holds more than the flag says, though one process may refuse a connection while another has room (the
kernel spreads connections by their addresses' hash, not by load). max_waiting_per_decode is checked as two
gateways in front of the same decodes check it: the decode's Describe count plus the requests this process
sent it since. A caller's request id must be unique among its requests in flight on the process that runs
it (the internal hops carry each process's own tag, so two processes never mix their requests).

Signals: SIGTERM / SIGINT are passed to every process, which drains as one gateway does (refuses new
requests, lets in-flight ones finish for up to --drain-grace-s); the supervisor exits 0 once all have
exited cleanly. A second signal is passed on too (the processes exit at once). A process that exits by
itself is reported (index, pid, exit code) and the others are drained and stopped: the supervisor exits
1, and whoever supervises the gateway (`splitserve up` restarts it) decides what comes next; restarting
one process alone would leave its in-flight requests failed anyway. Each process is in a process group
of its own (a signal to the supervisor's group reaches it once, from the supervisor) and is killed if the
supervisor dies (PR_SET_PDEATHSIG), so no process outlives it holding the ports.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import logging
import multiprocessing
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import wait

from splitserve.gateway.admission import SharedCounts, share_slots_for
from splitserve.gateway.auth import ANONYMOUS, client_id_of, load_api_keys
from splitserve.gateway.config import GatewayConfig

log = logging.getLogger("splitserve.gateway")
_PR_SET_PDEATHSIG = 1
METRICS_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"  # prometheus_client's multi-process mode


class PortTaken(OSError):
    """A public port of the gateway is held by another process (or its host is not this machine's)."""


@dataclass(frozen=True)
class ProcessShare:
    """What one gateway process of several gets from the supervisor: its index, where the shared state is."""

    index: int
    count: int
    parent_pid: int
    counts_path: str
    share_slots: int
    client_ids: tuple[str, ...]
    metrics_dir: str
    ready_dir: str  # a file per process while it has a full path (mark_ready)

    def open_counts(self) -> SharedCounts:
        return SharedCounts(self.counts_path, self.share_slots, self.client_ids)

    def mark_ready(self, ready: bool) -> None:
        """Tell the other processes whether this one has a full path (its registry's readiness)."""
        flag = os.path.join(self.ready_dir, str(self.index))
        if not ready:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(flag)
        elif not os.path.exists(flag):  # told after every health round: a write only on a change
            with open(flag, "w"):
                pass

    def processes_not_ready(self) -> list[int]:
        """The processes (indexes) that have no full path yet: the gateway is ready only once none is left, so a
        client told "ready" by one process is not refused by another that has not described the instances."""
        return [i for i in range(self.count) if not os.path.exists(os.path.join(self.ready_dir, str(i)))]


def _address(host: str, port: int) -> tuple[int, tuple]:
    family, _, _, _, sockaddr = socket.getaddrinfo(
        host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    return family, sockaddr


def reuseport_listener(host: str, port: int, backlog: int = 2048) -> socket.socket:
    """A TCP socket listening on host:port that shares the port with the other gateway processes."""
    family, sockaddr = _address(host, port)
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind(sockaddr)
    sock.listen(backlog)
    return sock


def reserve_port(host: str, port: int, flag: str) -> socket.socket:
    """Hold host:port for the gateway processes: first bound alone (without SO_REUSEPORT, so a port someone
    listens on is refused here, naming `flag`), then by a socket with SO_REUSEPORT that never listens (no
    connection reaches it) and lives until the supervisor exits. Port 0: a free port is picked.

    The holder leaves SO_REUSEADDR off where it can, so no other program may even bind the port, while the
    gateway processes (SO_REUSEPORT, same user) still may; connections of an earlier run in TIME_WAIT on the
    port forbid that, and then it sets SO_REUSEADDR (another program may bind, but not listen beside ours)."""
    family, sockaddr = _address(host, port)
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT connections of an earlier run
        try:
            probe.bind(sockaddr)
        except OSError as exc:
            raise PortTaken(f"{flag} {port} cannot be bound on {host}: {exc.strerror} (another process holds it?)")
        sockaddr = probe.getsockname()
    for reuse_address in (0, 1):
        holder = socket.socket(family, socket.SOCK_STREAM)
        holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, reuse_address)
        holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        try:
            holder.bind(sockaddr)
            return holder
        except OSError as exc:
            holder.close()
            error = exc
    raise PortTaken(f"{flag} {sockaddr[1]} cannot be bound on {host}: {error.strerror}")


def follow_parent(share: ProcessShare) -> None:
    """In a gateway process: a process group of its own, and killed when the supervisor dies."""
    os.setpgid(0, 0)
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != share.parent_pid:  # it died before prctl took effect
        os._exit(1)


class Supervisor:
    """Starts the gateway processes, passes signals on, and stops them all when one exits by itself."""

    def __init__(self, config: GatewayConfig, target: Callable[[GatewayConfig, ProcessShare], None]) -> None:
        self.config = config
        self._target = target
        self._holders: list[socket.socket] = []
        self._procs: list = []
        self._signals = 0
        self._folder = ""

    def _reserve(self) -> GatewayConfig:
        """The ports held; the config the processes get (port 0 replaced by the port picked, each process's
        part of --max-connections)."""
        config = self.config
        grpc = reserve_port(config.host, config.grpc_port, "--grpc-port")
        self._holders.append(grpc)
        values = {
            "grpc_port": grpc.getsockname()[1],
            "max_connections": max(1, config.max_connections // config.api_server_count),
        }
        if config.http_port:
            self._holders.append(reserve_port(config.host, config.http_port, "--http-port"))
            values["http_port"] = self._holders[-1].getsockname()[1]
        return dataclasses.replace(config, **values)

    def _shares(self) -> list[ProcessShare]:
        self._folder = tempfile.mkdtemp(prefix="splitserve-gateway-")
        metrics_dir, ready_dir = os.path.join(self._folder, "metrics"), os.path.join(self._folder, "ready")
        os.mkdir(metrics_dir)
        os.mkdir(ready_dir)
        keys = load_api_keys(self.config.api_keys_file)
        client_ids = tuple(dict.fromkeys([ANONYMOUS, *(client_id_of(k) for k in keys)]))
        counts_path, slots = os.path.join(self._folder, "counts"), share_slots_for(self.config.max_concurrent_requests)
        SharedCounts.create(counts_path, slots, client_ids)
        n = self.config.api_server_count
        return [
            ProcessShare(i, n, os.getpid(), counts_path, slots, client_ids, metrics_dir, ready_dir) for i in range(n)
        ]

    def _on_signal(self, signum: int, frame) -> None:
        self._signals += 1
        log.info("%s: passed to the %d gateway processes", signal.Signals(signum).name, len(self._procs))
        for proc in self._procs:
            if proc.exitcode is None and proc.pid:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGTERM)

    def run(self) -> int:
        """Until every process has exited: 0 when they drained on a signal, 1 when one exited by itself or
        the gateway could not start."""
        try:
            config = self._reserve()
            shares = self._shares()
        except (OSError, ValueError) as exc:
            print(f"splitserve gateway: error: {exc}", file=sys.stderr)
            self._cleanup()
            return 1
        wake_r, wake_w = socket.socketpair()
        wake_w.setblocking(False)
        old_wakeup = signal.set_wakeup_fd(wake_w.fileno())
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, self._on_signal)
        os.environ[METRICS_DIR_ENV] = shares[0].metrics_dir  # read by prometheus_client as the processes import it
        try:
            context = multiprocessing.get_context("spawn")
            for share in shares:
                proc = context.Process(target=self._target, args=(config, share), name=f"gateway-{share.index}")
                proc.start()
                self._procs.append(proc)
            log.info(
                "gateway: %d processes on gRPC %s:%d%s (pids %s)",
                len(self._procs),
                config.host,
                config.grpc_port,
                f", REST port {config.http_port}" if config.http_port else "",
                ", ".join(str(p.pid) for p in self._procs),
            )
            return self._watch(wake_r)
        finally:
            signal.set_wakeup_fd(old_wakeup)
            wake_r.close()
            wake_w.close()
            self._cleanup()

    def _watch(self, wake: socket.socket) -> int:
        failed = None
        while any(p.exitcode is None for p in self._procs):
            # bounded: the exits are checked every second even if no wake-up came (one supervisor once slept on
            # in poll after its processes had exited)
            ready = wait([wake, *(p.sentinel for p in self._procs if p.exitcode is None)], timeout=1.0)
            if wake in ready:
                with contextlib.suppress(BlockingIOError):
                    wake.recv(4096)
            for i, proc in enumerate(self._procs):
                if proc.exitcode is not None and failed is None and not self._signals:
                    failed = (i, proc)
                    print(
                        f"splitserve gateway: error: gateway process {i} (pid {proc.pid}) exited with code "
                        f"{proc.exitcode}; stopping the other {len(self._procs) - 1}",
                        file=sys.stderr,
                        flush=True,
                    )
                    self._stop_others(proc)
        if failed is not None:
            return 1
        clean = (0, -signal.SIGTERM)  # a process signalled before its handlers were installed ends by the signal
        return 0 if all(p.exitcode in clean for p in self._procs) else 1

    def _stop_others(self, failed) -> None:
        """Drain the others (SIGTERM), then kill whichever still runs past the drain grace."""
        others = [p for p in self._procs if p is not failed and p.exitcode is None]
        for proc in others:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + self.config.drain_grace_s + 5.0
        for proc in others:
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.exitcode is None:
                proc.kill()
                proc.join()

    def _cleanup(self) -> None:
        for proc in self._procs:
            if proc.exitcode is None:
                proc.kill()
                proc.join()
        for holder in self._holders:
            holder.close()
        if self._folder:
            shutil.rmtree(self._folder, ignore_errors=True)
