"""Services with --tensor-parallel-size: a colocated worker at TP 2 (its core is rank 0 and starts rank 1) gives
the in-process TP 1 engine's tokens, and a rank that dies fails the in-flight requests naming it and ends the
service; prefills and decodes of TP 1, 2 and 4 hand KV to each other over shm with the same tokens."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import pytest

from splitserve.engine import LLM
from splitserve.protos import common_pb2, decode_pb2, decode_pb2_grpc, prefill_pb2
from tests.model_factory import engine_reference, make_tiny_model_dir
from tests.service_client import DecodeSession, decode_request, describe, generate_disaggregated, prefill_stub
from tests.service_harness import ENGINE, start_service, stop_all, wait_until, wait_until_async

pytestmark = pytest.mark.slow
PROMPTS = [[5, 6, 7], [100, 200, 300, 400, 450, 480, 500], [42] * 13]
MAX_TOKENS = 8
LONG = common_pb2.SamplingParams(temperature=0.0, max_tokens=500, ignore_eos=True)  # aborted before its end


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
    assert proc.popen.wait(30) == 1  # it drains and exits: above 10 s at a load average of 10 on two cores


SIZES = (1, 2, 4)  # a prefill and a decode of each: 4 ranks replicate the model's 2 KV heads
# One pair per plan shape: one prefill rank split over decode ranks, prefill ranks gathered into one decode rank,
# rank to rank, and heads replicated on either side. The other four pairs of SIZES repeat a shape: (1, 1) is
# every other stack test, (4, 4) rank to rank as (2, 2), (1, 4) a split as (1, 2), (4, 1) a gather as (2, 1);
# tests/common/test_kv_layout.py checks plans of each shape, replicated heads read in turn among them.
PAIRS = ((1, 2), (2, 1), (2, 2), (4, 2), (2, 4))


@pytest.fixture()
def pd_stack(tmp_path, model):
    """Prefills and decodes at TP 1, 2 and 4, each decode peered with every prefill (shm). The prefills start
    together, then the decodes: all 14 ranks at once on two cores took longer than a start may take."""
    procs = []
    try:
        prefills = {}
        for size in SIZES:
            proc, prefills[size] = start_service(
                "prefill", model, tmp_path, f"prefill-tp{size}", service_args=_tp(size), **ENGINE
            )
            procs.append(proc)
        for proc in procs:
            proc.wait_ready()
        peers = ",".join(prefills.values())
        decodes = {}
        for size in SIZES:
            args = [*_tp(size), "--prefill-peers", peers]
            proc, decodes[size] = start_service(
                "decode", model, tmp_path, f"decode-tp{size}", service_args=args, **ENGINE
            )
            procs.append(proc)
        for proc in procs[len(SIZES) :]:
            proc.wait_ready()
        yield prefills, decodes
    finally:
        stop_all(procs)


def _tp(size: int) -> list[str]:
    return ["--kv-transport", "shm", "--tensor-parallel-size", str(size)]


async def settled(prefills: dict, decodes: dict) -> list:
    """Every service's Describe once every pool is free and no prefill holds a lease: leases are released, and blocks
    freed, just after the last delta goes out. Prefills first, then decodes, each in their dicts' order."""
    last = []

    async def states():
        last[:] = [await describe(a) for a in prefills.values()]
        last.extend([await describe(a, decode_pb2_grpc.DecodeStub) for a in decodes.values()])
        done = all(d.load.num_free_blocks == d.load.num_total_blocks for d in last)
        leases = all(p.counters.get("leases_active", 0) == 0 for p in last[: len(prefills)])
        return last if done and leases else None

    return await wait_until_async(states, 10, lambda: f"not settled: {last}")


