"""Prefill and decode services as real processes on loopback (no gateway): exact tokens over
shm and nccl-over-gloo, prefix reuse across turns, leases, cancellation, failed pulls."""

import asyncio
import time

import pytest

from splitserve.engine import LLM, SamplingParams
from splitserve.protos import common_pb2, decode_pb2, decode_pb2_grpc
from tests.model_factory import make_tiny_model_dir
from tests.service_client import DecodeSession, describe, generate_disaggregated, prefill_stub
from tests.service_harness import start_service
from tests.test_engine_exact import make_prompts

pytestmark = pytest.mark.slow
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("svc"), "llama", num_kv_heads=2, name="svc-tiny")


@pytest.fixture(scope="module")
def expected(model_dir):
    llm = LLM(model=str(model_dir), dtype="float64", device="cpu", block_size=4, num_kv_blocks=256)
    prompts = make_prompts()
    greedy = [
        o.token_ids
        for o in llm.generate(
            prompt_token_ids=prompts,
            sampling_params=SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),
        )
    ]
    seeded = [
        o.token_ids
        for o in llm.generate(
            prompt_token_ids=prompts[:6],
            sampling_params=[
                SamplingParams(temperature=0.8, top_p=0.9, seed=100 + i, max_tokens=MAX_TOKENS, ignore_eos=True)
                for i in range(6)
            ],
        )
    ]
    return prompts, greedy, seeded


@pytest.fixture(scope="module", params=["shm", "nccl"])
def stack(request, model_dir, tmp_path_factory):
    transport = request.param
    logs = tmp_path_factory.mktemp(f"logs-{transport}")
    prefill, p_addr = start_service(
        "prefill",
        model_dir,
        logs,
        f"p-{transport}",
        service_args=["--kv-transport", transport, "--lease-s", "1.0", "--kv-transfer-timeout-s", "2"],
    )
    decode, d_addr = start_service(
        "decode",
        model_dir,
        logs,
        f"d-{transport}",
        service_args=["--kv-transport", transport, "--prefill-peers", p_addr, "--kv-transfer-timeout-s", "2"],
    )
    try:
        prefill.wait_ready()
        decode.wait_ready()
        yield {"transport": transport, "prefill": p_addr, "decode": d_addr}
    finally:
        prefill.stop()
        decode.stop()


def run(coro):
    return asyncio.run(coro)


