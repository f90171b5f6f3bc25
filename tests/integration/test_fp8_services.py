"""fp8 weights and an fp8 KV cache through the disaggregated path: prefill and decode processes on CPU
(shm, and nccl over gloo) move e4m3 blocks (one byte an element) and the tokens equal the in-process
engine's with the same flags; both describe the fp8 layout with its scales."""

import asyncio

import pytest

from splitserve.common.wire import layout_from_proto
from splitserve.engine import LLM
from splitserve.protos import decode_pb2_grpc
from tests.integration.test_services import sampling, wait_blocks_free, wait_peer_prepared
from tests.model_factory import engine_reference, make_tiny_model_dir
from tests.service_client import DecodeSession, describe, generate_disaggregated, prefill_stub
from tests.service_harness import start_service

pytestmark = pytest.mark.slow
FP8_FLAGS = dict(kv_cache_dtype="fp8", quantization="fp8")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("fp8svc"), "llama", num_kv_heads=2, name="fp8-tiny")


@pytest.mark.parametrize("transport", ["shm", "nccl"])
def test_fp8_blocks_move_and_tokens_equal_the_engine(model_dir, tmp_path, transport):
    prompts = [[5, 17, 99, 3, 250, 7, 8, 9, 10], [7, 7, 7, 7, 7], list(range(20, 41))]
    llm = LLM(model=str(model_dir), dtype="float64", device="cpu", block_size=4, num_kv_blocks=256, **FP8_FLAGS)
    greedy, _ = engine_reference(llm, prompts, 8, [])
    args = ["--kv-transport", transport, "--kv-transfer-timeout-s", "5"]
    prefill, p_addr = start_service("prefill", model_dir, tmp_path, f"p8-{transport}", service_args=args, **FP8_FLAGS)
    decode, d_addr = start_service(
        "decode", model_dir, tmp_path, f"d8-{transport}", service_args=[*args, "--prefill-peers", p_addr], **FP8_FLAGS
    )
    try:
        prefill.wait_ready()
        decode.wait_ready()

        async def main():
            await wait_peer_prepared(d_addr, transport)
            session = DecodeSession(d_addr)
            stub = prefill_stub(p_addr)
            results = [
                await generate_disaggregated(stub, session, f"f{i}", p, sampling()) for i, p in enumerate(prompts)
            ]
            await session.close()
            await wait_blocks_free({"prefill": p_addr, "decode": d_addr})
            return [r[0] for r in results], await describe(p_addr), await describe(d_addr, decode_pb2_grpc.DecodeStub)

        tokens, p, d = asyncio.run(main())
    finally:
        prefill.stop()
        decode.stop()
    assert tokens == greedy
    layout = layout_from_proto(p.layout)
    assert layout == layout_from_proto(d.layout) == llm.engine.layout
    assert layout.dtype == "float8_e4m3fn" and layout.k_scales == (1.0, 1.0) and layout.v_scales == (1.0, 1.0)
    assert layout.block_nbytes == 2 * 2 * 4 * 2 * 16  # layers x (k, v) x tokens x kv heads x head_dim, 1 byte
    # every block of every prompt (the last one partly filled) was pulled, at one byte an element
    moved_blocks = sum(-(-len(p) // 4) for p in prompts)
    assert d.counters["kv_bytes_pulled"] == moved_blocks * layout.block_nbytes
