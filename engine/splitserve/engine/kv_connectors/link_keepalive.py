"""Keeps the GPU-to-GPU link a decode pulls over from going idle between pulls.

An NVLink path left idle for tens of ms makes its next copy pay ~0.3 ms to wake up (docs/performance.md,
"Findings that set defaults": KV link keep-alive).
With `--kv-link-keepalive-ms P` (default 2; 0 = off) a decode on a GPU copies 1 MiB from a buffer of
its own on each peer's device to one on its own device every P ms, on high-priority side streams
(NCCL's streams come from the other pool) that no pull or step waits on:

    thread, every P ms:  own buffer on the peer device ──1 MiB──▶ scratch on this device

The buffers are the decode's own (never the peer's pool), so a peer that dies or restarts takes
nothing this copies from with it. A link is built on the keep-alive thread, its CUDA context first by a
torch allocation (which creates it with the GIL released: ~0.3-0.5 GiB and a few hundred ms the core
loop must not wait for). A copy still in flight when the next is due is not stacked behind it. A link
that fails, built or copying, is logged once and never tried again: keeping a link awake is an
optimisation, and nothing of it may fail a pull. Links live as long as the process (a prefill that
comes back on another GPU adds a link; the old one goes on). While the core thread runs Python, this
thread gets the GIL at Python's switch interval (5 ms), so periods under that stretch to it then.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Protocol

log = logging.getLogger("splitserve.kv")

KEEPALIVE_BYTES = 1 << 20  # a 1 MiB copy wakes the link as fully as a 16 MiB one
MIN_PERIOD_MS = 0.5  # shorter periods only spin this thread against the core loop for the GIL


class Link(Protocol):
    def copy(self) -> None: ...

    def busy(self) -> bool: ...


class LinkKeepalive:
    """Builds each added link on one daemon thread, then calls its copy() every `period_s` while its
    busy() is False. The CUDA pieces live in `CudaLink`; this class only schedules."""

    def __init__(self, period_s: float) -> None:
        if not period_s * 1000 >= MIN_PERIOD_MS:
            raise ValueError(f"kv_link_keepalive_ms {period_s * 1000:g} is out of range: 0 (off) or >= {MIN_PERIOD_MS}")
        self.period_s = period_s
        self.pending: dict[str, Callable[[], Link]] = {}  # name -> factory, built on the thread
        self.links: dict[str, Link] = {}
        self.failed: set[str] = set()
        self.num_copies = 0
        self.num_skipped = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def add(self, name: str, factory: Callable[[], Link]) -> bool:
        """Keep the link `name` awake (once; False when it is already kept, pending or failed)."""
        with self._lock:
            if name in self.links or name in self.pending or name in self.failed:
                return False
            self.pending[name] = factory
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="kv-link-keepalive", daemon=True)
                self._thread.start()
        return True

    def _fail(self, name: str, what: str, exc: Exception) -> None:
        log.warning("keep-alive of link %s stopped (%s failed): %s", name, what, exc)
        with self._lock:
            self.links.pop(name, None)
            self.failed.add(name)

    def _build_pending(self) -> None:
        with self._lock:
            pending, self.pending = self.pending, {}
        for name, factory in pending.items():
            try:
                link = factory()
            except Exception as exc:
                self._fail(name, "setting it up", exc)
                continue
            with self._lock:
                self.links[name] = link
            log.info("keeping link %s awake: %d bytes every %g ms", name, KEEPALIVE_BYTES, self.period_s * 1000)

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            if self.pending:
                self._build_pending()
            with self._lock:
                links = list(self.links.items())
            for name, link in links:
                try:
                    if link.busy():
                        self.num_skipped += 1
                        continue
                    link.copy()
                    self.num_copies += 1
                except Exception as exc:  # a broken device must not take the decode down
                    self._fail(name, "a copy", exc)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5 * self.period_s + 5.0)
            log.info(
                "keep-alive stopped: %d copies, %d skipped (in flight), links %s, failed %s",
                self.num_copies,
                self.num_skipped,
                sorted(self.links),
                sorted(self.failed),
            )


class CudaLink:
    """The link peer_device -> own_device: 1 MiB between two buffers of this process, each allocated
    and filled on its own side stream, so that the copy orders behind nothing and nothing behind it."""

    def __init__(self, peer_device, own_device) -> None:
        import torch

        for device in (peer_device, own_device):  # contexts first, made with the GIL released
            torch.empty(1, device=device)
        self.streams = (torch.cuda.Stream(peer_device, priority=-1), torch.cuda.Stream(own_device, priority=-1))
        with torch.cuda.stream(self.streams[0]):
            self.source = torch.ones(KEEPALIVE_BYTES, dtype=torch.uint8, device=peer_device)
        with torch.cuda.stream(self.streams[1]):
            self.scratch = torch.empty(KEEPALIVE_BYTES, dtype=torch.uint8, device=own_device)
        self.done = torch.cuda.Event()
        self.done.record(self.streams[1])

    def copy(self) -> None:
        import torch

        # torch runs a cross-device copy on the source device's current stream and makes the
        # destination's current stream wait for it: both are this link's side streams here
        with torch.cuda.stream(self.streams[0]), torch.cuda.stream(self.streams[1]):
            self.scratch.copy_(self.source, non_blocking=True)
            self.done.record(self.streams[1])

    def busy(self) -> bool:
        return not self.done.query()


def gpu_uuid(index: int) -> str:
    """The physical GPU behind a device index of this process ("" when torch cannot say): indices
    differ between processes (CUDA_VISIBLE_DEVICES, containers), UUIDs do not."""
    import torch

    try:
        return str(torch.cuda.get_device_properties(index).uuid)
    except Exception:
        return ""


def local_index(uuid: str) -> int | None:
    """This process's index of the GPU with `uuid`, None when it does not see that GPU."""
    import torch

    if not uuid or not torch.cuda.is_available():
        return None
    for index in range(torch.cuda.device_count()):
        if gpu_uuid(index) == uuid:
            return index
    return None
