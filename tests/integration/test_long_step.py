"""A prefill whose core is busy in one long step (a long prompt on a slow CPU, far longer than its steps so far)
serves the request: the core's heartbeat goes on within the step, so the service does not take its core for a
hung one and hand the request back."""

import asyncio
import time

import pytest

from splitserve.common.default_model_path import default_model_path
from splitserve.protos import common_pb2, prefill_pb2
from tests.service_client import prefill_stub
from tests.service_harness import ENGINE, start_service, stop_all

pytestmark = pytest.mark.slow
SLOW_MS = 3000  # past the service's suspect bound (1.75 s, or twice the longest recent step)


def test_a_prefill_busy_in_one_long_step_serves_the_request(tmp_path):
    prefill, address = start_service(
        "prefill",
        default_model_path(),
        tmp_path,
        "prefill",
        service_args=["--kv-transport", "shm"],
        faults=f"slow_prefill_ms={SLOW_MS}",
        **ENGINE,
    )
    try:
        prefill.wait_ready()

        async def call(request_id: str, prompt: list[int]) -> tuple[prefill_pb2.PrefillResponse, float]:
            start = time.monotonic()
            request = prefill_pb2.PrefillRequest(
                request_id=request_id,
                prompt_token_ids=prompt,
                sampling=common_pb2.SamplingParams(temperature=0.0, max_tokens=4),
            )
            answer = await prefill_stub(address).Prefill(request, timeout=60)
            return answer, time.monotonic() - start

        short, _ = asyncio.run(call("short", [5, 6, 7, 8]))  # steps of a few tokens: the core's recent steps
        long, took = asyncio.run(call("long", [5 + i % 200 for i in range(100)]))  # one step of 100 tokens
        assert took >= SLOW_MS / 1000, took  # the step was slowed
        assert (short.kv.num_tokens, long.kv.num_tokens) == (4, 100)
        assert "as if hung" not in prefill.log_path.read_text()
    finally:
        stop_all([prefill])
