"""A mixture-of-experts model (Qwen3-MoE, top-2 of 4 experts, a dense layer between sparse ones) through real
processes: prefill + decode moving its KV over shm, and one colocated worker prefilling locally. The tokens
equal the in-process engine's, which equal transformers' (tests/engine/test_moe_exact.py)."""

import asyncio

import pytest

from splitserve.engine import LLM
from splitserve.protos import decode_pb2, decode_pb2_grpc
from tests.engine.test_moe_exact import MOE_MODELS
from tests.integration.test_services import sampling, wait_blocks_free, wait_peer_prepared
from tests.model_factory import engine_reference, make_tiny_model_dir
from tests.service_client import DecodeSession, describe, generate_disaggregated, prefill_stub
from tests.service_harness import start_service, stop_all, wait_until_async

pytestmark = pytest.mark.slow
PROMPTS = [[5, 17, 99, 3, 250, 7, 8, 9, 10], [7, 7, 7, 7, 7], list(range(20, 41))]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    name = "qwen3moe-top2-dense1"
    return make_tiny_model_dir(tmp_path_factory.mktemp("moesvc"), name=name, **MOE_MODELS[name])


@pytest.fixture(scope="module")
def reference(model_dir):
    llm = LLM(model=str(model_dir), dtype="float64", device="cpu", block_size=4, num_kv_blocks=256)
    greedy, _ = engine_reference(llm, PROMPTS, 8, [])
    return greedy


def test_disaggregated_tokens_equal_the_engine(model_dir, reference, tmp_path):
    args = ["--kv-transport", "shm", "--kv-transfer-timeout-s", "5"]
    prefill, p_addr = start_service("prefill", model_dir, tmp_path, "p-moe", service_args=args)
    decode, d_addr = start_service(
        "decode", model_dir, tmp_path, "d-moe", service_args=[*args, "--prefill-peers", p_addr]
    )
    try:
        prefill.wait_ready()
        decode.wait_ready()

        async def main():
            await wait_peer_prepared(d_addr, "shm")
            session = DecodeSession(d_addr)
            stub = prefill_stub(p_addr)
            results = [
                await generate_disaggregated(stub, session, f"m{i}", p, sampling()) for i, p in enumerate(PROMPTS)
            ]
            await session.close()
            await wait_blocks_free({"prefill": p_addr, "decode": d_addr})
            return [r[0] for r in results]

        tokens = asyncio.run(main())
    finally:
        stop_all([prefill, decode])
    assert tokens == reference


async def all_blocks_free(address: str) -> bool:
    load = (await describe(address, decode_pb2_grpc.DecodeStub)).load
    return load.num_free_blocks == load.num_total_blocks


def test_colocated_worker_tokens_equal_the_engine(model_dir, reference, tmp_path):
    worker, address = start_service("worker", model_dir, tmp_path, "w-moe")
    try:
        worker.wait_ready()

        async def main():
            session = DecodeSession(address)
            for i, prompt in enumerate(PROMPTS):  # no KV handle: the worker prefills locally
                session.submit(
                    decode_pb2.DecodeRequest(request_id=f"c{i}", prompt_token_ids=prompt, sampling=sampling())
                )
            tokens = [(await session.collect(f"c{i}"))[0] for i in range(len(PROMPTS))]
            await session.close()
            await wait_until_async(lambda: all_blocks_free(address), 10, "the worker still holds KV blocks")
            return tokens

        tokens = asyncio.run(main())
    finally:
        worker.stop()
    assert tokens == reference
