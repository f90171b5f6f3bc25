"""More streams than the decode has seats wait before their first token, never between their first and second.

A disaggregated stack whose decode runs at most SEATS sequences gets NUM_STREAMS long greedy streams at once.
Without seat reservations the gateway sent every prompt to the prefill and streamed its first token at once; the
imported requests then queued at the decode behind the seated ones and waited for whole streams to end before their
second token (the 39.7 s first -> second gaps of the 48-streams-over-32-seats row in docs/performance.md). With them,
a request takes a seat on the decode before its prefill: the wait moves into TTFT, and the first -> second gap is a
hand-off. The gateway runs as two processes (`--api-server-count 2`), each stream on a connection of its own (the
kernel spreads them over both): the decode arbitrates the seats of both.
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
SEATS = 4
NUM_STREAMS = 10  # three waves of seats
MAX_TOKENS = 64


@pytest.fixture(scope="module")
def reference():
    prompts = make_prompts(n=NUM_STREAMS, seed=17, vocab=8192)
    llm = LLM(model=str(default_model_path()), device="cpu", **ENGINE)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return prompts, [o.token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=params)]


def test_streams_beyond_the_decodes_seats_wait_before_their_first_token(reference, tmp_path):
    prompts, greedy = reference
    stack = Stack(
        "shm",
        tmp_path,
        num_decode=1,
        decode_args=["--max-num-seqs", str(SEATS)],
        gateway_more=["--api-server-count", "2"],
    )
    try:

        async def main():
            channels = [grpc.aio.insecure_channel(f"127.0.0.1:{stack.grpc_port}") for _ in range(NUM_STREAMS)]
            stubs = [generation_pb2_grpc.GenerationStub(channel) for channel in channels]
            try:
                for stub in stubs[:2]:  # a stack's first hand-offs are slow: not measured
                    await stream(stub, prompts[0], 2, [], [])
                tokens, arrivals = [[[] for _ in range(NUM_STREAMS)] for _ in range(2)]
                runs = [stream(stubs[i], p, MAX_TOKENS, tokens[i], arrivals[i]) for i, p in enumerate(prompts)]
                await asyncio.gather(*runs)
                return tokens, arrivals, await wait_blocks_free(stack, timeout_s=15.0)
            finally:
                for channel in channels:
                    await channel.close()

        tokens, arrivals, loads = asyncio.run(main())
    finally:
        stack.stop()
    assert tokens == greedy
    # a stream's decoding time (second token to last): SEATS of them run at once, NUM_STREAMS / SEATS waves
    decode_s = statistics.median(a[-1][0] - a[1][0] for a in arrivals)
    first_gaps = [round(a[1][0] - a[0][0], 3) for a in arrivals]
    # seated, the gap is one hand-off (a pull and a step); queued behind seated streams, it was at least one whole
    # stream's decoding time (up to two here, for the third wave)
    bound_s = decode_s / 3
    assert max(first_gaps) < bound_s, (
        f"first -> second token gaps {first_gaps} s against {bound_s:.2f} s (a third of a stream's "
        f"{decode_s:.2f} s of decoding)"
    )
    starts = sorted(round(a[0][0] - arrivals[0][0][0], 2) for a in arrivals)
    assert starts[-1] > decode_s / 2, f"the last wave's first token came with the first wave's: {starts}"
    assert all(f == t and leases == 0 for f, t, leases in loads.values()), loads
