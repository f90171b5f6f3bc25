"""Chaos: kill -9 each service mid-stream under load, and inject each KV transfer fault.

Every affected request ends with a clear error or completes (via recompute) with the right
tokens, unaffected ones complete with the right tokens, a restarted instance serves again,
and block accounting on the survivors returns to baseline.
"""

import asyncio
import signal
import time

import grpc
import pytest

from splitserve.common.default_model_path import default_model_path
from splitserve.engine import LLM, SamplingParams
from splitserve.protos import common_pb2, decode_pb2_grpc, generation_pb2, generation_pb2_grpc
from tests.engine.test_engine_exact import make_prompts
from tests.service_client import describe
from tests.service_harness import ENGINE, Proc, Stack, wait_until_async

pytestmark = pytest.mark.slow
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def reference():
    llm = LLM(model=str(default_model_path()), device="cpu", **ENGINE)
    prompts = make_prompts(n=8, seed=3, vocab=8192)
    outs = llm.generate(
        prompt_token_ids=prompts, sampling_params=SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    )
    return prompts, [o.token_ids for o in outs]


async def generate(port, prompt, max_tokens=MAX_TOKENS):
    """(token ids, last message) of one request, or (None, error text) if the call itself failed."""
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            request = generation_pb2.GenerateRequest(
                token_ids=generation_pb2.TokenIds(ids=prompt),
                sampling=(common_pb2.SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)),
            )
            messages = [m async for m in stub.Generate(request, timeout=60)]
        return [t for m in messages for t in m.token_ids], messages[-1]
    except grpc.aio.AioRpcError as exc:
        return None, f"{exc.code().name}: {exc.details()}"


async def wait_blocks_free(stack, timeout_s=5.0, skip=()):
    """{instance: (free blocks, total blocks, active leases)} once every instance not in `skip` has all its
    blocks free and no lease active."""
    last = []

    async def all_free():
        loads = {}
        for name, address, stub in [("prefill", stack.prefill[1], None)] + [
            (f"decode-{i}", a, decode_pb2_grpc.DecodeStub) for i, a in enumerate(stack.decodes)
        ]:
            if name in skip:
                continue
            d = await describe(address, stub)
            loads[name] = (d.load.num_free_blocks, d.load.num_total_blocks, d.counters.get("leases_active", 0))
        last[:] = [loads]
        return loads if all(f == t and leases == 0 for f, t, leases in loads.values()) else None

    return await wait_until_async(
        all_free,
        timeout_s,
        lambda: f"every block free and no lease active; (free, total, leases) = {last[0]}",
        poll_s=0.1,
    )


@pytest.mark.parametrize(
    "faults, counter, expected",
    [
        ("pull_drop=2,pull_delay_ms=200", "kv_pull_failures", 2),
        ("corrupt_epoch=2", "kv_pull_recomputes", 2),
    ],
)
def test_transfer_faults_recompute_the_right_tokens(faults, counter, expected, reference, tmp_path):
    prompts, greedy = reference
    stack = Stack("shm", tmp_path, num_decode=1, decode_faults=faults, prefill_args=["--lease-s", "1"])
    try:

        async def main():
            results = await asyncio.gather(*(generate(stack.grpc_port, p) for p in prompts))
            loads = await wait_blocks_free(stack, timeout_s=4.0)  # corrupted releases leave leases to expire
            d = await describe(stack.decodes[0], decode_pb2_grpc.DecodeStub)
            p = await describe(stack.prefill[1])
            return results, loads, d, p

        results, loads, d, p = asyncio.run(main())
        assert [r[0] for r in results] == greedy  # recomputed where the pull failed: same tokens
        assert d.counters[counter] == expected
        assert all(f == t and leases == 0 for f, t, leases in loads.values()), loads
        if faults.startswith("corrupt"):
            assert p.counters["leases_expired"] == 2  # the leases the decode could not validate
    finally:
        stack.stop()


def test_prefill_killed_mid_send_over_nccl(reference, tmp_path):
    prompts, greedy = reference
    stack = Stack(
        "nccl",
        tmp_path,
        num_decode=1,
        prefill_faults="send_kill_after_blocks=12",
        decode_args=["--kv-transfer-timeout-s", "1"],
    )
    try:

        async def main():
            results = []
            for prompt in prompts[:4]:  # one at a time: the prefill dies inside the 2nd-3rd send
                results.append(await generate(stack.grpc_port, prompt))
            stack.procs["prefill"].popen.wait(5)
            loads = await wait_blocks_free(stack, skip=("prefill",))
            return results, loads

        started = time.monotonic()
        results, loads = asyncio.run(main())
        assert stack.procs["prefill"].popen.returncode == -9
        assert [r[0] for r in results] == greedy[:4]  # recomputed locally after the failed pull
        assert all(f == t for f, t, _ in loads.values())
        assert time.monotonic() - started < 30
        stack.restart_prefill()
        stack.wait_ready()
        tokens, last = asyncio.run(generate(stack.grpc_port, prompts[5]))
        assert tokens == greedy[5]
    finally:
        stack.stop()


