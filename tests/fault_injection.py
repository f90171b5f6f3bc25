"""Faults the tests inject into service processes by wrapping the transport and the pull control.

`install("name=N,...")` registers, for every transport, a connector wrapping the real one (KV faults) or
replaces a method with a wrapper (the rest), misbehaving N times (or with N as a parameter), then behaving as
the original. Loaded through tests/faults/sitecustomize.py in the
processes a test starts with `faults=`; production code has no branch for any of them.

| fault | process | wraps | does |
|---|---|---|---|
| pull_delay_ms=N | decode core | `KvConnector.pull` | sleeps N ms before every pull |
| pull_drop=N | decode core | `KvConnector.pull` | the first N pulls raise |
| send_kill_after_blocks=N | prefill core | `KvConnector.send` | kills the process group past N blocks sent |
| corrupt_epoch=N | decode core | `KvScheduler.lease_held` | the first N ended pulls check a wrong epoch |
| release_hold=N | prefill service | `PrefillService.ReleaseKv` | the first N calls wait for SIGUSR1, then release |
| message_cost_ms=N | gateway | `RequestRun._delta_message` | holds the event loop N ms per message (a busy gateway) |
| slow_prefill_ms=N | engine core | `EngineCore.step` | the first step over 64 tokens runs N ms more (long prefill) |
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import os
import signal
import time

log = logging.getLogger("splitserve.test.faults")
FAULTS = (
    "pull_delay_ms",
    "pull_drop",
    "send_kill_after_blocks",
    "corrupt_epoch",
    "release_hold",
    "message_cost_ms",
    "slow_prefill_ms",
)


def parse(spec: str) -> dict[str, int]:
    """`name=N,...` -> {name: N}; unknown names raise, naming the known ones."""
    faults: dict[str, int] = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        name, _, value = item.partition("=")
        if name not in FAULTS or not value.isdigit():
            raise ValueError(f"fault {item!r} is not NAME=N with NAME one of {', '.join(FAULTS)}")
        faults[name] = int(value)
    return faults


def install(spec: str) -> None:
    faults = parse(spec)
    if {"pull_delay_ms", "pull_drop", "send_kill_after_blocks"} & faults.keys():
        from splitserve.engine.kv_connectors import factory

        real_class = factory.connector_class

        @functools.cache
        def faulty_class(transport: str):
            connector = real_class(transport)
            faulty = type(f"Faulty{connector.__name__}", (connector,), {})  # what make_connector now builds
            _wrap_pull(faulty, faults.get("pull_delay_ms", 0), faults.get("pull_drop", 0))
            if faults.get("send_kill_after_blocks"):
                _wrap_send(faulty, faults["send_kill_after_blocks"])
            return faulty

        factory.connector_class = faulty_class
    if faults.get("corrupt_epoch"):
        from splitserve.engine.core_process.kv_scheduler import KvScheduler

        _wrap_lease_held(KvScheduler, faults["corrupt_epoch"])
    if faults.get("release_hold"):
        from splitserve.prefill_service.server import PrefillService

        _wrap_release_kv(PrefillService, faults["release_hold"])
    if faults.get("message_cost_ms"):
        from splitserve.gateway.request_run import RequestRun

        _wrap_delta_message(RequestRun, faults["message_cost_ms"])
    if faults.get("slow_prefill_ms"):
        from splitserve.engine.engine_core import EngineCore

        _wrap_step(EngineCore, faults["slow_prefill_ms"])
    log.warning("test faults installed in pid %d: %s", os.getpid(), faults)


def _wrap_pull(cls, delay_ms: int, drops: int) -> None:
    original = cls.pull
    left = [drops]

    @functools.wraps(original)
    def pull(self, spec, indices, dst_blocks, target):
        if indices and delay_ms:
            time.sleep(delay_ms / 1000)
        if indices and left[0] > 0:
            left[0] -= 1
            raise RuntimeError("injected fault: pull dropped")
        return original(self, spec, indices, dst_blocks, target)

    cls.pull = pull


def _wrap_send(cls, kill_after_blocks: int) -> None:
    original = cls.send
    sent = [0]

    @functools.wraps(original)
    def send(self, pair, block_ids, kv_cache, tag=0):
        if sent[0] + len(block_ids) > kill_after_blocks:
            log.warning("injected fault: killing this service after %d blocks sent", sent[0])
            os.killpg(os.getpgrp(), signal.SIGKILL)
        sent[0] += len(block_ids)
        return original(self, pair, block_ids, kv_cache, tag)

    cls.send = send


def _wrap_lease_held(cls, corruptions: int) -> None:
    """The first `corruptions` ended pulls that carry a lease slot are checked against a wrong epoch (the core reads
    the slot as it sees the copy end; a lease it finds lost is not looked at again)."""
    original = cls.lease_held
    left = [corruptions]

    @functools.wraps(original)
    def lease_held(self, spec):
        if spec.lease is not None and left[0] > 0:
            left[0] -= 1
            wrong = dataclasses.replace(spec.lease, epoch=spec.lease.epoch + 1_000_000)  # an epoch never issued
            spec = dataclasses.replace(spec, lease=wrong)
        return original(self, spec)

    cls.lease_held = lease_held


def _wrap_release_kv(cls, holds: int) -> None:
    original = cls.ReleaseKv
    left = [holds]
    told = []  # set by SIGUSR1, whenever it comes (before or after the call it frees)
    signal.signal(signal.SIGUSR1, lambda signum, frame: told.append(signum))

    @functools.wraps(original)
    async def release_kv(self, request, context):
        if left[0] > 0:
            left[0] -= 1
            log.warning("injected fault: ReleaseKv of lease %s held until SIGUSR1", request.lease_id)
            while not told:
                await asyncio.sleep(0.01)
        return await original(self, request, context)

    cls.ReleaseKv = release_kv


def _wrap_delta_message(cls, cost_ms: int) -> None:
    """Every decode delta a request run turns into a client message holds the loop `cost_ms` (a sleep, not a
    spin: the time is the loop's, the machine's cores stay free), as a gateway whose loop is saturated spends."""
    original = cls._delta_message

    @functools.wraps(original)
    def delta_message(self, delta):
        time.sleep(cost_ms / 1000)
        return original(self, delta)

    cls._delta_message = delta_message


def _wrap_step(cls, extra_ms: int) -> None:
    """The first step that takes in more than 64 tokens runs `extra_ms` longer (a sleep: the GIL is free, as in
    torch's kernels), as a long prompt's prefill on a slow CPU does, after steps far shorter."""
    original = cls.step
    slowed = False

    @functools.wraps(original)
    def step(self):
        nonlocal slowed
        outputs = original(self)
        if not slowed and self.last_step_num_tokens > 64:
            slowed = True
            time.sleep(extra_ms / 1000)
        return outputs

    cls.step = step
