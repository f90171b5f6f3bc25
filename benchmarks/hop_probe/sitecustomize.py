"""The hand-off hop probe of `benchmarks/handoff_hops.py` (repository only; its folder goes on PYTHONPATH of the
processes that benchmark starts, never of anything else). With HOP_PROBE_DIR set, every process that imports the
decode service or the engine core records `time.perf_counter_ns()` (CLOCK_MONOTONIC on Linux: one clock for every
process of a host) at each hop of a request's hand-off, one line `<ns> <event> <request id>` in
HOP_PROBE_DIR/<pid>.log. It wraps methods once their module is imported; production code has no probe in it.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys
import threading
import time

PROBE_DIR = os.environ.get("HOP_PROBE_DIR")
_lock = threading.Lock()
_log = None


def record(event: str, request_id: str = "") -> None:
    global _log
    now = time.perf_counter_ns()
    with _lock:
        if _log is None:
            _log = open(os.path.join(PROBE_DIR, f"{os.getpid()}.log"), "a", buffering=1)  # noqa: SIM115 - for life
        _log.write(f"{now} {event} {request_id}\n")


def wrap(cls, name: str, before) -> None:
    """Call `before(*args)` ahead of each call of `cls.name`."""
    original = getattr(cls, name)

    def wrapped(*args, **kwargs):
        before(*args, **kwargs)
        return original(*args, **kwargs)

    setattr(cls, name, wrapped)


def _first_time(seen: set, request_id: str) -> bool:
    if request_id in seen:
        return False
    seen.add(request_id)
    return True


def probe_decode_service(module) -> None:
    service = module.DecodeService
    wrap(service, "_admit", lambda self, req, stream: record("service_admit", req.request_id))
    seen: set[str] = set()

    def first_output(self, msg) -> None:
        for out in getattr(msg, "outputs", None) or []:
            if out.new_token_ids and _first_time(seen, out.request_id):
                record("service_first_output", out.request_id)

    wrap(service, "on_core_message", first_output)


def probe_engine_client(module) -> None:
    def import_sent(self) -> None:
        for msg in self._outbox:
            if type(msg).__name__ == "ImportKv":
                record("service_import_sent", msg.request_id)

    wrap(module.EngineClient, "_flush", import_sent)


def probe_core_loop(module) -> None:
    loop = module.CoreLoop

    def import_received(self, msg) -> None:
        if type(msg).__name__ == "ImportKv":
            record("core_import_received", msg.request_id)

    wrap(loop, "handle", import_received)
    step = loop._step

    def probed_step(self) -> None:
        record("step_start")
        step(self)
        batch = self.outbox[-1] if self.outbox else None
        ids = [out.request_id for out in getattr(batch, "outputs", None) or [] if out.new_token_ids]
        record("step_end", ",".join(ids))

    loop._step = probed_step
    wrap(loop, "flush", lambda self: record("core_flush") if self.outbox else None)


def probe_kv_scheduler(module) -> None:
    scheduler = module.KvScheduler
    wrap(scheduler, "_start_load", lambda self, msg, *args: record("core_pull_queued", msg.request_id))
    wrap(scheduler, "_report_load", lambda self, done: record("core_pull_reported", done.transfer.request_id))
    wrap(scheduler, "_commit_here", lambda self, report: record("core_committed", report.request_id))


def probe_mapped_pool(module) -> None:
    connector = module.MappedPoolConnector
    pull = connector.pull

    def probed_pull(self, spec, indices, dst_blocks, target):
        record("pull_start", spec.request_id)
        try:
            return pull(self, spec, indices, dst_blocks, target)
        finally:
            record("pull_end", spec.request_id)

    connector.pull = probed_pull


PROBES = {
    "splitserve.decode_service.server": probe_decode_service,
    "splitserve.engine.core_process.client": probe_engine_client,
    "splitserve.engine.core_process.loop": probe_core_loop,
    "splitserve.engine.core_process.kv_scheduler": probe_kv_scheduler,
    "splitserve.engine.kv_connectors.mapped_pool": probe_mapped_pool,
}


class ProbeFinder(importlib.abc.MetaPathFinder):
    """Finds the probed modules as the other finders do and probes each once it has run."""

    def find_spec(self, name, path, target=None):
        if name not in PROBES:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        execute = spec.loader.exec_module

        def exec_and_probe(module) -> None:
            execute(module)
            PROBES[name](module)

        spec.loader.exec_module = exec_and_probe
        return spec


if PROBE_DIR:
    sys.meta_path.insert(0, ProbeFinder())
