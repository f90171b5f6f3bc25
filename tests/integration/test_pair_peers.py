"""A prefill with --decode-peers pairs (nccl; gloo on CPU) only with a decode that confirms the
pairing itself. A forged PairKv (an unknown decode, or a real decode's name with another store) is refused
with PERMISSION_DENIED before the engine core hears of it: the real pair's communicator keeps working and
the forged store is never dialed."""

from __future__ import annotations

import asyncio
import socket

import grpc
import pytest

from splitserve.common.default_model_path import default_model_path
from splitserve.protos import common_pb2, decode_pb2_grpc, prefill_pb2
from tests.service_client import DecodeSession, describe, generate_disaggregated, prefill_stub
from tests.service_harness import ENGINE, free_port, start_service, stop_all, wait_until_async

pytestmark = pytest.mark.slow
GREEDY = common_pb2.SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture()
def paired(tmp_path):
    model = default_model_path()
    p_port, d_port = free_port(), free_port()
    p_addr, d_addr = f"127.0.0.1:{p_port}", f"127.0.0.1:{d_port}"
    prefill, _ = start_service(
        "prefill",
        model,
        tmp_path,
        "prefill",
        port=p_port,
        service_args=["--kv-transport", "nccl", "--decode-peers", d_addr],
        **ENGINE,
    )
    decode, _ = start_service(
        "decode",
        model,
        tmp_path,
        "decode-a",
        port=d_port,
        service_args=["--kv-transport", "nccl", "--prefill-peers", p_addr],
        **ENGINE,
    )
    try:
        prefill.wait_ready()
        decode.wait_ready()
        yield p_addr, d_addr
    finally:
        stop_all([prefill, decode])


async def forge(prefill_addr: str, decode_instance: str, store_port: int) -> grpc.aio.AioRpcError:
    request = prefill_pb2.PairKvRequest(
        decode_instance=decode_instance, store_host="127.0.0.1", store_port=store_port, backend="gloo"
    )
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await prefill_stub(prefill_addr).PairKv(request, timeout=30)
    return info.value


def test_a_forged_pair_kv_is_refused_and_the_real_pair_keeps_working(paired):
    prefill_addr, decode_addr = paired
    store = socket.create_server(("127.0.0.1", 0))  # a forged store: the prefill must never dial it
    store.setblocking(False)
    store_port = store.getsockname()[1]

    async def main():
        async def decode_paired():
            d = await describe(decode_addr, decode_pb2_grpc.DecodeStub)
            return d.counters.get("pairs_created") == 1

        await wait_until_async(decode_paired, 30, "the decode never paired with its --prefill-peers")
        unknown = await forge(prefill_addr, "intruder", store_port)
        impostor = await forge(prefill_addr, "decode-a", store_port)  # the real decode's name, another store
        session = DecodeSession(decode_addr)
        try:
            tokens, _, _ = await generate_disaggregated(prefill_stub(prefill_addr), session, "r", [5, 6, 7, 8], GREEDY)
        finally:
            await session.close()
        p = await describe(prefill_addr)
        d = await describe(decode_addr, decode_pb2_grpc.DecodeStub)
        return unknown, impostor, tokens, p.counters, d.counters

    unknown, impostor, tokens, p_counters, d_counters = asyncio.run(main())
    peers = f"no decode of this prefill's --decode-peers ({decode_addr}) confirms that pairing"
    assert (unknown.code(), unknown.details()) == (
        grpc.StatusCode.PERMISSION_DENIED,
        f"PairKv as decode 'intruder' with store 127.0.0.1:{store_port} refused: {peers}",
    )
    assert (impostor.code(), impostor.details()) == (
        grpc.StatusCode.PERMISSION_DENIED,
        f"PairKv as decode 'decode-a' with store 127.0.0.1:{store_port} refused: {peers}",
    )
    with pytest.raises(BlockingIOError):
        store.accept()  # nobody connected to the forged store
    store.close()
    # the pair made at start still carries the KV: pulled, not recomputed, never re-paired
    assert len(tokens) == 8
    assert (p_counters["pairs_created"], p_counters["pairs_refused"]) == (1, 2)
    assert d_counters["pairs_created"] == 1 and d_counters["kv_blocks_pulled"] == 1
    assert "kv_pull_recomputes" not in d_counters and "kv_pull_failures" not in d_counters
