"""The nccl transport (gloo on CPU) between services of different tensor-parallel sizes: a prefill at TP 2, a
decode at TP 1 and one at TP 4 (the model's 2 KV heads replicated on 4 ranks), so the pairs cover two prefill
ranks into one decode rank (2,1) and each prefill rank's head sent to the two decode ranks holding it (2,4); every
plan shape byte for byte: tests/engine/test_nccl_tensor_parallel.py. Tokens equal the colocated TP 1 engine's,
also for a prompt whose first blocks the decode has cached (only the rest is pulled); after normal ends and an
abort per pair every pool is free and every lease released; a prefill whose rank 1 is killed exits. Three
services (7 ranks), started at once, keep it short: one start took 20-50 s on two cores at a load of 9."""

from __future__ import annotations

import asyncio
import os
import signal
from concurrent.futures import ThreadPoolExecutor

import pytest

from splitserve.engine import LLM
from splitserve.protos import common_pb2
from tests.integration.test_tensor_parallel_services import (  # noqa: F401  (model: the fixture)
    MAX_TOKENS,
    PROMPTS,
    model,
    rank1_pid,
    run_pairs,
    settled,
)
from tests.model_factory import engine_reference
from tests.service_client import DecodeSession, generate_disaggregated, prefill_stub
from tests.service_harness import ENGINE, start_service, wait_until

pytestmark = pytest.mark.slow
PREFILL_SIZES, DECODE_SIZES = (2,), (1, 4)
GREEDY = common_pb2.SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def _nccl_tp(size: int) -> list[str]:
    return ["--kv-transport", "nccl", "--tensor-parallel-size", str(size)]


@pytest.fixture()
def nccl_stack(tmp_path, model):  # noqa: F811
    """All three start at once: a decode pairs with the prefill in the background once it answers."""
    procs, prefills, decodes = {}, {}, {}
    try:
        for size in PREFILL_SIZES:
            name = f"prefill-tp{size}"
            procs[name], prefills[size] = start_service(
                "prefill", model, tmp_path, name, service_args=_nccl_tp(size), **ENGINE
            )
        peers = ",".join(prefills.values())
        for size in DECODE_SIZES:
            name = f"decode-tp{size}"
            args = [*_nccl_tp(size), "--prefill-peers", peers]
            procs[name], decodes[size] = start_service("decode", model, tmp_path, name, service_args=args, **ENGINE)
        for proc in procs.values():
            proc.wait_ready()
        yield prefills, decodes, procs
    finally:
        with ThreadPoolExecutor(len(procs) or 1) as pool:  # each waits for its drain: stop them side by side
            list(pool.map(lambda proc: proc.stop(), procs.values()))


def test_nccl_between_tp_sizes_gives_tp1_tokens_frees_every_block_and_a_dead_rank_ends_its_prefill(
    nccl_stack,
    model,  # noqa: F811
):
    prefills, decodes, procs = nccl_stack
    pairs = [(p, d) for p in PREFILL_SIZES for d in DECODE_SIZES]
    prompts = {pair: [[400 + 10 * pair[0] + pair[1], *prompt] for prompt in PROMPTS] for pair in pairs}
    # then each decode again: the longest prompt and 5 tokens more, its first 3 blocks cached there (prefix reuse)
    longer = {pair: [*prompts[pair][2], 7, 8, 9, 10, 11] for pair in pairs}
    with LLM(model=str(model), device="cpu", **ENGINE) as llm:
        flat, _ = engine_reference(
            llm, [p for pair in pairs for p in prompts[pair]] + [longer[pair] for pair in pairs], MAX_TOKENS, []
        )
    expected = {pair: flat[3 * i : 3 * i + 3] for i, pair in enumerate(pairs)}
    expected_longer = dict(zip(pairs, flat[3 * len(pairs) :]))

    async def main():
        got, aborted = await run_pairs(prefills, decodes, pairs, prompts)
        for pair in pairs:
            session = DecodeSession(decodes[pair[1]])
            try:
                stub, name = prefill_stub(prefills[pair[0]]), f"p{pair[0]}d{pair[1]}-longer"
                got[pair, "longer"], _, _ = await generate_disaggregated(stub, session, name, longer[pair], GREEDY)
            finally:
                await session.close()
        return got, aborted, await settled(prefills, decodes)

    got, aborted, described = asyncio.run(main())
    assert {k: v for k, v in got.items() if "longer" not in k} == expected
    assert {pair: got[pair, "longer"] for pair in pairs} == expected_longer
    assert {pair: last.finish_reason for pair, last in aborted.items()} == dict.fromkeys(
        pairs, common_pb2.FINISH_REASON_ABORT
    )
    assert [d.layout.tensor_parallel_size for d in described] == [*PREFILL_SIZES, *DECODE_SIZES]
    # over nccl from the prefill: the batch's blocks, the aborted request's two, the longer prompt's last two (19
    # tokens: 5 blocks, the first 3 cached on the decode)
    blocks_per_decode = sum(-(-(len(prompt) + 1) // 4) for prompt in PROMPTS) + 2 + 2
    for d in described[1:]:
        assert d.counters["kv_blocks_pulled"] == blocks_per_decode
        assert d.counters.get("kv_pull_failures", 0) == 0 and d.counters.get("kv_pull_recomputes", 0) == 0
    prefill = described[0]  # two decodes, five requests each: one lease each, released once sent to all ranks
    assert prefill.counters["leases_released"] == 10 and prefill.counters.get("leases_active", 0) == 0
    assert prefill.counters["kv_blocks_sent"] == 2 * blocks_per_decode
    for d in described:  # every pool entirely free again
        assert d.load.num_free_blocks == d.load.num_total_blocks

    prefill = procs["prefill-tp2"]
    os.kill(wait_until(lambda: rank1_pid(prefill.popen.pid), 5, "no rank 1 under the TP 2 prefill"), signal.SIGKILL)
    assert prefill.popen.wait(30) == 1  # its core fails the next collective and the service exits
