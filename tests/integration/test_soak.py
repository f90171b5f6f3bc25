"""Soak: 2,000 requests at concurrency 32 through the real stack, 10% cancelled by the client
mid-stream, random lengths. Every request ends exactly once, nothing leaks, memory is stable."""

import asyncio
import random
import time
from pathlib import Path

import grpc
import pytest

from splitserve.protos import common_pb2, decode_pb2_grpc, generation_pb2, generation_pb2_grpc
from tests.service_client import describe
from tests.service_harness import Stack, wait_until

pytestmark = pytest.mark.slow
NUM_REQUESTS = 2000
CONCURRENCY = 32


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def process_tree(pid: int) -> list[int]:
    """pid and its descendants (a service and its engine core)."""
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    return [pid] + [p for child in children for p in process_tree(int(child))]


def memory(stack) -> dict[str, int]:
    return {f"{name}:{pid}": rss_kib(pid) for name, proc in stack.procs.items() for pid in process_tree(proc.popen.pid)}


async def one(stub, rng: random.Random, index: int, outcome: dict) -> None:
    prompt = [rng.randrange(3, 8192) for _ in range(rng.randint(4, 64))]
    max_tokens = rng.randint(1, 24)
    cancel_after = rng.randint(1, 3) if rng.random() < 0.10 else None
    request = generation_pb2.GenerateRequest(
        request_id=f"soak-{index}",
        token_ids=generation_pb2.TokenIds(ids=prompt),
        sampling=common_pb2.SamplingParams(temperature=0.8, seed=index, max_tokens=max_tokens, ignore_eos=True),
    )
    call = stub.Generate(request, timeout=60)
    tokens, messages = 0, 0
    try:
        async for message in call:
            messages += 1
            tokens += len(message.token_ids)
            if message.finish_reason:
                state = common_pb2.FinishReason.Name(message.finish_reason)
                if message.finish_reason == common_pb2.FINISH_REASON_LENGTH and tokens != max_tokens:
                    state = f"wrong token count {tokens} != {max_tokens}"
                outcome.setdefault(index, []).append(state)
            if cancel_after is not None and messages >= cancel_after and not message.finish_reason:
                call.cancel()
                outcome.setdefault(index, []).append("CANCELLED")
                return
    except grpc.aio.AioRpcError as exc:
        if exc.code() != grpc.StatusCode.CANCELLED:
            outcome.setdefault(index, []).append(f"rpc error {exc.code().name}")
    except asyncio.CancelledError:
        outcome.setdefault(index, []).append("CANCELLED")


def test_soak_2000_requests_with_cancellations(tmp_path):
    stack = Stack("shm", tmp_path, num_decode=1)
    try:

        async def main():
            async with grpc.aio.insecure_channel(f"127.0.0.1:{stack.grpc_port}") as channel:
                stub = generation_pb2_grpc.GenerationStub(channel)
                rng = random.Random(1234)
                outcome: dict[int, list[str]] = {}
                semaphore = asyncio.Semaphore(CONCURRENCY)
                mem_start = None

                async def guarded(i):
                    async with semaphore:
                        await one(stub, rng, i, outcome)

                started = time.monotonic()
                warmup = [asyncio.create_task(guarded(i)) for i in range(200)]
                await asyncio.gather(*warmup)
                mem_start = memory(stack)
                rest = [asyncio.create_task(guarded(i)) for i in range(200, NUM_REQUESTS)]
                await asyncio.gather(*rest)
                elapsed = time.monotonic() - started
                return outcome, mem_start, elapsed

        outcome, mem_start, elapsed = asyncio.run(main())
        states = [s for states in outcome.values() for s in states]
        assert len(outcome) == NUM_REQUESTS and all(len(s) == 1 for s in outcome.values())  # exactly one end each
        counts = {s: states.count(s) for s in set(states)}
        assert set(counts) <= {"FINISH_REASON_LENGTH", "CANCELLED"}, counts
        assert 120 <= counts["CANCELLED"] <= 280  # ~10% of 2,000

        async def accounting():
            p = await describe(stack.prefill[1])
            d = await describe(stack.decodes[0], decode_pb2_grpc.DecodeStub)
            return p, d

        last = []

        def all_returned():
            last[:] = [asyncio.run(accounting())]
            p, d = last[0]
            free = all(x.load.num_free_blocks == x.load.num_total_blocks for x in (p, d))
            return last[0] if free and p.counters["leases_active"] == 0 else None

        def held() -> str:
            p, d = last[0]
            free = {"prefill": p.load.num_free_blocks, "decode": d.load.num_free_blocks}
            total = {"prefill": p.load.num_total_blocks, "decode": d.load.num_total_blocks}
            return f"free {free} of {total}, leases active {p.counters['leases_active']}"

        # zero leaked blocks or leases, once the last cancelled requests are cleaned up
        p, d = wait_until(all_returned, 5, lambda: f"every block and lease returned; {held()}", poll_s=0.2)
        assert p.counters.get("leases_expired", 0) == 0  # no lease left to expire
        mem_end = memory(stack)  # the stack at rest
        report = {k: (mem_start.get(k, 0) // 1024, v // 1024) for k, v in mem_end.items()}
        print(f"\nsoak: {NUM_REQUESTS} requests in {elapsed:.1f} s, {counts}; RSS MiB start->end {report}")
        for key, (start_mib, end_mib) in report.items():
            assert end_mib <= start_mib * 1.15 + 16, f"{key} grew from {start_mib} to {end_mib} MiB"
    finally:
        stack.stop()