def sampling(**kw):
    base = dict(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    base.update(kw)
    return common_pb2.SamplingParams(**base)


async def free_blocks(stack):
    p = await describe(stack["prefill"])
    d = await describe(stack["decode"], decode_pb2_grpc.DecodeStub)
    return p.load.num_free_blocks, d.load.num_free_blocks, p, d


def test_decode_prepared_its_prefill_before_serving(stack):
    """--prefill-peers: the decode mapped the prefill's pool (shm) or paired with it (nccl) at start."""
    d = run(describe(stack["decode"], decode_pb2_grpc.DecodeStub))
    if stack["transport"] == "shm":
        assert d.counters["peers_mapped"] == 1 and "pairs_created" not in d.counters
    else:
        assert d.counters["pairs_created"] == 1 and "peers_mapped" not in d.counters


def test_concurrent_batch_equals_in_process_engine(stack, expected):
    prompts, greedy, seeded = expected

    async def main():
        prefill = prefill_stub(stack["prefill"])
        session = DecodeSession(stack["decode"])
        jobs = [generate_disaggregated(prefill, session, f"g{i}", p, sampling()) for i, p in enumerate(prompts)]
        jobs += [
            generate_disaggregated(
                prefill, session, f"s{i}", p, sampling(temperature=0.8, top_p=0.9, seed=100 + i), seed=100 + i
            )
            for i, p in enumerate(prompts[:6])
        ]
        results = await asyncio.gather(*jobs)
        await session.close()
        # one DecodeOut per step carried several requests' tokens
        assert session.num_messages < sum(len(r[0]) - 1 for r in results)
        return [r[0] for r in results], await free_blocks(stack)

    tokens, (p_free, d_free, p, d) = run(main())
    assert tokens[:16] == greedy
    assert tokens[16:] == seeded
    assert p_free == p.load.num_total_blocks and d_free == d.load.num_total_blocks
    assert p.counters["leases_released"] >= 22 and p.counters["leases_active"] == 0


def test_a_handle_naming_another_pool_is_never_mapped(stack, expected):
    """The decode maps only the pool its prefill reports in Describe: a handle whose endpoint names another
    segment (here one full of random KV) is pulled from the prefill's own pool, so the tokens stay exact
    (nccl maps no pool: its handles' endpoints are ignored alike)."""
    import torch

    from splitserve.common.wire import layout_from_proto
    from splitserve.engine.kv_transfer.shm import SharedKvPool
    from splitserve.protos import prefill_pb2

    prompts, greedy, _ = expected

    async def main():
        prefill = prefill_stub(stack["prefill"])
        session = DecodeSession(stack["decode"])
        first = await prefill.Prefill(
            prefill_pb2.PrefillRequest(request_id="forged", prompt_token_ids=prompts[3], sampling=sampling()),
            timeout=60,
        )
        decoy = SharedKvPool.create(
            f"splitserve-decoy-{stack['transport']}",
            layout_from_proto(first.kv.layout),
            int(first.kv.endpoint.get("num_blocks", "64")),
        )
        try:
            decoy.tensor.copy_(torch.randn_like(decoy.tensor) * 100)
            first.kv.endpoint["shm_name"] = decoy.shm.name
            session.submit(
                decode_pb2.DecodeRequest(
                    request_id="forged",
                    prompt_token_ids=prompts[3],
                    sampling=sampling(),
                    first_token_id=first.first_token_id,
                    kv=first.kv,
                )
            )
            tokens, _ = await session.collect("forged")
        finally:
            decoy.close()
        await session.close()
        return [first.first_token_id] + tokens

    assert run(main()) == greedy[3]


def test_follow_up_turn_pulls_only_new_blocks(stack):
    async def main():
        prefill = prefill_stub(stack["prefill"])
        session = DecodeSession(stack["decode"])
        first_prompt = list(range(100, 124))  # 6 full blocks of 4
        _, _, deltas1 = await generate_disaggregated(prefill, session, "turn1", first_prompt, sampling())
        follow = first_prompt + list(range(200, 210))  # +10 tokens: blocks 6, 7 full, 8 partial
        _, first, deltas2 = await generate_disaggregated(prefill, session, "turn2", follow, sampling())
        await session.close()
        return deltas1[0], deltas2[0], first

    d1, d2, first = run(main())
    assert d1.num_blocks_pulled == 6 and d1.cached_prompt_tokens == 0
    assert first.cached_prompt_tokens == 24  # the prefill reused its own cache too
    assert d2.cached_prompt_tokens == 24 and d2.num_blocks_pulled == 3  # only blocks 6, 7, 8 moved


def test_unclaimed_lease_expires_and_frees_blocks(stack):
    async def main():
        prefill = prefill_stub(stack["prefill"])
        before = (await describe(stack["prefill"])).counters.get("leases_expired", 0)
        from splitserve.protos import prefill_pb2

        r = await prefill.Prefill(
            prefill_pb2.PrefillRequest(request_id="orphan", prompt_token_ids=list(range(300, 317)), sampling=sampling())
        )
        held = await describe(stack["prefill"])
        await asyncio.sleep(1.5)  # lease_s = 1.0
        after = await describe(stack["prefill"])
        return r, held, after, before

    r, held, after, before = run(main())
    assert len(r.kv.block_ids) == 5 and r.kv.num_tokens == 17
    assert held.counters["leases_active"] == 1
    assert held.load.num_free_blocks == held.load.num_total_blocks - 5
    assert after.counters["leases_expired"] == before + 1 and after.counters["leases_active"] == 0
    assert after.load.num_free_blocks == after.load.num_total_blocks


def test_cancel_mid_stream_frees_blocks_on_both_sides(stack):
    async def main():
        prefill = prefill_stub(stack["prefill"])
        session = DecodeSession(stack["decode"])
        from splitserve.protos import prefill_pb2

        prompt = list(range(400, 420))
        first = await prefill.Prefill(
            prefill_pb2.PrefillRequest(request_id="c1", prompt_token_ids=prompt, sampling=sampling(max_tokens=100))
        )
        queue = session.submit(
            decode_pb2.DecodeRequest(
                request_id="c1",
                prompt_token_ids=prompt,
                sampling=sampling(max_tokens=100),
                first_token_id=first.first_token_id,
                kv=first.kv,
            )
        )
        await asyncio.wait_for(queue.get(), 30)  # first decode delta arrived: the request is running
        session.abort("c1")
        tokens, deltas = await session.collect("c1")
        await session.close()
        await asyncio.sleep(0.2)
        return deltas[-1], await free_blocks(stack)

    last, (p_free, d_free, p, d) = run(main())
    assert last.finish_reason == common_pb2.FINISH_REASON_ABORT
    assert p_free == p.load.num_total_blocks and d_free == d.load.num_total_blocks


@pytest.mark.parametrize("transport, policy", [("shm", "recompute"), ("nccl", "fail")])
def test_prefill_killed_before_the_pull(transport, policy, model_dir, expected, tmp_path):
    prompts, greedy, _ = expected
    prefill, p_addr = start_service(
        "prefill", model_dir, tmp_path, "p-dead", service_args=["--kv-transport", transport]
    )
    decode, d_addr = start_service(
        "decode",
        model_dir,
        tmp_path,
        "d-live",
        service_args=[
            "--kv-transport",
            transport,
            "--kv-load-failure-policy",
            policy,
            "--prefill-peers",
            p_addr,
            "--kv-transfer-timeout-s",
            "1",
        ],
    )
    try:
        prefill.wait_ready()
        decode.wait_ready()

        async def main():
            from splitserve.protos import prefill_pb2

            first = await prefill_stub(p_addr).Prefill(
                prefill_pb2.PrefillRequest(request_id="k1", prompt_token_ids=prompts[0], sampling=sampling())
            )
            await asyncio.sleep(0.5)  # let the nccl pair form before the prefill dies
            prefill.kill()
            session = DecodeSession(d_addr)
            session.submit(
                decode_pb2.DecodeRequest(
                    request_id="k1",
                    prompt_token_ids=prompts[0],
                    sampling=sampling(),
                    first_token_id=first.first_token_id,
                    kv=first.kv,
                )
            )
            started = time.monotonic()
            tokens, deltas = await session.collect("k1")
            elapsed = time.monotonic() - started
            await session.close()
            d = await describe(d_addr, decode_pb2_grpc.DecodeStub)
            return [first.first_token_id] + tokens, deltas, d, elapsed

        tokens, deltas, d, elapsed = run(main())
        assert d.load.num_free_blocks == d.load.num_total_blocks
        if policy == "recompute":
            assert tokens == greedy[0]  # recomputed locally, same tokens
            assert deltas[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
        else:
            assert deltas[-1].finish_reason == common_pb2.FINISH_REASON_ERROR
            assert deltas[-1].error.startswith("KV pull from p-dead failed")
            assert elapsed < 5.0
    finally:
        prefill.stop()
        decode.stop()
