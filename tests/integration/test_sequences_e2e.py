"""n and best_of through the real stack (gateway + engines as processes, the default model in float64),
disaggregated (prefill + decode over shm) and colocated (one worker): every sequence's exact tokens
equal the in-process engine's for its derived seed, best_of returns the sequence of highest cumulative
logprob, and every block is back on every instance when the sequences end or the client leaves."""

import asyncio

import grpc
import httpx
import openai
import pytest

from splitserve.common.default_model_path import default_model_path
from splitserve.engine import LLM, SamplingParams
from splitserve.protos import common_pb2, decode_pb2_grpc, generation_pb2, generation_pb2_grpc, prefill_pb2_grpc
from tests.engine.test_engine_exact import make_prompts
from tests.service_client import describe
from tests.service_harness import ENGINE, Proc, Stack, free_port, start_service, wait_until

pytestmark = pytest.mark.slow
MAX_TOKENS = 6
SEED = 1234
SEEDED = dict(temperature=1.0, top_k=50, max_tokens=MAX_TOKENS, ignore_eos=True)
GREEDY = dict(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def reference():
    """The in-process engine: prompt 0's greedy tokens, and its seeded tokens and cumulative logprob for
    seeds SEED, SEED + 1, SEED + 2 (what sequences 0, 1, 2 of one request with seed SEED must give)."""
    llm = LLM(model=str(default_model_path()), device="cpu", **ENGINE)
    prompt = make_prompts(vocab=8192)[0]
    (greedy,) = llm.generate(prompt_token_ids=[prompt], sampling_params=SamplingParams(**GREEDY))
    seeded = llm.generate(
        prompt_token_ids=[prompt] * 3,
        sampling_params=[SamplingParams(**SEEDED, seed=SEED + i, logprobs=0) for i in range(3)],
    )
    return prompt, greedy.token_ids, [(o.token_ids, sum(lp.logprob for lp in o.logprobs)) for o in seeded]


class Colocated:
    """One worker (prefill and decode in one engine) behind a gateway."""

    def __init__(self, logs):
        worker, self.worker = start_service("worker", default_model_path(), logs, "worker-0", **ENGINE)
        self.grpc_port, self.http_port = free_port(), free_port()
        ports = ["--grpc-port", str(self.grpc_port), "--http-port", str(self.http_port)]
        self.gateway = Proc("gateway", [*ports, "--decode", self.worker, "--health-interval-s", "0.2"], logs, "gateway")
        self.procs = [worker, self.gateway]
        worker.wait_ready()
        wait_until(self._ready, 60, "the colocated gateway never became ready")

    def _ready(self) -> bool:
        try:
            return httpx.get(f"http://127.0.0.1:{self.http_port}/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    async def free_blocks(self):
        d = await describe(self.worker, decode_pb2_grpc.DecodeStub)
        return [(d.load.num_free_blocks, d.load.num_total_blocks)]

    def stop(self):
        for proc in self.procs:
            proc.stop()


@pytest.fixture(scope="module", params=["disaggregated", "colocated"])
def stack(request, tmp_path_factory):
    logs = tmp_path_factory.mktemp(f"sequences-{request.param}")
    if request.param == "colocated":
        s = Colocated(logs)
    else:
        s = Stack("shm", logs, num_decode=1)

        async def free_blocks():
            p = await describe(s.prefill[1], prefill_pb2_grpc.PrefillStub)
            d = await describe(s.decodes[0], decode_pb2_grpc.DecodeStub)
            return [
                (p.load.num_free_blocks, p.load.num_total_blocks),
                (d.load.num_free_blocks, d.load.num_total_blocks),
            ]

        s.free_blocks = free_blocks
    yield s
    s.stop()


async def sequences(port, prompt, n=None, best_of=None, **sampling) -> tuple[dict[int, list[int]], list]:
    """Each index's token ids, and every message, of one request through the gateway's gRPC API."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        request = generation_pb2.GenerateRequest(
            token_ids=generation_pb2.TokenIds(ids=prompt), sampling=common_pb2.SamplingParams(**sampling)
        )
        if n is not None:
            request.n = n
        if best_of is not None:
            request.best_of = best_of
        messages = [m async for m in generation_pb2_grpc.GenerationStub(channel).Generate(request, timeout=120)]
    tokens: dict[int, list[int]] = {}
    for m in messages:
        tokens.setdefault(m.index, []).extend(m.token_ids)
    return tokens, messages


def wait_all_free(stack):
    last = []

    def all_free():
        last[:] = [asyncio.run(stack.free_blocks())]
        return all(f == t for f, t in last[0])

    wait_until(all_free, 15, lambda: f"blocks still held: (free, total) = {last[0]}")


def test_greedy_sequences_are_identical(stack, reference):
    """A deliberate difference from vLLM, which refuses greedy n > 1 ("n must be 1 when using greedy
    sampling"): OpenAI's API answers it with n identical choices, and clients written for OpenAI send it.
    Every request vLLM answers gets vLLM's answer here; this one request vLLM refuses is answered."""
    prompt, greedy, _ = reference
    tokens, messages = asyncio.run(sequences(stack.grpc_port, prompt, n=3, **GREEDY))
    assert tokens == {0: greedy, 1: greedy, 2: greedy}
    assert sorted(m.index for m in messages if m.finish_reason) == [0, 1, 2]
    wait_all_free(stack)


def test_seeded_sequences_equal_separate_requests_with_the_derived_seeds(stack, reference):
    """Disaggregated, the sequences fork from the KV the decode pulled through its connector: nothing of the
    prompt computed on the decode (no local prefill, no recompute, no fork prefilling it: no prefix lookup)."""
    prompt, _, seeded = reference
    before = asyncio.run(decode_counters(stack))
    tokens, _ = asyncio.run(sequences(stack.grpc_port, prompt, n=3, seed=SEED, **SEEDED))
    assert tokens == {i: seeded[i][0] for i in range(3)}
    assert len({tuple(t) for t, _ in seeded}) == 3  # the derived seeds do give three different sequences
    if isinstance(stack, Stack):
        after = asyncio.run(decode_counters(stack))
        keys = ("prompt_tokens", "prefix_query_tokens", "kv_pull_failures", "kv_pull_recomputes")
        assert {k: after.get(k, 0) - before.get(k, 0) for k in keys} == dict.fromkeys(keys, 0)
        # the blocks past what the decode caches from earlier tests' pulls of this prompt
        pulled = after.get("kv_blocks_pulled", 0) - before.get("kv_blocks_pulled", 0)
        assert 0 <= pulled <= -(-len(prompt) // ENGINE["block_size"])
    wait_all_free(stack)


async def decode_counters(stack) -> dict[str, int]:
    address = stack.decodes[0] if isinstance(stack, Stack) else stack.worker
    return dict((await describe(address, decode_pb2_grpc.DecodeStub)).counters)


def test_best_of_returns_the_sequence_of_highest_cumulative_logprob(stack, reference):
    prompt, _, seeded = reference
    best = max(range(3), key=lambda i: (seeded[i][1], -i))
    tokens, messages = asyncio.run(sequences(stack.grpc_port, prompt, best_of=3, seed=SEED, **SEEDED))
    assert tokens == {0: seeded[best][0]} and len(messages) == 1 and not messages[0].logprobs
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{stack.http_port}/v1", api_key="unused", max_retries=0)
    r = client.completions.create(
        model="default_model",
        prompt=prompt,
        n=2,
        best_of=3,
        seed=SEED,
        logprobs=0,
        max_tokens=MAX_TOKENS,
        temperature=1.0,
        extra_body={"top_k": 50, "ignore_eos": True},
    )
    ranked = sorted(range(3), key=lambda i: (-seeded[i][1], i))[:2]
    assert [sum(c.logprobs.token_logprobs) for c in r.choices] == pytest.approx([seeded[i][1] for i in ranked])
    assert r.usage.completion_tokens == 2 * MAX_TOKENS
    wait_all_free(stack)


def test_a_client_leaving_mid_stream_frees_every_block(stack, reference):
    prompt, _, _ = reference
    body = {"prompt": prompt, "max_tokens": 300, "temperature": 0, "ignore_eos": True, "stream": True, "n": 3}
    with httpx.stream("POST", f"http://127.0.0.1:{stack.http_port}/v1/completions", json=body, timeout=60) as r:
        seen = set()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                seen.add(line.split('"index":', 1)[1].split(",", 1)[0])
            if len(seen) == 3:
                break  # every sequence streams: leave
    assert seen == {"0", "1", "2"}
    wait_all_free(stack)


def test_every_choice_carries_the_prompt_logprobs_computed_once(stack, reference):
    prompt, greedy, _ = reference
    body = {"prompt": prompt, "n": 2, "prompt_logprobs": 1, "echo": True, **GREEDY}
    r = httpx.post(f"http://127.0.0.1:{stack.http_port}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    first, second = r.json()["choices"]
    assert first["prompt_logprobs"] is not None and len(first["prompt_logprobs"]) == len(prompt)
    assert (second["prompt_logprobs"], second["text"]) == (first["prompt_logprobs"], first["text"])
    wait_all_free(stack)


def test_structured_output_holds_for_every_sequence(stack):
    """Each forked sequence starts its own grammar matcher: every choice is one of the allowed answers."""
    allowed = ["red", "green", "blue"]
    body = {
        "prompt": "The colour is",
        "n": 3,
        "seed": 5,
        "temperature": 1.0,
        "max_tokens": 8,
        "structured_outputs": {"choice": allowed},
    }
    r = httpx.post(f"http://127.0.0.1:{stack.http_port}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2]
    assert all(c["text"] in allowed and c["finish_reason"] == "stop" for c in choices), choices
    wait_all_free(stack)
