"""PullCoordinator on its own (fake service and prefill stub): a request cancelled while the decode still
asks its prefill for the pool's endpoint never reaches the core, and its lease is released; pairing asks the
prefill's GPU only for a GPU decode's keep-alive; an nccl pull commits only when the prefill's SendKv says it sent."""

import asyncio
import time
from types import SimpleNamespace
from unittest import mock

import grpc
import torch

from splitserve.decode_service.pulls import (
    MIN_RELEASE_TIMEOUT_S,
    PendingPull,
    PullCoordinator,
    PullHooks,
    release_timeout_s,
)
from splitserve.engine.core_process import messages as m
from splitserve.engine_service.config import ServiceConfig
from splitserve.protos import common_pb2, decode_pb2, prefill_pb2
from splitserve.runtime.metrics import ServiceCounters
from tests.service_harness import wait_until_async

ENDPOINT = {"shm_name": "splitserve-kv-p0-1", "num_blocks": "64"}


class SlowPrefill:
    """Describe waits for `go`; ReleaseKv records the lease."""

    def __init__(self) -> None:
        self.go = asyncio.Event()
        self.released: list[str] = []
        self.described = 0

    async def Describe(self, request, timeout=None, wait_for_ready=None):
        self.described += 1
        await self.go.wait()
        return common_pb2.DescribeResponse(kv_endpoint=ENDPOINT)

    async def ReleaseKv(self, request, timeout=None, wait_for_ready=None):
        self.released.append(request.lease_id)
        return prefill_pb2.ReleaseKvResponse(released=True)


def coordinator(client, failed: list | None = None, **config) -> PullCoordinator:
    """A decode "d0"'s PullCoordinator with a real config and counters; `failed` collects fail_request calls."""
    hooks = PullHooks(
        span_of=lambda rid: None,
        on_imported=lambda rid, cached, pulled: None,
        fail_request=lambda rid, reason: (failed if failed is not None else []).append((rid, reason)),
    )
    return PullCoordinator(client, ServiceConfig(**config), "d0", None, ServiceCounters(), hooks)


async def wait_for(condition, timeout_s: float, message: str) -> None:
    """Let the coordinator's tasks run until `condition()` holds (bounded)."""

    async def holds():
        return condition()

    await wait_until_async(holds, timeout_s, message, poll_s=0.001)


def request(rid: str) -> decode_pb2.DecodeRequest:
    kv = common_pb2.KvHandle(
        prefill_instance="p0",
        prefill_address="127.0.0.1:1",
        block_ids=[0, 1],
        num_tokens=8,
        transport="shm",
        endpoint=ENDPOINT,
        lease=common_pb2.Lease(lease_id=f"l-{rid}", epoch=3),
    )
    return decode_pb2.DecodeRequest(request_id=rid, prompt_token_ids=list(range(8)), first_token_id=5, kv=kv)


def test_a_request_cancelled_while_the_decode_asks_its_prefill_never_reaches_the_core():
    sent = []
    prefill = SlowPrefill()

    async def main():
        pulls = coordinator(SimpleNamespace(send=sent.append, flush=lambda: None), kv_transfer_timeout_s=2.0)
        pulls.stub = lambda address: prefill
        pulls.start(request("a"), params=None)
        pulls.start(request("b"), params=None)
        await wait_for(lambda: prefill.described == 2, 2.0, "both pulls should wait on Describe")
        pulls.cancel("a")
        prefill.go.set()
        await wait_for(lambda: sent and prefill.released, 2.0, "b's import and a's release")
        await asyncio.gather(*pulls._tasks)

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

    async def Describe(self, request, timeout=None, wait_for_ready=None):
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

    client = SimpleNamespace(call=call, info=SimpleNamespace(device=device))

    async def main():
        pulls = coordinator(
            client, kv_transport="nccl", kv_transfer_timeout_s=2.0, kv_link_keepalive_ms=keepalive_ms, host="127.0.0.1"
        )
        pulls.stub = lambda address: prefill
        await pulls.link.ensure_pair("p0", "127.0.0.1:1")

    with mock.patch.object(torch.cuda, "is_available", lambda: device.startswith("cuda")):
        asyncio.run(main())
    return calls


