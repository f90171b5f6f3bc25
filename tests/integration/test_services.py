"""Prefill and decode services as real processes on loopback (no gateway): exact tokens over
shm, nccl-over-gloo and nixl (UCX over loopback), prefix reuse across turns, leases, cancellation, failed pulls."""

import asyncio
import time

import pytest

from splitserve.engine import LLM
from splitserve.protos import common_pb2, decode_pb2_grpc
from tests.engine.test_engine_exact import make_prompts
from tests.model_factory import engine_reference, make_tiny_model_dir
from tests.service_client import DecodeSession, decode_request, describe, generate_disaggregated, prefill_stub
from tests.service_harness import start_service, stop_all, wait_until_async

pytestmark = pytest.mark.slow
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("svc"), "llama", num_kv_heads=2, name="svc-tiny")


@pytest.fixture(scope="module")
def expected(model_dir):
    llm = LLM(model=str(model_dir), dtype="float64", device="cpu", block_size=4, num_kv_blocks=256)
    prompts = make_prompts()
    seeded = [dict(temperature=0.8, top_p=0.9, seed=100 + i) for i in range(6)]
    return prompts, *engine_reference(llm, prompts, MAX_TOKENS, seeded)


@pytest.fixture(scope="module", params=["shm", "nccl", "nixl"])
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
        stop_all([prefill, decode])


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


async def wait_blocks_free(stack, timeout_s: float = 10.0):
    """free_blocks(stack) once both pools are entirely free and the prefill holds no lease (a client has a
    request's last delta before both instances report its blocks free, and a decode releases a lease after it
    commits the copy)."""
    last = []

    async def all_free():
        last[:] = [await free_blocks(stack)]
        p_free, d_free, p, d = last[0]
        free = (p_free, d_free) == (p.load.num_total_blocks, d.load.num_total_blocks)
        return last[0] if free and p.counters.get("leases_active", 0) == 0 else None

    return await wait_until_async(
        all_free,
        timeout_s,
        lambda: f"free (prefill, decode) = {last[0][:2]}, leases active {last[0][2].counters.get('leases_active')}",
    )


async def wait_peer_prepared(decode_address: str, transport: str, timeout_s: float = 30.0):
    """The decode's Describe once it has mapped (shm) or paired with (nccl) its --prefill-peers: it waits
    one transfer timeout for that before serving, then goes on in the background (a loaded machine)."""
    counter = "pairs_created" if transport == "nccl" else "peers_mapped"
    last = []

    async def prepared():
        last[:] = [await describe(decode_address, decode_pb2_grpc.DecodeStub)]
        return last[0] if counter in last[0].counters else None

    return await wait_until_async(prepared, timeout_s, lambda: f"no {counter} in {dict(last[0].counters)}")


def test_decode_prepares_its_prefill_at_start(stack):
    """--prefill-peers: the decode maps the prefill's pool (shm), loads its agent (nixl) or pairs with it (nccl)
    once, at start."""
    d = run(wait_peer_prepared(stack["decode"], stack["transport"]))
    if stack["transport"] in ("shm", "nixl"):
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
        return [r[0] for r in results], await wait_blocks_free(stack)

    tokens, (p_free, d_free, p, d) = run(main())
    assert tokens[:16] == greedy
    assert tokens[16:] == seeded
    assert p_free == p.load.num_total_blocks and d_free == d.load.num_total_blocks
    assert p.counters["leases_released"] >= 22 and p.counters["leases_active"] == 0


def test_a_handle_naming_another_pool_is_never_mapped(stack, expected):
    """The decode maps only the pool its prefill reports in Describe: a handle whose endpoint names another
    segment (here one full of random KV) or, for nixl, another address (one block on) is pulled from the prefill's
    own pool, so the tokens stay exact (nccl maps no pool: its handles' endpoints are ignored alike)."""
    import torch

    from splitserve.common.wire import layout_from_proto
    from splitserve.engine.kv_connectors.shm_pool import SharedKvPool
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
            if "nixl_pool_addr" in first.kv.endpoint:
                block_nbytes = decoy.tensor[0].numel() * decoy.tensor.element_size()
                first.kv.endpoint["nixl_pool_addr"] = str(int(first.kv.endpoint["nixl_pool_addr"]) + block_nbytes)
            session.submit(decode_request(first, "forged", prompts[3], sampling()))
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

        async def expired_and_freed():
            d = await describe(stack["prefill"])
            done = d.counters.get("leases_expired", 0) > before and d.counters.get("leases_active", 0) == 0
            return d if done and d.load.num_free_blocks == d.load.num_total_blocks else None

        after = await wait_until_async(
            expired_and_freed, 10, "the unclaimed lease (lease_s = 1.0) never expired and freed its 5 blocks"
        )
        return r, held, after, before, time.monotonic() - asked

    asked = time.monotonic()
    r, held, after, before, expired_after_s = run(main())
    assert expired_after_s >= 1.0  # not before lease_s = 1.0 (granted after `asked`)
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
        queue = session.submit(decode_request(first, "c1", prompt, sampling(max_tokens=100)))
        await asyncio.wait_for(queue.get(), 30)  # first decode delta arrived: the request is running
        session.abort("c1")
        tokens, deltas = await session.collect("c1")
        await session.close()
        return deltas[-1], await wait_blocks_free(stack)

    last, (p_free, d_free, p, d) = run(main())
    assert last.finish_reason == common_pb2.FINISH_REASON_ABORT
    assert p_free == p.load.num_total_blocks and d_free == d.load.num_total_blocks


# Not over nixl: the policy is the decode's, as over nccl, and test_chaos.py kills a prefill mid-pull over nixl.
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
            await wait_peer_prepared(d_addr, transport)  # the pull must fail at the copy, not at pairing
            prefill.kill()
            session = DecodeSession(d_addr)
            session.submit(decode_request(first, "k1", prompts[0], sampling()))
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
        stop_all([prefill, decode])


def test_describe_advertises_a_server_that_answers_only_describe_and_health(stack):
    """Health checks sent to `health_address` never wait behind the request calls queued at
    the main address; that server serves nothing else."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from splitserve.protos import prefill_pb2

    async def main():
        p = await describe(stack["prefill"])
        at_health = await describe(p.health_address)
        d = await describe(stack["decode"], decode_pb2_grpc.DecodeStub)
        d_at_health = await describe(d.health_address, decode_pb2_grpc.DecodeStub)
        async with grpc.aio.insecure_channel(p.health_address) as channel:
            served = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service="splitserve.v1.Prefill"), timeout=10
            )
            try:
                await prefill_stub(p.health_address).ReleaseKv(
                    prefill_pb2.ReleaseKvRequest(lease_id="x", epoch=1), timeout=10
                )
                refused = grpc.StatusCode.OK
            except grpc.aio.AioRpcError as exc:
                refused = exc.code()
        return p, at_health, d, d_at_health, served.status, refused

    p, at_health, d, d_at_health, served, refused = run(main())
    assert p.health_address.startswith("127.0.0.1:") and p.health_address != stack["prefill"]
    assert at_health.instance_id == p.instance_id and d_at_health.instance_id == d.instance_id
    assert d.health_address not in (p.health_address, stack["decode"])
    assert served == health_pb2.HealthCheckResponse.SERVING
    assert refused == grpc.StatusCode.UNIMPLEMENTED
