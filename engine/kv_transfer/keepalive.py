"""Keeps the GPU-to-GPU link a decode pulls over from going idle between pulls.

An NVLink path left idle for tens of ms makes its next copy pay ~0.3 ms to wake up (a 256 MiB pull
then runs at ~70% of the back-to-back copy rate; docs/perf.md, "Third look"). With
`--kv-link-keepalive-ms P` a decode copies 1 MiB from a buffer of its own on each peer's device to
one on its own device every P ms, on side streams that no pull or step waits on:

    thread, every P ms:  own buffer on the peer device ──1 MiB──▶ scratch on this device

The buffers are the decode's own (never the peer's pool), so a peer that dies or restarts takes
nothing this copies from with it. A copy still in flight when the next is due is not stacked
behind (the link is busy then anyway).
"""

from __future__ import annotations

import logging
import threading
from typing import Callable

log = logging.getLogger("splitserve.kv")

KEEPALIVE_BYTES = 1 << 20  # a 1 MiB copy wakes the link as fully as a 16 MiB one (kv_copy_clocks --set memory)


class LinkKeepalive:
    """Calls each registered `copy()` every `period_s` on one daemon thread while `busy()` of that
    link is False. The CUDA pieces live in `CudaLink`; this class only schedules."""

    def __init__(self, period_s: float) -> None:
        if not period_s > 0:
            raise ValueError(f"kv_link_keepalive_ms must be > 0 to keep a link awake, got {period_s * 1000:g}")
        self.period_s = period_s
        self.links: dict[str, tuple[Callable[[], None], Callable[[], bool]]] = {}
        self.num_copies = 0
        self.num_skipped = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def add(self, name: str, copy: Callable[[], None], busy: Callable[[], bool]) -> bool:
        """Keep the link `name` awake (once; False when it already is); starts the thread on the first."""
        with self._lock:
            if name in self.links:
                return False
            self.links[name] = (copy, busy)
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="kv-link-keepalive", daemon=True)
            self._thread.start()
        return True

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            with self._lock:
                links = list(self.links.items())
            for name, (copy, busy) in links:
                try:
                    if busy():
                        self.num_skipped += 1
                        continue
                    copy()
                    self.num_copies += 1
                except Exception as exc:  # a broken device must not take the decode down: stop this link
                    log.warning("keep-alive of link %s stopped: %s", name, exc)
                    with self._lock:
                        self.links.pop(name, None)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5 * self.period_s + 1.0)


class CudaLink:
    """The link peer_device -> own_device: 1 MiB between two buffers of this process, issued on side
    streams of both devices so that nothing else orders behind it."""

    def __init__(self, peer_device, own_device) -> None:
        import torch

        self.source = torch.ones(KEEPALIVE_BYTES, dtype=torch.uint8, device=peer_device)
        self.scratch = torch.empty(KEEPALIVE_BYTES, dtype=torch.uint8, device=own_device)
        self.streams = (torch.cuda.Stream(self.source.device), torch.cuda.Stream(self.scratch.device))
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
