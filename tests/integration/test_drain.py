"""SIGTERM drains: in-flight requests finish, new ones are refused or routed elsewhere, exit 0."""

import asyncio
import signal
import time

import pytest

from splitserve.common.default_model_path import default_model_path
from splitserve.engine import LLM, SamplingParams
from splitserve.protos import common_pb2, decode_pb2_grpc
from tests.integration.test_chaos import generate, wait_blocks_free
from tests.service_client import describe
from tests.service_harness import ENGINE, Stack, wait_until_async

pytestmark = pytest.mark.slow


async def wait_running(stack, expected, timeout_s: float = 30.0) -> None:
    """Until `expected(running per decode)` holds, from each decode's Describe."""
    last = []

    async def running():
        last[:] = [[(await describe(a, decode_pb2_grpc.DecodeStub)).load.num_running for a in stack.decodes]]
        return expected(last[0])

    await wait_until_async(running, timeout_s, lambda: f"requests running per decode: {last[0]}")


def test_sigterm_on_a_decode_finishes_its_requests_then_exits(tmp_path):
    stack = Stack("shm", tmp_path, num_decode=2)
    try:

        async def main():
            jobs = [
                asyncio.create_task(generate(stack.grpc_port, list(range(50 + i, 80 + i)), max_tokens=120))
                for i in range(4)
            ]
            # all four are decoding, on both decodes (120 tokens each: still running at the SIGTERM)
            await wait_running(stack, lambda running: sum(running) == 4 and all(running))
            stack.procs["decode-1"].popen.send_signal(signal.SIGTERM)  # the service process only, as k8s does
            results = await asyncio.gather(*jobs)
            after = await generate(stack.grpc_port, list(range(7, 30)), max_tokens=8)
            return results, after

        results, after = asyncio.run(main())
        assert all(
            tokens is not None and len(tokens) == 120 and last.finish_reason == common_pb2.FINISH_REASON_LENGTH
            for tokens, last in results
        )  # nothing in flight was lost
        assert after[1].finish_reason == common_pb2.FINISH_REASON_LENGTH  # served by the other decode
        proc = stack.procs["decode-1"].popen
        proc.wait(timeout=20)
        assert proc.returncode == 0
    finally:
        stack.stop()


def test_sigterm_on_a_decode_while_it_pulls_a_requests_kv_finishes_that_request_then_exits(tmp_path):
    """Drain while loading: the decode's pulls take 3 s (an injected delay); SIGTERM comes once the decode has
    admitted the request, before its KV is in. The pull ends, the lease is released, the request runs to its end
    with the reference tokens, and only then does the decode exit 0; the prefill gets every block back."""
    prompt = list(range(40, 70))
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    (expected,) = LLM(model=str(default_model_path()), device="cpu", **ENGINE).generate(
        prompt_token_ids=[prompt], sampling_params=params
    )
    stack = Stack("shm", tmp_path, num_decode=1, decode_faults="pull_delay_ms=3000")
    try:

        async def main():
            job = asyncio.create_task(generate(stack.grpc_port, prompt, max_tokens=12))

            async def admitted():
                decode = await describe(stack.decodes[0], decode_pb2_grpc.DecodeStub)
                return decode.counters.get("requests_received", 0) == 1

            await wait_until_async(admitted, 30, "the decode never admitted the request")
            stack.procs["decode-0"].popen.send_signal(signal.SIGTERM)  # its pull is still in its 3 s delay
            tokens, last = await job
            loads = await wait_blocks_free(stack, timeout_s=10.0, skip=("decode-0",))
            prefill = await describe(stack.prefill[1])
            return tokens, last, loads, prefill

        tokens, last, loads, prefill = asyncio.run(main())
        assert tokens == expected.token_ids and last.finish_reason == common_pb2.FINISH_REASON_LENGTH
        proc = stack.procs["decode-0"].popen
        proc.wait(timeout=20)
        assert proc.returncode == 0
        free, total, leases = loads["prefill"]
        assert (free, leases) == (total, 0), loads  # every block back, the lease released (not expired)
        assert "leases_expired" not in prefill.counters
    finally:
        stack.stop()


def test_sigterm_on_the_gateway_lets_streams_finish(tmp_path):
    stack = Stack("shm", tmp_path, num_decode=1)
    try:

        async def main():
            job = asyncio.create_task(generate(stack.grpc_port, list(range(60, 90)), max_tokens=100))
            await wait_running(stack, lambda running: running == [1])  # the stream is decoding
            stack.procs["gateway"].popen.send_signal(signal.SIGTERM)
            return await job

        started = time.monotonic()
        tokens, last = asyncio.run(main())
        assert tokens is not None and len(tokens) == 100 and last.finish_reason == common_pb2.FINISH_REASON_LENGTH
        stack.procs["gateway"].popen.wait(timeout=20)
        assert stack.procs["gateway"].popen.returncode == 0
        assert time.monotonic() - started < 40
    finally:
        stack.stop()
