"""A hung engine core is noticed: the prefill's core stopped (SIGSTOP) stops answering, its service says so after
--core-stall-timeout-s (health NOT_SERVING, Describe UNAVAILABLE), fails the Prefill calls waiting on it, and the
gateway serves every request through a local prefill on the decode meanwhile; once the core runs again the prefill
serves again."""

import os
import signal
import time
from pathlib import Path

import httpx
import pytest

from splitserve.common.default_model_path import default_model_path
from splitserve.engine import LLM, SamplingParams
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
        # the silence counts from the core's last message: up to HEARTBEAT_S (1 s) + an idle wait (0.5 s) early
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
        try:
            os.kill(core, signal.SIGCONT)
        except ProcessLookupError:
            pass
        stack.stop()
