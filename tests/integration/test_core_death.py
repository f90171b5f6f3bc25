"""A forged internal call cannot crash an engine core, and a core that dies anyway is noticed at once:
its service fails the in-flight requests with a clear error, answers UNAVAILABLE, and exits 1."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from pathlib import Path

import grpc
import pytest

from splitserve.common.default_model_path import default_model_path
from splitserve.protos import common_pb2, decode_pb2, decode_pb2_grpc, prefill_pb2
from tests.service_client import DecodeSession, generate_disaggregated, prefill_stub
from tests.service_harness import ENGINE, start_service, stop_all

pytestmark = pytest.mark.slow
GREEDY = common_pb2.SamplingParams(temperature=0.0, max_tokens=8)
LONG = common_pb2.SamplingParams(temperature=0.0, max_tokens=900, ignore_eos=True)


@contextlib.contextmanager
def running_services(logs: Path):
    """A prefill and a decode peered with it (shm), on the default model."""
    model = default_model_path()
    prefill, p_addr = start_service("prefill", model, logs, "prefill", service_args=["--kv-transport", "shm"], **ENGINE)
    decode, d_addr = start_service(
        "decode",
        model,
        logs,
        "decode",
        service_args=["--kv-transport", "shm", "--prefill-peers", p_addr],
        **ENGINE,
    )
    procs = [prefill, decode]
    try:
        for proc in procs:
            proc.wait_ready()
        yield {"prefill": (prefill, p_addr), "decode": (decode, d_addr)}
    finally:
        stop_all(procs)


@pytest.fixture(scope="module")
def serving(tmp_path_factory):
    """Services the forged calls leave serving: shared by those tests."""
    with running_services(tmp_path_factory.mktemp("core-death")) as services:
        yield services


@pytest.fixture()
def services(tmp_path):
    """Services of their own, for a test that kills one."""
    with running_services(tmp_path) as services:
        yield services


def core_pid(service_pid: int) -> int:
    """The engine core: the service's child that multiprocessing spawned (not its resource tracker)."""
    cores = []
    for child in Path(f"/proc/{service_pid}/task/{service_pid}/children").read_text().split():
        cmdline = Path(f"/proc/{child}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        if "spawn_main" in cmdline and "resource_tracker" not in cmdline:
            cores.append(int(child))
    assert len(cores) == 1, cores
    return cores[0]


def test_a_forged_first_token_id_is_refused_and_the_decode_keeps_serving(serving):
    prefill_addr, decode_addr = serving["prefill"][1], serving["decode"][1]

    async def main():
        session = DecodeSession(decode_addr)
        try:
            forged = decode_pb2.DecodeRequest(
                request_id="forged",
                prompt_token_ids=[1, 2, 3],
                sampling=GREEDY,
                first_token_id=4294967295,
                kv=common_pb2.KvHandle(
                    prefill_instance="prefill",
                    prefill_address=prefill_addr,
                    block_ids=[0],
                    num_tokens=3,
                    transport="shm",
                ),
            )
            session.submit(forged)
            _, deltas = await session.collect("forged", timeout_s=10)
            tokens, _, _ = await generate_disaggregated(prefill_stub(prefill_addr), session, "ok", [5, 6, 7, 8], GREEDY)
            return deltas, tokens
        finally:
            await session.close()

    deltas, tokens = asyncio.run(main())
    assert [(d.finish_reason, d.error) for d in deltas] == [
        (common_pb2.FINISH_REASON_ERROR, "first_token_id is 4294967295, not below vocab_size 8192")
    ]
    assert len(tokens) == 8  # served after the forged call
    assert serving["decode"][0].popen.poll() is None


def test_a_dead_engine_core_fails_in_flight_requests_and_its_service_exits_1(services):
    decode, decode_addr = services["decode"]
    prefill_addr = services["prefill"][1]

    async def main():
        session = DecodeSession(decode_addr)
        try:
            session.submit(decode_pb2.DecodeRequest(request_id="long", prompt_token_ids=[5, 6, 7], sampling=LONG))
            first = await asyncio.wait_for(session.results.setdefault("long", asyncio.Queue()).get(), 30)
            assert first.token_ids, first  # it runs
            os.kill(core_pid(decode.popen.pid), signal.SIGKILL)
            killed = time.monotonic()
            _, deltas = await session.collect("long", timeout_s=5)
            noticed_s = time.monotonic() - killed
            return deltas[-1], noticed_s
        finally:
            await session.close()

    last, noticed_s = asyncio.run(main())
    assert last.finish_reason == common_pb2.FINISH_REASON_ERROR
    assert last.error == "decode: engine core process exited (exit code -9)"
    assert last.unavailable  # the instance failed, not the request: the gateway answers 503, never 500
    assert noticed_s < 1.0
    assert decode.popen.wait(10) == 1
    assert (
        "engine core process exited (exit code -9); failing in-flight requests and exiting"
        in decode.log_path.read_text()
    )

    async def refused() -> grpc.StatusCode:
        async with grpc.aio.insecure_channel(decode_addr) as channel:
            try:
                await decode_pb2_grpc.DecodeStub(channel).Describe(common_pb2.DescribeRequest(), timeout=2)
            except grpc.aio.AioRpcError as exc:
                return exc.code()
        return grpc.StatusCode.OK

    assert asyncio.run(refused()) == grpc.StatusCode.UNAVAILABLE  # gone: the gateway marks it down
    assert prefill_addr  # the prefill is untouched
    assert services["prefill"][0].popen.poll() is None


def test_forged_internal_calls_are_refused_naming_the_field(serving):
    """A lease longer than the prefill grants, and a handle naming a prefill this decode
    does not know, are refused; the decode never dials the forged address."""
    prefill_addr, decode_addr = serving["prefill"][1], serving["decode"][1]

    async def main():
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await prefill_stub(prefill_addr).Prefill(
                prefill_pb2.PrefillRequest(
                    request_id="l", prompt_token_ids=[1, 2, 3], sampling=GREEDY, lease_ms=2**32 - 1
                ),
                timeout=10,
            )
        session = DecodeSession(decode_addr)
        try:
            forged = decode_pb2.DecodeRequest(
                request_id="elsewhere",
                prompt_token_ids=[1, 2, 3],
                sampling=GREEDY,
                first_token_id=5,
                kv=common_pb2.KvHandle(
                    prefill_instance="p", prefill_address="10.9.9.9:1", block_ids=[0], num_tokens=3, transport="shm"
                ),
            )
            session.submit(forged)
            _, deltas = await session.collect("elsewhere", timeout_s=10)
        finally:
            await session.close()
        return info.value, deltas

    refused, deltas = asyncio.run(main())
    assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert refused.details() == "lease_ms is 4294967295, but this prefill grants at most 30000 ms (--lease-s)"
    assert [(d.finish_reason, d.error) for d in deltas] == [
        (
            common_pb2.FINISH_REASON_ERROR,
            f"kv.prefill_address '10.9.9.9:1' is not one of this decode's --prefill-peers ({prefill_addr})",
        )
    ]
