"""A stream's second token (the decode's first) follows its first (the prefill's) within a few gateway loop turns,
also when the gateway reads the decode's stream slower than the decode steps.

The gateway holds its event loop COST_MS for every message it sends a client (an injected fault: a saturated
loop), so it reads one decode message a turn while the decode steps several times a turn. Long streams keep the
decode stepping while short requests come and go. Unpaced, the steps the gateway had not read piled up in gRPC's
buffers: every later gap stayed one loop turn, yet each new stream's second token waited behind the whole pile,
which grew with the run (the 3-8 s first gaps of the disaggregated stack at 256 streams on one GPU). Paced, the
decode keeps at most two messages unread and merges the steps made meanwhile into the next one.
"""

import asyncio
import statistics

import grpc
import pytest

from splitserve.common.default_model_path import default_model_path
from splitserve.engine import LLM, SamplingParams
from splitserve.protos import generation_pb2_grpc
from tests.engine.test_engine_exact import make_prompts
from tests.integration.test_chaos import wait_blocks_free
from tests.integration.test_pull_stall import stream
from tests.service_harness import ENGINE, Stack

pytestmark = pytest.mark.slow
NUM_LONG = 3
LONG_TOKENS = 80
NUM_SHORT_SLOTS = 3  # closed loop: each slot sends its next short request when the last one ended
SHORT_TOKENS = 4
NUM_SHORT = 60  # at most; the slots stop when the long streams end
CHECKED_TOKENS = 24  # of each long stream, compared with the in-process engine
COST_MS = 30


@pytest.fixture(scope="module")
def reference():
    prompts = make_prompts(n=NUM_LONG + NUM_SHORT, seed=11, vocab=8192)
    llm = LLM(model=str(default_model_path()), device="cpu", **ENGINE)
    long = SamplingParams(temperature=0, max_tokens=CHECKED_TOKENS, ignore_eos=True)
    short = SamplingParams(temperature=0, max_tokens=SHORT_TOKENS, ignore_eos=True)
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=[long] * NUM_LONG + [short] * NUM_SHORT)
    return prompts, [o.token_ids for o in outs]


def test_a_new_streams_second_token_does_not_wait_behind_steps_the_gateway_has_not_read(reference, tmp_path):
    prompts, greedy = reference
    stack = Stack(
        "shm",
        tmp_path,
        num_decode=1,
        decode_args=["--num-kv-blocks", "2048"],
        gateway_faults=f"message_cost_ms={COST_MS}",
    )
    try:

        async def main():
            async with grpc.aio.insecure_channel(f"127.0.0.1:{stack.grpc_port}") as channel:
                stub = generation_pb2_grpc.GenerationStub(channel)
                await stream(stub, prompts[-1], SHORT_TOKENS, [], [])  # a stack's first hand-off is slow: not measured
                long_tokens, long_arrivals = [[[] for _ in range(NUM_LONG)] for _ in range(2)]
                longs = [
                    asyncio.create_task(stream(stub, prompts[i], LONG_TOKENS, long_tokens[i], long_arrivals[i]))
                    for i in range(NUM_LONG)
                ]
                queue = list(range(NUM_LONG, NUM_LONG + NUM_SHORT))
                shorts: dict[int, tuple[list, list]] = {}

                async def slot() -> None:
                    while queue and not all(t.done() for t in longs):
                        i = queue.pop(0)
                        shorts[i] = ([], [])
                        await stream(stub, prompts[i], SHORT_TOKENS, *shorts[i])

                await asyncio.gather(*longs, *(slot() for _ in range(NUM_SHORT_SLOTS)))
                return long_tokens, long_arrivals, shorts, await wait_blocks_free(stack, timeout_s=15.0)

        long_tokens, long_arrivals, shorts, loads = asyncio.run(main())
    finally:
        stack.stop()
    # one gateway loop turn: the time between two messages of a long stream (each turn sends one)
    turn_s = statistics.median(b - a for arrivals in long_arrivals for (a, _), (b, _) in zip(arrivals, arrivals[1:]))
    first_gaps = {i: arrivals[1][0] - arrivals[0][0] for i, (_, arrivals) in shorts.items()}
    started = min(a[0][0] for a in long_arrivals)
    when = {i: round(shorts[i][1][0][0] - started, 2) for i in first_gaps}
    bound_s = max(1.5, 10 * turn_s)  # a few turns, with the machine's noise
    assert len(first_gaps) >= 2 * NUM_SHORT_SLOTS, f"only {len(first_gaps)} short requests ran"
    assert max(first_gaps.values()) < bound_s, (
        f"first -> second token gaps {sorted((round(g, 2), when[i]) for i, g in first_gaps.items())} "
        f"(gap s, first token at s into the run) against {bound_s:.2f} s; one gateway turn {turn_s * 1e3:.0f} ms"
    )
    assert [t[:CHECKED_TOKENS] for t in long_tokens] == greedy[:NUM_LONG]
    assert all(len(t) == LONG_TOKENS for t in long_tokens)
    assert {i: tokens for i, (tokens, _) in shorts.items()} == {i: greedy[i] for i in shorts}
    assert all(f == t and leases == 0 for f, t, leases in loads.values()), loads