async def run_pairs(prefills: dict, decodes: dict, pairs, prompts: dict) -> tuple[dict, dict]:
    """Each (prefill TP, decode TP) pair's batch and one aborted request: tokens and the abort's last delta, by pair."""
    got, aborted = {}, {}
    for p_size, d_size in pairs:
        doomed = [300 + 10 * p_size + d_size, 1, 2, 3, 4, 5]  # 6 tokens: 2 blocks
        got[p_size, d_size], aborted[p_size, d_size] = await _run_pair(
            prefills[p_size], decodes[d_size], f"p{p_size}d{d_size}", prompts[p_size, d_size], doomed
        )
    return got, aborted


async def _run_pair(prefill: str, decode: str, name: str, batch: list[list[int]], doomed: list[int]):
    """`batch` through `prefill` and `decode` at once (greedy, MAX_TOKENS each), and `doomed` aborted on the
    decode after its first decoded delta; returns (the batch's tokens, the aborted request's last delta)."""
    greedy = common_pb2.SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    session = DecodeSession(decode)
    try:
        stub = prefill_stub(prefill)
        first = await stub.Prefill(
            prefill_pb2.PrefillRequest(request_id=f"{name}-abort", prompt_token_ids=doomed, sampling=LONG), timeout=60
        )
        queue = session.submit(decode_request(first, f"{name}-abort", doomed, LONG))
        runs = [generate_disaggregated(stub, session, f"{name}-{i}", p, greedy) for i, p in enumerate(batch)]
        await asyncio.wait_for(queue.get(), 30)  # a decoded delta: its KV was pulled and it runs
        session.abort(f"{name}-abort")
        _, deltas = await session.collect(f"{name}-abort")
        return [tokens for tokens, _, _ in await asyncio.gather(*runs)], deltas[-1]
    finally:
        await session.close()


def test_prefill_and_decode_of_any_tp_sizes_give_tp1_tokens_and_free_every_block(pd_stack, model):
    """(prefill TP, decode TP) of PAIRS, (1, 2), (2, 1), (2, 2), (4, 2) and (2, 4): each
    decode rank's heads come from the prefill ranks that hold them (shm, a transfer plan per pair); tokens
    equal the colocated TP 1 engine's, and a request aborted mid-decode frees its blocks. Each pair's prompts
    are its own, so every block is pulled (none is in the decode's prefix cache)."""
    prefills, decodes = pd_stack
    pairs = list(PAIRS)
    prompts = {pair: [[400 + 10 * pair[0] + pair[1], *prompt] for prompt in PROMPTS] for pair in pairs}
    with LLM(model=str(model), device="cpu", **ENGINE) as llm:
        flat, _ = engine_reference(llm, [p for pair in pairs for p in prompts[pair]], MAX_TOKENS, [])
    expected = {pair: flat[3 * i : 3 * i + 3] for i, pair in enumerate(pairs)}

    async def main():
        got, aborted = await run_pairs(prefills, decodes, pairs, prompts)
        return got, aborted, await settled(prefills, decodes)

    got, aborted, described = asyncio.run(main())
    assert got == expected
    assert {pair: last.finish_reason for pair, last in aborted.items()} == dict.fromkeys(
        pairs, common_pb2.FINISH_REASON_ABORT
    )
    # per pair: the batch's blocks and the aborted request's two
    blocks_per_pair = sum(-(-(len(prompt) + 1) // 4) for prompt in PROMPTS) + 2
    for size, d in zip(SIZES, described[3:]):
        assert d.counters["kv_blocks_pulled"] == blocks_per_pair * sum(pair[1] == size for pair in pairs)
        assert d.counters.get("kv_pull_failures", 0) == 0 and d.counters.get("kv_pull_recomputes", 0) == 0
    for size, p in zip(SIZES, described[:3]):  # four requests per pair
        assert p.counters["leases_released"] == 4 * sum(pair[0] == size for pair in pairs)
        assert p.counters.get("leases_active", 0) == 0
    for d in described:  # every pool entirely free again
        assert d.load.num_free_blocks == d.load.num_total_blocks
    assert [d.layout.tensor_parallel_size for d in described] == [*SIZES, *SIZES]
