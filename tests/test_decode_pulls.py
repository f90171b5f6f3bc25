"""PullCoordinator on its own (fake service and prefill stub): a request cancelled while the decode still
asks its prefill for the pool's endpoint never reaches the core, and its lease is released."""

import asyncio
from types import SimpleNamespace
from unittest import mock

import torch

from decode_service.pulls import PullCoordinator
from engine import core_messages as m
from protos import common_pb2, decode_pb2, prefill_pb2

ENDPOINT = {"shm_name": "splitserve-kv-p0-1", "num_blocks": "64"}


class SlowPrefill:
    """Describe waits for `go`; ReleaseKv records the lease."""

    def __init__(self) -> None:
        self.go = asyncio.Event()
        self.released: list[str] = []
        self.described = 0

    async def Describe(self, request, timeout=None):
        self.described += 1
        await self.go.wait()
        return common_pb2.DescribeResponse(kv_endpoint=ENDPOINT)

    async def ReleaseKv(self, request, timeout=None, wait_for_ready=None):
        self.released.append(request.lease_id)
        return prefill_pb2.ReleaseKvResponse(released=True)


def request(rid: str) -> decode_pb2.DecodeRequest:
    kv = common_pb2.KvHandle(prefill_instance="p0", prefill_address="127.0.0.1:1", block_ids=[0, 1], num_tokens=8,
                             transport="shm", endpoint=ENDPOINT, lease=common_pb2.Lease(lease_id=f"l-{rid}", epoch=3))
    return decode_pb2.DecodeRequest(request_id=rid, prompt_token_ids=list(range(8)), first_token_id=5, kv=kv)


def test_a_request_cancelled_while_the_decode_asks_its_prefill_never_reaches_the_core():
    sent = []
    service = SimpleNamespace(config=SimpleNamespace(kv_transfer_timeout_s=2.0, kv_load_failure_policy="recompute"),
                              client=SimpleNamespace(send=sent.append), faults={})
    prefill = SlowPrefill()

    async def main():
        pulls = PullCoordinator(service)
        pulls.stub = lambda address: prefill
        pulls.start(request("a"), params=None)
        pulls.start(request("b"), params=None)
        await asyncio.sleep(0.05)  # both wait on Describe
        pulls.cancel("a")
        prefill.go.set()
        await asyncio.sleep(0.05)

    asyncio.run(main())
    imports = [msg for msg in sent if isinstance(msg, m.ImportKv)]
    assert [msg.request_id for msg in imports] == ["b"]  # "a" never reached the core
    assert imports[0].spec.endpoint == ENDPOINT  # the endpoint the prefill reported itself
    assert prefill.released == ["l-a"] and prefill.described == 2


class PairingPrefill:
    """Describe reports a GPU; PairKv answers at once."""

    def __init__(self, gpu_uuid: str) -> None:
        self.gpu_uuid = gpu_uuid
        self.described = 0

    async def Describe(self, request, timeout=None):
        self.described += 1
        return common_pb2.DescribeResponse(kv_endpoint={"gpu_uuid": self.gpu_uuid} if self.gpu_uuid else {})

    async def PairKv(self, request, timeout=None, wait_for_ready=None):
        return prefill_pb2.PairKvResponse(paired=True)


def pair_messages(keepalive_ms: float, prefill: PairingPrefill, device: str = "cuda:0") -> list:
    """The core messages pairing sends, on a decode whose device is `device` (CUDA is faked on this CPU)."""
    calls = []

    async def call(make_msg, timeout_s=None):
        calls.append(make_msg(1))
        return True

    config = SimpleNamespace(kv_transfer_timeout_s=2.0, kv_load_failure_policy="recompute", kv_link_keepalive_ms=keepalive_ms,
                             peer_host="127.0.0.1", host="127.0.0.1")
    service = SimpleNamespace(config=config, name="d0", count=lambda *a: None,
                              client=SimpleNamespace(call=call, info=SimpleNamespace(device=device)))

    async def main():
        pulls = PullCoordinator(service)
        pulls.stub = lambda address: prefill
        await pulls.ensure_pair("p0", "127.0.0.1:1")

    with mock.patch.object(torch.cuda, "is_available", lambda: device.startswith("cuda")):
        asyncio.run(main())
    return calls


def test_pairing_hands_the_core_the_gpu_the_prefill_reports_in_describe_only_with_the_keepalive():
    prefill = PairingPrefill("GPU-1234")
    (msg,) = pair_messages(2.0, prefill)
    assert isinstance(msg, m.Pair) and msg.pair == "p0->d0" and msg.backend == "nccl"
    assert msg.peer_gpu_uuid == "GPU-1234" and prefill.described == 1
    on_cpu = PairingPrefill("GPU-1234")
    (msg,) = pair_messages(2.0, on_cpu, device="cpu")  # a CPU decode pairs over gloo: no link to keep awake
    assert msg.backend == "gloo" and msg.peer_gpu_uuid == "" and on_cpu.described == 0
    quiet = PairingPrefill("GPU-1234")
    (msg,) = pair_messages(0.0, quiet)
    assert msg.peer_gpu_uuid == "" and quiet.described == 0  # no keep-alive: no extra Describe
    (msg,) = pair_messages(2.0, PairingPrefill(""))  # a CPU (or older) prefill reports no GPU
    assert msg.peer_gpu_uuid == ""

    class Mute(PairingPrefill):
        async def Describe(self, request, timeout=None):
            raise ConnectionError("no answer")

    (msg,) = pair_messages(2.0, Mute("GPU-1234"))  # a Describe that fails costs the keep-alive, not the pair
    assert msg.pair == "p0->d0" and msg.peer_gpu_uuid == ""
