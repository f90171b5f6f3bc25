"""A prefill that stops answering mid-hand-off stalls only its own request.

Four long greedy streams decode while one more request's prefill process is stopped (SIGSTOP) right after its
first token, before the decode's pull of its KV has begun (the decode's pulls wait 0.5 s first: an injected
delay). The pull's receive (gloo: the nccl transport on CPU) then waits on a worker thread until the transfer
timeout while the decode's core loop keeps stepping: no running stream goes 0.5 s without a token, and the
stopped request ends by the failure policy once the timeout has passed: recompute (the decode prefills it itself,
the greedy tokens) or fail (its first token, then the pull's error).
"""

import asyncio
import os
import re
import signal
import time

import grpc
import pytest

from splitserve.common.default_model_path import default_model_path
from splitserve.engine import LLM, SamplingParams
from splitserve.protos import common_pb2, decode_pb2_grpc, generation_pb2, generation_pb2_grpc
from tests.engine.test_engine_exact import make_prompts
from tests.integration.test_chaos import wait_blocks_free
from tests.service_client import describe
from tests.service_harness import ENGINE, Stack, wait_until_async

pytestmark = pytest.mark.slow
NUM_RUNNING = 4
RUNNING_TOKENS = 900  # 15-20 s of steps here: they outlast the stall (0.5 s delay + 2 s timeout + 1 s release)
VICTIM_TOKENS = 12
CHECKED_TOKENS = 40  # of each running stream, compared with the in-process engine
TIMEOUT_S = 2.0
MAX_GAP_S = 0.5


@pytest.fixture(scope="module")
def reference():
    prompts = make_prompts(n=NUM_RUNNING + 1, seed=5, vocab=8192)
    llm = LLM(model=str(default_model_path()), device="cpu", **ENGINE)
    params = SamplingParams(temperature=0, max_tokens=CHECKED_TOKENS, ignore_eos=True)
    return prompts, [o.token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=params)]


async def stream(
    stub, prompt: list[int], max_tokens: int, tokens: list, arrivals: list, on_first=None, errors=None
) -> None:
    """Greedy tokens of one request into `tokens`; each message's arrival (monotonic s, tokens so far) into
    `arrivals` (kept when the request is cancelled). An error ends it: raised, or noted in `errors` when given."""
    request = generation_pb2.GenerateRequest(
        token_ids=generation_pb2.TokenIds(ids=prompt),
        sampling=common_pb2.SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
    )
    async for message in stub.Generate(request, timeout=120):
        tokens.extend(message.token_ids)
        arrivals.append((time.monotonic(), len(tokens)))
        if on_first is not None and len(arrivals) == 1:
            on_first()
        if message.error:
            if errors is None:
                raise AssertionError(f"request failed: {message.error}")
            errors.append(message.error)


def largest_gap(arrivals: list, start: float, end: float) -> float:
    """The longest time between two token messages, counting the gaps that overlap [start, end]."""
    times = [t for t, _ in arrivals]
    return max((b - a for a, b in zip(times, times[1:]) if b > start and a < end), default=float("inf"))


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_running_streams_keep_their_pace_while_a_stopped_prefill_stalls_a_pull(reference, tmp_path, policy):
    prompts, greedy = reference
    timeout = ["--kv-transfer-timeout-s", str(TIMEOUT_S)]
    stack = Stack(
        "nccl",
        tmp_path,
        num_decode=1,
        prefill_args=[*timeout, "--lease-s", "5"],  # the stopped request's lease is never released: it expires
        # room for the long streams (the last --num-kv-blocks counts)
        decode_args=[*timeout, "--num-kv-blocks", "2048", "--kv-load-failure-policy", policy],
        decode_faults="pull_delay_ms=500",
    )
    prefill_pid = stack.procs["prefill"].popen.pid
    stopped_at: list[float] = []
    errors: list[str] = []  # the stopped request's

    def stop_prefill() -> None:  # the victim's first token has reached the client: stop its prefill
        os.killpg(prefill_pid, signal.SIGSTOP)
        stopped_at.append(time.monotonic())

    try:

        async def main():
            async with grpc.aio.insecure_channel(f"127.0.0.1:{stack.grpc_port}") as channel:
                stub = generation_pb2_grpc.GenerationStub(channel)
                tokens, arrivals = [[[] for _ in range(NUM_RUNNING)] for _ in range(2)]
                running = [
                    asyncio.create_task(stream(stub, prompts[i], RUNNING_TOKENS, tokens[i], arrivals[i]))
                    for i in range(NUM_RUNNING)
                ]

                async def all_decoding() -> bool:
                    assert not any(t.done() for t in running), [t.exception() for t in running if t.done()]
                    return all(a and a[-1][1] >= 5 for a in arrivals)

                await wait_until_async(
                    all_decoding,
                    30,
                    lambda: f"5 tokens on every running stream; so far {[a[-1][1] if a else 0 for a in arrivals]}",
                )
                victim: list[int] = []
                await stream(stub, prompts[-1], VICTIM_TOKENS, victim, [], on_first=stop_prefill, errors=errors)
                ended_at = time.monotonic()
                os.killpg(prefill_pid, signal.SIGCONT)
                assert not any(t.done() for t in running), "a running stream ended before the stall did"
                for task in running:
                    task.cancel()
                await asyncio.gather(*running, return_exceptions=True)
                decode = await describe(stack.decodes[0], decode_pb2_grpc.DecodeStub)
                loads = await wait_blocks_free(stack, timeout_s=15.0)
                return tokens, arrivals, victim, ended_at, decode, loads

        tokens, arrivals, victim, ended_at, decode, loads = asyncio.run(main())
        (stopped,) = stopped_at
        gaps = [largest_gap(a, stopped, ended_at) for a in arrivals]
        assert max(gaps) < MAX_GAP_S, f"gaps {gaps} while the prefill was stopped for {ended_at - stopped:.2f} s"
        assert all(sum(1 for t, _ in a if stopped < t < ended_at) >= 10 for a in arrivals)  # tokens all along
        assert TIMEOUT_S <= ended_at - stopped < TIMEOUT_S + 10  # it ended by the policy, after the timeout
        if policy == "recompute":
            assert victim == greedy[-1][:VICTIM_TOKENS] and errors == []  # recomputed on the decode: same tokens
        else:
            assert victim == greedy[-1][:1]  # the prefill's first token, then the pull's error
            (error,) = errors  # gloo's own words for the receive that timed out
            pattern = r"decode instance decode-0@\d+: KV pull from prefill failed: .*Timed out waiting 2000ms for recv"
            assert re.match(pattern, error), error
        assert [t[:CHECKED_TOKENS] for t in tokens] == greedy[:NUM_RUNNING]
        recomputes = 1 if policy == "recompute" else 0
        assert (decode.counters["kv_pull_failures"], decode.counters["kv_pull_recomputes"]) == (1, recomputes)
        assert all(f == t and leases == 0 for f, t, leases in loads.values()), loads
    finally:
        os.killpg(prefill_pid, signal.SIGCONT)
        stack.stop()