async def first_token_then_rest(port, prompt, on_first):
    """(token ids, last message) of one streamed request; `on_first()` runs once its first token has arrived."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        request = generation_pb2.GenerateRequest(
            token_ids=generation_pb2.TokenIds(ids=prompt),
            sampling=common_pb2.SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),
        )
        messages = []
        async for message in stub.Generate(request, timeout=60):
            if not messages:
                on_first()
            messages.append(message)
    return [t for m in messages for t in m.token_ids], messages[-1]


def test_prefill_killed_mid_pull_over_nixl(reference, tmp_path):
    """The prefill dies once it has handed out the KV (its first token is out), while the decode's one-sided READ
    is on its way (held back 1.5 s): the READ fails (UCX sees the peer gone), the decode recomputes the same tokens
    and frees its blocks; a restarted prefill (a new NIXL agent) serves disaggregated again."""
    prompts, greedy = reference
    stack = Stack("nixl", tmp_path, num_decode=1, decode_faults="pull_delay_ms=1500")
    try:
        prefill = stack.procs["prefill"]
        tokens, last = asyncio.run(first_token_then_rest(stack.grpc_port, prompts[0], prefill.kill))
        assert prefill.popen.wait(5) == -9
        assert (tokens, last.finish_reason) == (greedy[0], common_pb2.FINISH_REASON_LENGTH)  # recomputed locally
        loads = asyncio.run(wait_blocks_free(stack, skip=("prefill",)))
        assert all(f == t for f, t, _ in loads.values())
        d = asyncio.run(describe(stack.decodes[0], decode_pb2_grpc.DecodeStub))
        assert (d.counters["kv_pull_failures"], d.counters["kv_pull_recomputes"]) == (1, 1)
        stack.restart_prefill()
        stack.wait_ready()
        assert asyncio.run(generate(stack.grpc_port, prompts[1]))[0] == greedy[1]
        d = asyncio.run(describe(stack.decodes[0], decode_pb2_grpc.DecodeStub))
        assert d.counters["kv_pull_failures"] == 1 and d.counters["kv_blocks_pulled"] > 0  # pulled from the new one
        loads = asyncio.run(wait_blocks_free(stack))
        assert all(f == t and leases == 0 for f, t, leases in loads.values()), loads
    finally:
        stack.stop()


def test_kill_prefill_and_decode_mid_stream_then_restart(reference, tmp_path):
    prompts, greedy = reference
    # handles given to the decode that dies are never claimed: their leases expire (1 s here)
    stack = Stack("shm", tmp_path, num_decode=2, prefill_args=["--lease-s", "1"])
    try:

        async def load_then_kill(victim):
            """Start every prompt, kill `victim` once it is working on them, gather the results."""
            jobs = [asyncio.create_task(generate(stack.grpc_port, p, max_tokens=MAX_TOKENS)) for p in prompts]
            if victim == "prefill":  # once it has prefilled something: later prompts fall back to a decode

                async def busy():
                    return (await describe(stack.prefill[1])).counters.get("prompt_tokens", 0) > 0
            else:  # once it runs requests: those end with an error naming it

                async def busy():
                    d = await describe(stack.decodes[int(victim.split("-")[1])], decode_pb2_grpc.DecodeStub)
                    return d.load.num_running > 0

            await wait_until_async(busy, 30, f"{victim} never started working on the prompts", poll_s=0.01)
            killed_at = time.monotonic()
            stack.procs[victim].kill()
            results = await asyncio.gather(*jobs)
            return results, time.monotonic() - killed_at

        results, elapsed = asyncio.run(load_then_kill("prefill"))
        # requests in decode continue; those still in prefill fall back to a decode-local prefill
        assert [r[0] for r in results] == greedy
        assert elapsed < 10
        stack.restart_prefill()
        stack.wait_ready()
        p_before = asyncio.run(describe(stack.prefill[1])).counters.get("prompt_tokens", 0)
        assert asyncio.run(generate(stack.grpc_port, prompts[0]))[0] == greedy[0]
        assert asyncio.run(describe(stack.prefill[1])).counters["prompt_tokens"] > p_before  # disaggregated again

        results, _ = asyncio.run(load_then_kill("decode-1"))
        assert all(tokens is not None for tokens, _ in results), results  # every stream ends with a message
        failed = 0
        for (tokens, last), expected in zip(results, greedy):
            if last.finish_reason == common_pb2.FINISH_REASON_LENGTH:
                assert tokens == expected
            else:
                failed += 1
                assert last.finish_reason == common_pb2.FINISH_REASON_ERROR
                assert last.error.startswith("decode instance decode-1@"), last.error
        assert failed >= 1  # it was killed while running requests
        loads = asyncio.run(wait_blocks_free(stack, timeout_s=4.0, skip=("decode-1",)))
        assert all(f == t and leases == 0 for f, t, leases in loads.values()), loads
        port = int(stack.decodes[1].rsplit(":", 1)[1])
        from tests.service_harness import start_service

        proc, _ = start_service(
            "decode",
            stack.model,
            tmp_path,
            "decode-1-restarted",
            port=port,
            service_args=["--kv-transport", "shm"],
            **ENGINE,
        )  # same port as before
        stack.procs["decode-1"] = proc
        proc.wait_ready()
        stack.wait_ready()

        async def all_prompts():
            return await asyncio.gather(*(generate(stack.grpc_port, p) for p in prompts))

        results = asyncio.run(all_prompts())
        assert [r[0] for r in results] == greedy
        d1 = asyncio.run(describe(stack.decodes[1], decode_pb2_grpc.DecodeStub))
        assert d1.counters.get("requests_received", 0) > 0  # the restarted decode takes traffic again
    finally:
        stack.stop()


def test_kill_gateway_mid_stream_frees_everything_then_restart(reference, tmp_path):
    prompts, greedy = reference
    stack = Stack("shm", tmp_path, num_decode=1)
    try:

        async def main():
            jobs = [asyncio.create_task(generate(stack.grpc_port, p, max_tokens=200)) for p in prompts]
            running = []

            async def all_decoding():  # every stream is past its prefill: the kill lands mid-stream
                running[:] = [(await describe(stack.decodes[0], decode_pb2_grpc.DecodeStub)).load.num_running]
                return running[0] == len(prompts)

            await wait_until_async(
                all_decoding, 30, lambda: f"all {len(prompts)} requests decoding; running = {running}", poll_s=0.01
            )
            stack.procs["gateway"].kill()
            results = await asyncio.gather(*jobs)
            killed = time.monotonic()
            loads = await wait_blocks_free(stack, timeout_s=5.0)
            return results, loads, time.monotonic() - killed

        results, loads, freed_after = asyncio.run(main())
        assert all(tokens is None and msg.startswith("UNAVAILABLE") for tokens, msg in results)
        assert all(f == t and leases == 0 for f, t, leases in loads.values()), loads
        assert freed_after < 2.0  # the decode aborted the broken stream's requests at once
        stack.procs["gateway"] = Proc(
            "gateway",
            [
                "--grpc-port",
                str(stack.grpc_port),
                "--http-port",
                str(stack.http_port),
                "--prefill",
                stack.prefill[1],
                "--decode",
                ",".join(stack.decodes),
                "--health-interval-s",
                "0.2",
            ],
            tmp_path,
            "gateway-restarted",
        )
        stack.wait_ready()
        assert asyncio.run(generate(stack.grpc_port, prompts[2]))[0] == greedy[2]
    finally:
        stack.stop()


def test_a_held_release_kv_holds_no_stream(reference, tmp_path):
    """The prefill answers no ReleaseKv until told (SIGUSR1), as a prefill whose event loop works through a burst:
    the request streams every token meanwhile, its lease still held there; once the held call goes through, the
    lease is released (not expired) and both pools are back to baseline."""
    prompts, greedy = reference
    stack = Stack("shm", tmp_path, num_decode=1, prefill_faults="release_hold=1")
    try:

        async def main():
            tokens, last = await generate(stack.grpc_port, prompts[0])
            held = await describe(stack.prefill[1])
            stack.procs["prefill"].popen.send_signal(signal.SIGUSR1)
            loads = await wait_blocks_free(stack)
            return tokens, last, held, loads, await describe(stack.prefill[1])

        tokens, last, held, loads, after = asyncio.run(main())
        assert tokens == greedy[0] and last.finish_reason == common_pb2.FINISH_REASON_LENGTH
        assert held.counters["leases_active"] == 1 and "leases_released" not in held.counters
        assert all(f == t and leases == 0 for f, t, leases in loads.values()), loads
        assert after.counters["leases_released"] == 1 and "leases_expired" not in after.counters
    finally:
        stack.stop()