def test_a_pull_from_a_prefill_whose_pool_is_mapped_reaches_the_core_within_start():
    """The usual case (the pool mapped at start, or by an earlier pull): no task's turn, no Describe; the import
    carries the lease's slot for the core to check the copy against."""
    sent = []
    pulls = coordinator(SimpleNamespace(send=sent.append, flush=lambda: sent.append("flush")))
    pulls.link._endpoints["127.0.0.1:1"] = dict(ENDPOINT)  # what prepare_peer keeps from the prefill's Describe
    req = request("a")
    req.kv.lease.slot, req.kv.lease.slots_name, req.kv.lease.expires_unix_ns = 4, "splitserve-leases-p0-1", 99
    pulls.start(req, params=None)  # no event loop runs: nothing may wait for one
    (imported, flushed) = sent
    assert flushed == "flush" and pulls._tasks == set() and list(pulls.pending) == ["a"]
    assert (imported.request_id, imported.prompt_token_ids, imported.spec.endpoint) == ("a", list(range(8)), ENDPOINT)
    assert imported.spec.lease == m.LeaseRef("splitserve-leases-p0-1", 4, 3, 99)


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
        async def Describe(self, request, timeout=None, wait_for_ready=None):
            raise ConnectionError("no answer")

    (msg,) = pair_messages(2.0, Mute("GPU-1234"))  # a Describe that fails costs the keep-alive, not the pair
    assert msg.pair == "p0->d0" and msg.peer_gpu_uuid == ""


class SendingPrefill:
    """SendKv answers ok or fails as told; ReleaseKv releases."""

    def __init__(self, send_error: str | None) -> None:
        self.send_error = send_error
        self.sends: list[list[int]] = []

    async def SendKv(self, request, timeout=None, metadata=None, wait_for_ready=None):
        self.sends.append(list(request.block_indices))
        if self.send_error is not None:
            raise grpc.aio.AioRpcError(
                grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(), details=self.send_error
            )
        return prefill_pb2.SendKvResponse(num_bytes=64)

    async def ReleaseKv(self, request, timeout=None, wait_for_ready=None):
        return prefill_pb2.ReleaseKvResponse(released=True)


def finish_nccl_pull(send_error: str | None) -> tuple[list, list, SendingPrefill]:
    """An nccl pull whose receive the core reports done (ok) after asking the prefill to send."""
    sent, failed = [], []
    prefill = SendingPrefill(send_error)

    async def main():
        pulls = coordinator(
            SimpleNamespace(send=sent.append, flush=lambda: None),
            failed,
            kv_transport="nccl",
            kv_transfer_timeout_s=2.0,
            kv_load_failure_policy="fail",
        )
        pulls.stub = lambda address: prefill
        handle = request("r").kv
        handle.transport = "nccl"
        pulls.pending["r"] = PendingPull("r", handle)
        pulls.on_core_message(m.NeedSend("r", "p0->d0", [0, 1]))
        pulls.on_core_message(m.ImportDone("r", ok=True, num_blocks_pulled=2, num_bytes=64))
        await wait_for(lambda: any(isinstance(c, m.CommitImport) for c in sent), 2.0, "the pull's commit")
        await asyncio.gather(*pulls._tasks)

    asyncio.run(main())
    return sent, failed, prefill


def test_an_nccl_pull_commits_only_when_the_prefill_answered_that_it_sent():
    sent, failed, prefill = finish_nccl_pull(None)
    assert prefill.sends == [[0, 1]] and failed == []
    assert [(c.request_id, c.ok) for c in sent if isinstance(c, m.CommitImport)] == [("r", True)]

    # the receive ended (its communicator torn down under it) but the sender says the send failed
    sent, failed, prefill = finish_nccl_pull("communicator aborted")
    commits = [c for c in sent if isinstance(c, m.CommitImport)]
    assert [(c.request_id, c.ok, c.recompute) for c in commits] == [("r", False, False)]
    assert failed == [("r", "the prefill's send failed: communicator aborted")]


def test_every_transport_has_a_way_to_its_prefills():
    from splitserve.decode_service.peers import PEER_LINKS, MappedPools, Pairs
    from splitserve.engine.kv_connectors.factory import TRANSPORTS

    assert PEER_LINKS == {"shm": MappedPools, "cuda_ipc": MappedPools, "nccl": Pairs, "nixl": MappedPools}
    assert set(TRANSPORTS) == set(PEER_LINKS)


class ExpiredLeasePrefill:
    """ReleaseKv answers that the lease was no longer held (it expired during the copy)."""

    def __init__(self) -> None:
        self.released: list[tuple[str, int]] = []

    async def ReleaseKv(self, request, timeout=None, wait_for_ready=None):
        self.released.append((request.lease_id, request.epoch))
        return prefill_pb2.ReleaseKvResponse(released=False)


