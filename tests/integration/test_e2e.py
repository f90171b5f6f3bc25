"""The whole stack as real processes on loopback: gateway + prefill + 2 decodes, the default
model in float64, per KV transport. Tokens through the gateway equal the in-process engine's."""

import asyncio
import time

import grpc
import httpx
import pytest

from splitserve.common.default_model_path import default_model_path
from splitserve.engine import LLM, SamplingParams
from splitserve.protos import common_pb2, decode_pb2_grpc, generation_pb2, generation_pb2_grpc
from tests.engine.test_engine_exact import make_prompts
from tests.model_factory import engine_reference
from tests.service_client import describe
from tests.service_harness import ENGINE, Proc, Stack, free_port, start_service, stop_all, wait_until, wait_until_async

pytestmark = pytest.mark.slow
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def reference():
    llm = LLM(model=str(default_model_path()), device="cpu", **ENGINE)
    prompts = make_prompts(vocab=8192)
    seeded = [dict(temperature=0.9, top_k=50, seed=7 + i) for i in range(4)]
    return prompts, *engine_reference(llm, prompts, MAX_TOKENS, seeded)


@pytest.fixture(scope="module", params=["shm", "nccl"])
def stack(request, tmp_path_factory):
    s = Stack(request.param, tmp_path_factory.mktemp(f"e2e-{request.param}"))
    yield s
    s.stop()


