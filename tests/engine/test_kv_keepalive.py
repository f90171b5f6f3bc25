"""The decode's link keep-alive: its schedule and failure handling (CPU, with stand-in links), which
peers an nccl pull keeps awake, and, on two GPUs, the copy itself."""

import argparse
import threading
import time

import pytest
import torch

from splitserve.common.config_fields import ConfigError, add_arguments, from_namespace
from splitserve.engine.kv_connectors.factory import make_connector
from splitserve.engine.kv_connectors.link_keepalive import KEEPALIVE_BYTES, CudaLink, LinkKeepalive, local_index
from splitserve.engine_service.config import ServiceConfig
from tests.engine.test_kv_io import LAYOUT
from tests.service_harness import wait_until


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
    wait_until(
        lambda: a.copies >= 5 and b.copies >= 5, 10, lambda: f"5 copies of each link; (a, b) = {(a.copies, b.copies)}"
    )
    assert built_on == ["kv-link-keepalive"]
    k.close()
    assert not k._thread.is_alive()
    frozen = (a.copies, b.copies)
    time.sleep(0.03)  # six periods with nothing to wait for: the test is that no copy happens in them
    assert (a.copies, b.copies) == frozen and k.num_copies == sum(frozen)


def test_a_link_whose_last_copy_is_in_flight_is_skipped_not_stacked(keep):
    k = keep()
    link = Counting()
    link.busy_flag.set()
    k.add("slow", lambda: link)
    wait_until(lambda: k.num_skipped >= 5, 10, lambda: f"5 skipped periods of the busy link; {k.num_skipped} so far")
    assert link.copies == 0
    link.busy_flag.clear()
    wait_until(lambda: link.copies >= 3, 10, lambda: f"3 copies once the link is free; {link.copies} so far")


def test_a_link_that_fails_to_build_or_copy_is_dropped_for_good_and_the_others_go_on(keep):
    k = keep()
    good = Counting()

    def unbuildable():
        raise RuntimeError("out of memory")

    k.add("unbuildable", unbuildable)
    k.add("broken", lambda: Counting(fail_copy=True))
    k.add("good", lambda: good)
    wait_until(
        lambda: k.failed == {"unbuildable", "broken"} and good.copies >= 5,
        10,
        lambda: f"both bad links dropped and 5 copies of the good one; failed {k.failed}, {good.copies} copies",
    )
    assert list(k.links) == ["good"]
    assert k.add("broken", lambda: Counting()) is False  # never tried again


def test_periods_under_half_a_millisecond_are_refused():
    with pytest.raises(ValueError, match=r"kv_link_keepalive_ms 0\.1 is out of range: 0 \(off\) or >= 0\.5"):
        LinkKeepalive(0.0001)


def test_the_flag_is_range_checked():
    parser = argparse.ArgumentParser()
    add_arguments(parser, ServiceConfig)
    for value, message in (
        ("5000", "--kv-link-keepalive-ms=5000.0 is out of range; allowed [0.0, 1000.0]"),
        ("0.1", "--kv-link-keepalive-ms=0.1 is out of range; allowed 0 (off) or [0.5, 1000.0]"),
    ):
        with pytest.raises(ConfigError) as err:
            from_namespace(ServiceConfig, parser.parse_args(["--kv-link-keepalive-ms", value]), env={})
        assert str(err.value) == message
    assert from_namespace(ServiceConfig, {}, env={"SPLITSERVE_KV_LINK_KEEPALIVE_MS": "0"}).kv_link_keepalive_ms == 0.0
    assert from_namespace(ServiceConfig, {}, env={}).kv_link_keepalive_ms == 2.0  # on by default
    with pytest.raises(ConfigError, match=r"^--kv-link-keepalive-ms=nan is not a number; allowed \[0\.0, 1000\.0\]$"):
        ServiceConfig(kv_link_keepalive_ms=float("nan"))  # built directly, validated all the same