def finish_copy_under_an_expired_lease(policy: str) -> tuple[list, list, ServiceCounters]:
    sent, failed = [], []
    prefill = ExpiredLeasePrefill()

    async def main():
        pulls = coordinator(
            SimpleNamespace(send=sent.append, flush=lambda: None), failed, kv_load_failure_policy=policy
        )
        pulls.stub = lambda address: prefill
        pulls.pending["r"] = PendingPull("r", request("r").kv)
        pulls.on_core_message(m.ImportDone("r", ok=True, num_blocks_pulled=2, num_bytes=64))
        await wait_for(lambda: sent, 2.0, "the pull's commit")
        await asyncio.gather(*pulls._tasks)
        assert pulls.pending == {} and prefill.released == [("l-r", 3)]
        return pulls.counters

    counters = asyncio.run(main())
    return sent, failed, counters


def test_a_copy_whose_lease_expired_is_discarded_by_the_policy():
    sent, failed, counters = finish_copy_under_an_expired_lease("recompute")
    assert [(c.request_id, c.ok, c.recompute) for c in sent] == [("r", False, True)] and failed == []
    assert counters.values == {"kv_pull_recomputes": 1}  # nothing counted as pulled
    sent, failed, counters = finish_copy_under_an_expired_lease("fail")
    assert [(c.request_id, c.ok, c.recompute) for c in sent] == [("r", False, False)]
    assert failed == [("r", "KV lease l-r was no longer valid after the copy")]
    assert counters.values == {}


class LateReleasePrefill:
    """ReleaseKv notes its timeout and wait_for_ready, then answers (released) only once `go` is set."""

    def __init__(self) -> None:
        self.go = asyncio.Event()
        self.calls: list[tuple[float, bool]] = []

    async def ReleaseKv(self, request, timeout=None, wait_for_ready=None):
        self.calls.append((timeout, wait_for_ready))
        await self.go.wait()
        return prefill_pb2.ReleaseKvResponse(released=True)


def test_release_timeout_runs_to_the_lease_expiry_and_at_least_one_second():
    lease = common_pb2.Lease(lease_id="l", epoch=1, expires_unix_ns=50_000_000_000)
    assert release_timeout_s(lease, now_unix_ns=20_000_000_000) == 30.0
    assert release_timeout_s(lease, now_unix_ns=49_500_000_000) == MIN_RELEASE_TIMEOUT_S == 1.0
    assert release_timeout_s(lease, now_unix_ns=60_000_000_000) == 1.0  # lapsed, or the clocks disagree


def late_release(import_done: m.ImportDone) -> tuple[list, list, list]:
    """A pull ends as `import_done` says while its prefill has not answered ReleaseKv yet (lease: 20 s left):
    (core messages sent before the answer, those after, the ReleaseKv calls' (timeout, wait_for_ready))."""
    sent, before = [], []
    prefill = LateReleasePrefill()

    async def main():
        pulls = coordinator(SimpleNamespace(send=sent.append, flush=lambda: None), kv_load_failure_policy="recompute")
        pulls.stub = lambda address: prefill
        handle = request("r").kv
        handle.lease.expires_unix_ns = time.time_ns() + 20_000_000_000
        pulls.pending["r"] = PendingPull("r", handle)
        pulls.on_core_message(import_done)
        await wait_for(lambda: prefill.calls, 2.0, "the ReleaseKv call")
        for _ in range(20):  # the coordinator's tasks get turns while the prefill has not answered
            await asyncio.sleep(0)
        before.extend(sent)
        prefill.go.set()
        await asyncio.gather(*pulls._tasks)

    asyncio.run(main())
    return before, sent[len(before) :], prefill.calls


def test_a_copy_waits_for_a_late_release_answer_and_commits():
    """A prefill busy with queued Prefill calls answered ReleaseKv after the old 1 s limit, and the
    valid copy was recomputed. Now the decode waits as long as the lease holds, and never for a prefill that is
    gone (no wait_for_ready: a dead one fails the call at once)."""
    before, after, calls = late_release(m.ImportDone("r", ok=True, num_blocks_pulled=2, num_bytes=64))
    assert before == []  # nothing decided while the answer is out
    assert [(c.request_id, c.ok) for c in after if isinstance(c, m.CommitImport)] == [("r", True)]
    ((timeout, wait_for_ready),) = calls
    assert 19.0 < timeout <= 20.0 and wait_for_ready is False


def test_a_failed_pull_goes_on_by_policy_without_waiting_for_the_release():
    before, after, calls = late_release(m.ImportDone("r", ok=False, error="the copy failed"))
    assert [(c.request_id, c.ok, c.recompute) for c in before if isinstance(c, m.CommitImport)] == [("r", False, True)]
    assert after == [] and len(calls) == 1  # the lease is still released