async def generate(port, prompt_ids, **sampling):
    """All token ids of one request through the gateway's gRPC API, and every message."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        request = generation_pb2.GenerateRequest(
            token_ids=generation_pb2.TokenIds(ids=prompt_ids), sampling=common_pb2.SamplingParams(**sampling)
        )
        messages = [m async for m in stub.Generate(request, timeout=120)]
    return [t for m in messages for t in m.token_ids], messages


async def total_free(stack):
    p = await describe(stack.prefill[1])
    ds = [await describe(a, decode_pb2_grpc.DecodeStub) for a in stack.decodes]
    return [(p.load.num_free_blocks, p.load.num_total_blocks)] + [
        (d.load.num_free_blocks, d.load.num_total_blocks) for d in ds
    ], ds


async def wait_all_blocks_free(stack, timeout_s: float = 10.0):
    """(free, total) blocks per instance and the decodes' Describe, once every block is back everywhere
    (a client has its last token before every instance reports the request's blocks free)."""
    last = []

    async def all_free():
        last[:] = [await total_free(stack)]
        return last[0] if all(f == t for f, t in last[0][0]) else None

    return await wait_until_async(all_free, timeout_s, lambda: f"blocks still held: (free, total) = {last[0][0]}")


async def wait_all_decoding(stack, num_requests: int, timeout_s: float = 30.0) -> list[int]:
    """Requests running per decode, once `num_requests` run in all and every decode runs at least one."""
    last = []

    async def spread():
        last[:] = [[(await describe(a, decode_pb2_grpc.DecodeStub)).load.num_running for a in stack.decodes]]
        return last[0] if sum(last[0]) == num_requests and all(last[0]) else None

    return await wait_until_async(
        spread, timeout_s, lambda: f"{num_requests} requests not decoding on every decode: running = {last[0]}"
    )


def test_concurrent_requests_equal_the_in_process_engine(stack, reference):
    prompts, greedy, seeded = reference

    async def main():
        greedy_jobs = [
            generate(stack.grpc_port, p, temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True) for p in prompts
        ]
        seeded_jobs = [
            generate(stack.grpc_port, p, temperature=0.9, top_k=50, seed=7 + i, max_tokens=MAX_TOKENS, ignore_eos=True)
            for i, p in enumerate(prompts[:4])
        ]
        results = await asyncio.gather(*greedy_jobs, *seeded_jobs)
        return results, await wait_all_blocks_free(stack)  # every block back on every instance

    results, (_, decodes) = asyncio.run(main())
    assert [r[0] for r in results[:16]] == greedy
    assert [r[0] for r in results[16:]] == seeded
    assert all(d.counters.get("requests_received", 0) > 0 for d in decodes)  # both decodes took traffic
    last = results[0][1][-1]
    assert last.finish_reason == common_pb2.FINISH_REASON_LENGTH and last.usage.completion_tokens == MAX_TOKENS


def test_first_token_streams_before_the_rest(stack, reference):
    prompts, greedy, _ = reference
    tokens, messages = asyncio.run(
        generate(stack.grpc_port, prompts[3], temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    )
    # the prefill's token goes to the client alone, before decode has produced anything
    assert list(messages[0].token_ids) == greedy[3][:1]
    assert len(messages) > 2 and tokens == greedy[3]


def test_openai_client_through_the_real_stack(stack):
    import openai

    client = openai.OpenAI(base_url=f"http://127.0.0.1:{stack.http_port}/v1", api_key="unused")
    out = client.completions.create(model="default_model", prompt="def fibonacci(n):", max_tokens=12, temperature=0)
    assert out.usage.completion_tokens == 12 and out.choices[0].finish_reason == "length"
    llm_text = out.choices[0].text
    chunks = list(
        client.completions.create(
            model="default_model", prompt="def fibonacci(n):", max_tokens=12, temperature=0, stream=True
        )
    )
    assert "".join(c.choices[0].text for c in chunks) == llm_text
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="default_model", prompt="x", max_tokens=4, temperature=-1)
    assert info.value.status_code == 400 and "temperature" in str(info.value)


@pytest.fixture(scope="module")
def biased_reference():
    """The in-process engine's greedy tokens after prompt 0 with -100 on the token it picks first, and that token."""
    llm = LLM(model=str(default_model_path()), device="cpu", **ENGINE)
    prompt = make_prompts(vocab=8192)[0]
    params = dict(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    (first,) = llm.generate(prompt_token_ids=[prompt], sampling_params=SamplingParams(**params))
    banned_id = first.token_ids[0]
    (out,) = llm.generate(
        prompt_token_ids=[prompt], sampling_params=SamplingParams(**params, logit_bias={banned_id: -100})
    )
    return prompt, banned_id, out.token_ids


def test_logit_bias_forces_and_bans_tokens_through_rest_and_grpc(stack, biased_reference):
    """The prefill's first token and the decode's later ones obey logit_bias: +100 forces a token at
    every step, -100 on the greedy first token gives the in-process engine's tokens with that bias."""
    prompt, banned_id, expected = biased_reference
    greedy = dict(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    forced, _ = asyncio.run(generate(stack.grpc_port, prompt, **greedy, logit_bias={42: 100}))
    assert forced == [42] * MAX_TOKENS
    banned, messages = asyncio.run(generate(stack.grpc_port, prompt, **greedy, logit_bias={banned_id: -100}))
    assert banned == expected and banned_id not in banned[:1]
    body = {"prompt": prompt, **greedy, "logit_bias": {str(banned_id): -100}}
    r = httpx.post(f"http://127.0.0.1:{stack.http_port}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "".join(m.text for m in messages)


def test_cancel_mid_stream_frees_blocks_everywhere(stack):
    body = {"prompt": "import os", "max_tokens": 400, "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"http://127.0.0.1:{stack.http_port}/v1/completions", json=body, timeout=60) as r:
        for i, line in enumerate(r.iter_lines()):
            if i >= 6:
                break  # leave mid-stream
    assert i == 6  # the stream was still going when the client left
    asyncio.run(wait_all_blocks_free(stack))


def test_killing_a_decode_fails_only_its_requests(tmp_path, reference):
    prompts, greedy, _ = reference
    stack = Stack("shm", tmp_path)
    try:

        async def main():
            jobs = [
                asyncio.create_task(
                    generate(
                        stack.grpc_port, list(range(100 + i, 140 + i)), temperature=0, max_tokens=300, ignore_eos=True
                    )
                )
                for i in range(4)
            ]
            running = await wait_all_decoding(stack, 4)  # 300 tokens each: none finishes before the kill
            stack.procs["decode-1"].kill()
            done = await asyncio.gather(*jobs, return_exceptions=True)
            after = await generate(stack.grpc_port, prompts[0], temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
            return running, done, after

        started = time.monotonic()
        (_, on_killed), done, after = asyncio.run(main())
        finals = [r[1][-1] for r in done]
        failed = [f for f in finals if f.finish_reason == common_pb2.FINISH_REASON_ERROR]
        finished = [f for f in finals if f.finish_reason == common_pb2.FINISH_REASON_LENGTH]
        assert (len(failed), len(finished)) == (on_killed, 4 - on_killed)
        assert all(f.error.startswith("decode instance") for f in failed)
        assert after[0] == greedy[0]  # later requests go to the surviving decode
        assert time.monotonic() - started < 60
    finally:
        stack.stop()


def test_layout_mismatch_is_refused_before_serving(tmp_path):
    model = default_model_path()
    prefill, p_addr = start_service("prefill", model, tmp_path, "prefill", **ENGINE)
    decode, d_addr = start_service("decode", model, tmp_path, "decode", **{**ENGINE, "block_size": 8})
    http = free_port()
    gateway = Proc(
        "gateway",
        ["--grpc-port", "0", "--http-port", str(http), "--prefill", p_addr, "--decode", d_addr],
        tmp_path,
        "gateway",
    )
    try:
        prefill.wait_ready()
        decode.wait_ready()

        def mismatch_reported():
            try:
                r = httpx.get(f"http://127.0.0.1:{http}/ready", timeout=2)
            except httpx.HTTPError:
                return None
            return r if "KV layouts differ" in r.text else None

        r = wait_until(
            mismatch_reported,
            30,
            lambda: f"/ready never said 'KV layouts differ':\n{gateway.log_path.read_text()[-3000:]}",
        )
        assert r.status_code == 503
        assert "block_size=4" in r.text and "block_size=8" in r.text
    finally:
        stop_all([gateway, prefill, decode])