def test_a_cpu_pool_keeps_no_link_awake():
    io = make_connector({"transport": "shm", "role": "decode", "link_keepalive_ms": 2})
    io.kv_cache_factory(LAYOUT, 2, torch.device("cpu"))
    io._keep_link_awake(torch.device("cuda", 0))
    assert io.keepalive.pending == {} and io.keepalive.links == {} and io.keepalive._thread is None
    io.close()
    assert make_connector({"transport": "cuda_ipc", "role": "decode"}).keepalive is None  # off unless asked for


def test_an_nccl_pair_keeps_awake_only_a_prefill_gpu_this_process_sees(monkeypatch):
    looked_up, asked = [], []

    def fake_local_index(uuid):
        looked_up.append(uuid)
        return {"GPU-a": 0, "GPU-own": 1}.get(uuid)

    monkeypatch.setattr("splitserve.engine.kv_connectors.nccl.local_index", fake_local_index)
    io = make_connector({"transport": "nccl", "role": "decode", "link_keepalive_ms": 2})
    monkeypatch.setattr(io, "_keep_link_awake", asked.append)
    for uuid in ("GPU-a", "GPU-elsewhere", ""):  # seen here, another host's, a prefill that reports none
        io.keep_peer_awake(uuid)
    assert asked == [torch.device("cuda", 0)] and looked_up == ["GPU-a", "GPU-elsewhere"]
    off = make_connector({"transport": "nccl", "role": "decode"})
    off.keep_peer_awake("GPU-a")  # no keep-alive asked for: not even looked up
    assert looked_up == ["GPU-a", "GPU-elsewhere"]
    io.close()


def test_without_gpus_no_uuid_has_a_local_index():
    assert local_index("") is None
    if not torch.cuda.is_available():
        assert local_index("GPU-anything") is None


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_the_cuda_link_copies_1_mib_and_nothing_waits_on_it():
    link = CudaLink(torch.device("cuda:0"), torch.device("cuda:1"))
    torch.cuda._sleep(1_000_000_000)  # ~0.5 s on cuda:0's current stream: the link's own streams must not wait on it
    link.copy()
    wait_until(lambda: not link.busy(), 10, "the link's copy to finish")
    assert not torch.cuda.current_stream(0).query()  # still sleeping: the copy did not order behind it
    torch.cuda.synchronize(0)
    with torch.cuda.stream(link.streams[0]):
        link.source.fill_(2)
    link.copy()
    wait_until(lambda: not link.busy(), 10, "the link's copy to finish")
    assert link.scratch.numel() == KEEPALIVE_BYTES and int(link.scratch.sum()) == 2 * KEEPALIVE_BYTES


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_an_nccl_prefill_reports_its_gpu_and_a_decode_keeps_that_link_awake():
    prefill = make_connector({"transport": "nccl", "role": "prefill"})
    prefill.kv_cache_factory(LAYOUT, 2, torch.device("cuda:0"))
    assert prefill.endpoint == {"gpu_uuid": str(torch.cuda.get_device_properties(0).uuid)}
    decode = make_connector({"transport": "nccl", "role": "decode", "link_keepalive_ms": 2})
    decode.kv_cache_factory(LAYOUT, 2, torch.device("cuda:1"))
    decode.keep_peer_awake(str(torch.cuda.get_device_properties(1).uuid))  # its own GPU: no link
    decode.keep_peer_awake(prefill.endpoint["gpu_uuid"])
    wait_until(
        lambda: decode.keepalive.num_copies >= 3,
        10,
        lambda: f"3 keep-alive copies; {decode.keepalive.num_copies} so far, failed {decode.keepalive.failed}",
    )
    assert list(decode.keepalive.links) == ["cuda:0->cuda:1"] and decode.keepalive.failed == set()
    decode.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_pool_on_the_auto_device_knows_its_index():
    from splitserve.engine.worker.device_setup import resolve_device

    assert resolve_device("auto") == torch.device("cuda", torch.cuda.current_device())
    io = make_connector({"transport": "nccl", "role": "decode"})
    io.kv_cache_factory(LAYOUT, 2, torch.device("cuda"))
    assert io.device == torch.device("cuda", torch.cuda.current_device())
