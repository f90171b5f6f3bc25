"""The decode's link keep-alive: its schedule and failure handling (CPU, with stand-in links), which
peers an nccl pull keeps awake, and, on two GPUs, the copy itself."""

import argparse
import threading
import time

import pytest
import torch

from engine.config_fields import ConfigError, add_arguments, from_namespace
from engine.kv_transfer.io import KvIo
from engine.kv_transfer.keepalive import KEEPALIVE_BYTES, CudaLink, LinkKeepalive, local_index
from engine.service_config import ServiceConfig
from tests.test_kv_io import LAYOUT


def wait_until(predicate, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


class Counting:
    """A stand-in link: counts copies; busy while `busy_flag` is set."""

    def __init__(self, fail_copy: bool = False) -> None:
        self.copies = 0
        self.busy_flag = threading.Event()
        self.fail_copy = fail_copy

    def copy(self) -> None:
        if self.fail_copy:
            raise RuntimeError("device lost")
        self.copies += 1

    def busy(self) -> bool:
        return self.busy_flag.is_set()


@pytest.fixture
def keep():
    made = []

    def make(period_s: float = 0.002) -> LinkKeepalive:
        made.append(LinkKeepalive(period_s))
        return made[-1]

    yield make
    for k in made:
        k.close()


def test_each_link_is_built_on_the_thread_and_copied_every_period_until_closed(keep):
    k = keep(0.005)
    a, b = Counting(), Counting()
    built_on = []
    assert k.add("a", lambda: built_on.append(threading.current_thread().name) or a) is True
    assert k.add("a", lambda: Counting()) is False  # once per link
    k.add("b", lambda: b)
    wait_until(lambda: a.copies >= 5 and b.copies >= 5)
    assert built_on == ["kv-link-keepalive"]
    k.close()
    assert not k._thread.is_alive()
    frozen = (a.copies, b.copies)
    time.sleep(0.03)
    assert (a.copies, b.copies) == frozen and k.num_copies == sum(frozen)


def test_a_link_whose_last_copy_is_in_flight_is_skipped_not_stacked(keep):
    k = keep()
    link = Counting()
    link.busy_flag.set()
    k.add("slow", lambda: link)
    wait_until(lambda: k.num_skipped >= 5)
    assert link.copies == 0
    link.busy_flag.clear()
    wait_until(lambda: link.copies >= 3)


def test_a_link_that_fails_to_build_or_copy_is_dropped_for_good_and_the_others_go_on(keep):
    k = keep()
    good = Counting()

    def unbuildable():
        raise RuntimeError("out of memory")

    k.add("unbuildable", unbuildable)
    k.add("broken", lambda: Counting(fail_copy=True))
    k.add("good", lambda: good)
    wait_until(lambda: k.failed == {"unbuildable", "broken"} and good.copies >= 5)
    assert list(k.links) == ["good"]
    assert k.add("broken", lambda: Counting()) is False  # never tried again


def test_periods_under_half_a_millisecond_are_refused():
    with pytest.raises(ValueError, match=r"kv_link_keepalive_ms 0\.1 is out of range: 0 \(off\) or >= 0\.5"):
        LinkKeepalive(0.0001)


def test_the_flag_is_range_checked():
    parser = argparse.ArgumentParser()
    add_arguments(parser, ServiceConfig)
    for value, message in (("5000", "--kv-link-keepalive-ms=5000.0 is out of range; allowed [0.0, 1000.0]"),
                           ("0.1", "--kv-link-keepalive-ms=0.1 is out of range; allowed 0 (off) or [0.5, 1000.0]")):
        with pytest.raises(ConfigError) as err:
            from_namespace(ServiceConfig, parser.parse_args(["--kv-link-keepalive-ms", value]), env={})
        assert str(err.value) == message
    assert from_namespace(ServiceConfig, {}, env={"SPLITSERVE_KV_LINK_KEEPALIVE_MS": "2"}).kv_link_keepalive_ms == 2.0
    assert from_namespace(ServiceConfig, {}, env={}).kv_link_keepalive_ms == 0.0


def test_a_cpu_pool_keeps_no_link_awake():
    io = KvIo({"transport": "shm", "role": "decode", "link_keepalive_ms": 2})
    io.kv_cache_factory(LAYOUT, 2, torch.device("cpu"))
    io._keep_link_awake(torch.device("cuda", 0))
    assert io.keepalive.pending == {} and io.keepalive.links == {} and io.keepalive._thread is None
    io.close()
    assert KvIo({"transport": "cuda_ipc", "role": "decode"}).keepalive is None  # off unless asked for


def test_an_nccl_pull_keeps_awake_only_a_prefill_gpu_this_process_sees(monkeypatch):
    io = KvIo({"transport": "nccl", "role": "decode", "link_keepalive_ms": 2})
    io.device = torch.device("cuda", 1)  # as if the pool were on GPU 1 (no GPU here: the link is never built)
    asked = []
    monkeypatch.setattr(io, "_recv", lambda *args: 0)
    monkeypatch.setattr("engine.kv_transfer.io.local_index", lambda uuid: {"GPU-a": 0, "GPU-own": 1}.get(uuid))
    monkeypatch.setattr(io, "_keep_link_awake", asked.append)

    class Spec:
        transport = "nccl"

    class Core:
        class engine:
            class runner:
                kv_cache = torch.zeros(1)

    for endpoint in ({"gpu_uuid": "GPU-a"}, {"gpu_uuid": "GPU-elsewhere"}, {}, {"gpu_uuid": "GPU-a"}):
        Spec.endpoint = endpoint
        io.pull(Spec, [0], [0], Core)
    assert asked == [torch.device("cuda", 0), None, None, torch.device("cuda", 0)]
    assert io._peer_index == {"GPU-a": 0, "GPU-elsewhere": None, "": None}  # each UUID looked up once


def test_without_gpus_no_uuid_has_a_local_index():
    assert local_index("") is None
    if not torch.cuda.is_available():
        assert local_index("GPU-anything") is None


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_the_cuda_link_copies_1_mib_and_nothing_waits_on_it():
    link = CudaLink(torch.device("cuda:0"), torch.device("cuda:1"))
    torch.cuda._sleep(200_000_000)  # hold cuda:0's current stream: the link's own streams must not wait on it
    link.copy()
    wait_until(lambda: not link.busy())
    assert not torch.cuda.current_stream(0).query()  # still sleeping: the copy did not order behind it
    torch.cuda.synchronize(0)
    with torch.cuda.stream(link.streams[0]):
        link.streams[0].wait_stream(torch.cuda.current_stream(0))
        link.source.fill_(2)
    link.copy()
    wait_until(lambda: not link.busy())
    assert link.scratch.numel() == KEEPALIVE_BYTES and int(link.scratch.sum()) == 2 * KEEPALIVE_BYTES


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_an_nccl_prefill_reports_its_gpu_and_a_decode_keeps_that_link_awake():
    prefill = KvIo({"transport": "nccl", "role": "prefill"})
    prefill.kv_cache_factory(LAYOUT, 2, torch.device("cuda:0"))
    assert prefill.endpoint == {"gpu_uuid": str(torch.cuda.get_device_properties(0).uuid)}
    decode = KvIo({"transport": "nccl", "role": "decode", "link_keepalive_ms": 2})
    decode.kv_cache_factory(LAYOUT, 2, torch.device("cuda:1"))
    assert decode._nccl_peer(prefill.endpoint) == torch.device("cuda", 0)
    decode._keep_link_awake(decode._nccl_peer({"gpu_uuid": str(torch.cuda.get_device_properties(1).uuid)}))
    decode._keep_link_awake(decode._nccl_peer(prefill.endpoint))
    wait_until(lambda: decode.keepalive.num_copies >= 3)
    assert list(decode.keepalive.links) == ["cuda:0->cuda:1"] and decode.keepalive.failed == set()
    decode.close()
