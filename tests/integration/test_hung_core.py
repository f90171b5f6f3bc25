"""A hung engine core is noticed: the prefill's core stopped (SIGSTOP) stops answering, its service says so after
--core-stall-timeout-s (health NOT_SERVING, Describe UNAVAILABLE), fails the Prefill calls waiting on it, and the
gateway serves every request through a local prefill on the decode meanwhile; once the core runs again the prefill
serves again. Before that timeout, a core silent for longer than it ever is while running is suspect: the prefill
hands the requests waiting on it back, and the gateway serves them on another prefill at once."""

import asyncio
import contextlib
import os
import signal
import time
from pathlib import Path

import httpx
import pytest

from splitserve.common.default_model_path import default_model_path
from splitserve.engine import LLM, SamplingParams
from splitserve.protos import decode_pb2_grpc
from tests.service_client import describe
from tests.service_harness import ENGINE, Stack, wait_until

pytestmark = pytest.mark.slow
STALL_TIMEOUT_S = 2.0
PROMPTS = ["def fibonacci(n):", "import os\n", "class Tree:"]


def core_pid(service_pid: int) -> int:
    """The engine core process a service started (multiprocessing's spawned child)."""
    for child in Path(f"/proc/{service_pid}/task/{service_pid}/children").read_text().split():
        if b"spawn_main" in Path(f"/proc/{child}/cmdline").read_bytes():
            return int(child)
    raise AssertionError(f"service {service_pid} has no engine core child")


@pytest.fixture(scope="module")
def reference():
    llm = LLM(model=str(default_model_path()), device="cpu", **ENGINE)
    try:
        outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
        return [o.text for o in outs]
    finally:
        llm.close()


def complete(stack, prompt: str) -> tuple[str, float]:
    start = time.monotonic()
    body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    r = httpx.post(f"http://127.0.0.1:{stack.http_port}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"], time.monotonic() - start


def test_a_stopped_prefill_core_is_routed_around_and_serves_again(tmp_path, reference):
    stack = Stack("shm", tmp_path, num_decode=1, prefill_args=["--core-stall-timeout-s", str(STALL_TIMEOUT_S)])
    prefill = stack.procs["prefill"]
    core = core_pid(prefill.popen.pid)
    try:
        assert complete(stack, PROMPTS[0])[0] == reference[0]
        core_stopped = time.monotonic()
        os.kill(core, signal.SIGSTOP)
        # sent at once: its Prefill call waits on the stopped core until the service gives up on it
        text, took = complete(stack, PROMPTS[1])
        assert text == reference[1]
        # the silence counts from the core's last message: up to HEARTBEAT_S (0.5 s) + an idle wait (0.5 s) early
        assert STALL_TIMEOUT_S - 1.5 <= took < STALL_TIMEOUT_S + 5, took
        log = prefill.log_path
        wait_until(
            lambda: "its engine core has not answered for" in log.read_text(),
            10,
            lambda: "the prefill did not report its hung core:\n" + log.read_text()[-2000:],
        )
        text, took = complete(stack, PROMPTS[2])  # routed around the prefill: no wait for the stopped core
        assert (text, took < 2.0) == (reference[2], True), took
        assert time.monotonic() - core_stopped < 30
        os.kill(core, signal.SIGCONT)
        wait_until(
            lambda: "its engine core answers again" in log.read_text(),
            10,
            lambda: "the prefill did not serve again:\n" + log.read_text()[-2000:],
        )
        stack.wait_ready()
        assert complete(stack, PROMPTS[0])[0] == reference[0]
        assert prefill.popen.poll() is None  # the service lived through it
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(core, signal.SIGCONT)
        stack.stop()


def idle(stack) -> bool:
    """Every instance's blocks free (or evictable in its prefix cache), nothing running or waiting, no lease."""

    async def loads():
        prefills = [(await describe(address)).load for _, address in stack.prefills]
        decode = (await describe(stack.decodes[0], decode_pb2_grpc.DecodeStub)).load
        return [*prefills, decode]

    return all(
        load.num_free_blocks == load.num_total_blocks and not (load.num_running or load.num_waiting or load.num_leases)
        for load in asyncio.run(loads())
    )


def test_the_first_request_on_a_stopped_prefill_is_served_by_another_at_once(tmp_path, reference):
    stall_timeout_s = 20.0  # what the first request waited before: its answer must come in a third of it
    stack = Stack(
        "shm", tmp_path, num_decode=1, num_prefill=2, prefill_args=["--core-stall-timeout-s", str(stall_timeout_s)]
    )
    stopped = stack.procs["prefill"]  # listed first: with both idle and nothing cached, the router picks it
    core = core_pid(stopped.popen.pid)
    try:
        assert complete(stack, PROMPTS[0])[0] == reference[0]
        os.kill(core, signal.SIGSTOP)
        # sent at once: its core turns suspect (silent past what a running core ever is) well before the stall
        # timeout; the request is handed back and served on the other prefill
        for prompt, expected in zip(PROMPTS[1:], reference[1:]):
            text, took = complete(stack, prompt)
            assert (text, took < stall_timeout_s / 3) == (expected, True), took
        assert "as if hung; try another instance" in stopped.log_path.read_text()
        assert "has not answered for" not in stopped.log_path.read_text()  # not yet taken as hung
        os.kill(core, signal.SIGCONT)
        # the handed-back request's abort reached the core: every block is free again, on every instance
        wait_until(lambda: idle(stack), 20, "blocks still held after the core ran again")
        assert complete(stack, PROMPTS[0])[0] == reference[0]
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(core, signal.SIGCONT)
        stack.stop()
