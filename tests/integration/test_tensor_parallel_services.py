"""A colocated worker with --tensor-parallel-size 2: its core is rank 0 and starts rank 1; tokens equal the
in-process TP 1 engine's, and a rank that dies fails the in-flight requests naming it and ends the service."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import pytest

from splitserve.engine import LLM
from splitserve.protos import common_pb2, decode_pb2
from tests.model_factory import engine_reference, make_tiny_model_dir
from tests.service_client import DecodeSession
from tests.service_harness import ENGINE, start_service, wait_until

pytestmark = pytest.mark.slow
PROMPTS = [[5, 6, 7], [100, 200, 300, 400, 450, 480, 500], [42] * 13]
MAX_TOKENS = 8


def children(pid: int) -> list[int]:
    return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def cmdline(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()


def rank1_pid(service_pid: int) -> int | None:
    """Rank 1: forked by the forkserver that the service's engine core (rank 0) started."""
    for core in children(service_pid):
        if "spawn_main" not in cmdline(core) or "resource_tracker" in cmdline(core):
            continue
        for server in children(core):
            if "forkserver" in cmdline(server):
                ranks = children(server)
                return ranks[0] if len(ranks) == 1 else None
    return None


@pytest.fixture()
def model(tmp_path):
    return make_tiny_model_dir(tmp_path, "qwen3", num_kv_heads=2, name="tp-tiny", max_position_embeddings=4096)


@pytest.fixture()
def worker(tmp_path, model):
    args = ["--tensor-parallel-size", "2"]
    proc, address = start_service("worker", model, tmp_path, "worker", service_args=args, **ENGINE)
    try:
        proc.wait_ready()
        yield proc, address
    finally:
        proc.stop()


def test_tp2_worker_tokens_equal_tp1_and_a_dead_rank_ends_it(worker, model):
    proc, address = worker
    with LLM(model=str(model), device="cpu", **ENGINE) as llm:
        expected, _ = engine_reference(llm, PROMPTS, MAX_TOKENS, [])
    greedy = common_pb2.SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    long = common_pb2.SamplingParams(temperature=0.0, max_tokens=900, ignore_eos=True)

    async def main():
        session = DecodeSession(address)
        try:
            for i, prompt in enumerate(PROMPTS):
                session.submit(decode_pb2.DecodeRequest(request_id=f"r{i}", prompt_token_ids=prompt, sampling=greedy))
            got = [(await session.collect(f"r{i}", timeout_s=60))[0] for i in range(len(PROMPTS))]
            session.submit(decode_pb2.DecodeRequest(request_id="long", prompt_token_ids=[5, 6, 7], sampling=long))
            first = await asyncio.wait_for(session.results.setdefault("long", asyncio.Queue()).get(), 30)
            assert first.token_ids, first  # it runs
            rank1 = wait_until(lambda: rank1_pid(proc.popen.pid), 5, "no rank 1 process under the worker's core")
            os.kill(rank1, signal.SIGKILL)
            _, deltas = await session.collect("long", timeout_s=20)
            return got, deltas[-1]
        finally:
            await session.close()

    got, last = asyncio.run(main())
    assert got == expected
    assert last.finish_reason == common_pb2.FINISH_REASON_ERROR
    assert last.error == (
        "worker: engine core process exited (exit code 1): splitserve.engine.worker.tensor_parallel."
        "TensorParallelError: tensor-parallel rank 1 of 2 exited (exit code -9)"
    )
    assert proc.popen.wait(10) == 1
