"""The decode's link keep-alive: its schedule (CPU, with stand-in copies) and, on two GPUs, the copy."""

import argparse
import threading
import time

import pytest
import torch

from engine.config_fields import ConfigError, add_arguments, from_namespace
from engine.kv_transfer.io import KvIo, boot_id
from engine.kv_transfer.keepalive import KEEPALIVE_BYTES, CudaLink, LinkKeepalive
from engine.service_config import ServiceConfig
from tests.test_kv_io import LAYOUT


def wait_until(predicate, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def test_each_link_is_copied_every_period_until_closed():
    calls = {"a": 0, "b": 0}
    keep = LinkKeepalive(0.005)
    assert keep.add("a", lambda: calls.__setitem__("a", calls["a"] + 1), lambda: False) is True
    assert keep.add("a", lambda: None, lambda: False) is False  # once per link
    keep.add("b", lambda: calls.__setitem__("b", calls["b"] + 1), lambda: False)
    wait_until(lambda: calls["a"] >= 5 and calls["b"] >= 5)
    keep.close()
    assert not keep._thread.is_alive()
    frozen = dict(calls)
    time.sleep(0.03)
    assert calls == frozen and keep.num_copies == calls["a"] + calls["b"]


def test_a_link_whose_last_copy_is_in_flight_is_skipped_not_stacked():
    copies, busy = [], threading.Event()
    busy.set()
    keep = LinkKeepalive(0.002)
    keep.add("slow", lambda: copies.append(1), busy.is_set)
    wait_until(lambda: keep.num_skipped >= 5)
    assert copies == []
    busy.clear()
    wait_until(lambda: len(copies) >= 3)
    keep.close()


def test_a_failing_link_is_dropped_and_the_others_go_on():
    good = []

    def broken():
        raise RuntimeError("device lost")

    keep = LinkKeepalive(0.002)
    keep.add("broken", broken, lambda: False)
    keep.add("good", lambda: good.append(1), lambda: False)
    wait_until(lambda: "broken" not in keep.links and len(good) >= 5)
    keep.close()


def test_a_period_of_zero_is_refused():
    with pytest.raises(ValueError, match="kv_link_keepalive_ms must be > 0 to keep a link awake, got 0"):
        LinkKeepalive(0.0)


def test_the_flag_is_range_checked():
    parser = argparse.ArgumentParser()
    add_arguments(parser, ServiceConfig)
    with pytest.raises(ConfigError) as err:
        from_namespace(ServiceConfig, parser.parse_args(["--kv-link-keepalive-ms", "5000"]), env={})
    assert str(err.value) == "--kv-link-keepalive-ms=5000.0 is out of range; allowed [0.0, 1000.0]"
    assert from_namespace(ServiceConfig, {}, env={"SPLITSERVE_KV_LINK_KEEPALIVE_MS": "2"}).kv_link_keepalive_ms == 2.0


def test_a_cpu_pool_keeps_no_link_awake():
    io = KvIo({"transport": "shm", "role": "decode", "link_keepalive_ms": 2})
    io.kv_cache_factory(LAYOUT, 2, torch.device("cpu"))
    io._keep_link_awake(torch.device("cpu"))
    assert io.keepalive.links == {} and io.keepalive._thread is None
    io.close()
    assert KvIo({"transport": "cuda_ipc", "role": "decode"}).keepalive is None  # off unless asked for


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_the_cuda_link_copies_1_mib_between_its_own_buffers_on_side_streams():
    link = CudaLink(torch.device("cuda:0"), torch.device("cuda:1"))
    link.copy()
    wait_until(lambda: not link.busy())
    for device in (0, 1):  # issued on the link's side streams; the devices' current streams are as before
        assert torch.cuda.current_stream(device) == torch.cuda.default_stream(device)
    assert link.scratch.numel() == KEEPALIVE_BYTES and int(link.scratch.sum()) == KEEPALIVE_BYTES


def test_the_boot_id_names_this_host():
    with open("/proc/sys/kernel/random/boot_id") as f:
        assert boot_id() == f.read().strip() != ""


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_an_nccl_prefill_reports_its_device_and_a_decode_keeps_only_visible_peers_awake():
    prefill = KvIo({"transport": "nccl", "role": "prefill"})
    prefill.kv_cache_factory(LAYOUT, 2, torch.device("cuda:0"))
    assert prefill.endpoint == {"device": "0", "boot_id": boot_id()}
    decode = KvIo({"transport": "nccl", "role": "decode", "link_keepalive_ms": 2})
    decode.kv_cache_factory(LAYOUT, 2, torch.device("cuda:1"))
    for reported in ("1", "99", "-1", "x", None):  # itself, not visible, malformed, absent
        decode._keep_link_awake(reported)
    assert decode.keepalive.links == {}
    decode._keep_link_awake(prefill.endpoint["device"])
    assert list(decode.keepalive.links) == ["cuda:0->cuda:1"]
    wait_until(lambda: decode.keepalive.num_copies >= 3)
    decode.close()
