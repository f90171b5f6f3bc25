"""The nccl transport between instances of different tensor-parallel sizes, on CPU (gloo), both sides in this
process: each side's rank 0 holds every rank's pool (shared memory), the pairing builds one group per (prefill
rank, decode rank) the transfer plan joins, and a pull lands exactly each decode rank's heads, every byte sent
once. float64, tiny pools."""

from __future__ import annotations

import socket
import threading
import time
from types import SimpleNamespace

import pytest
import torch

from splitserve.common.kv_layout import KvLayout, transfer_plan
from splitserve.engine.kv_connectors.base import Moved, PullTarget
from splitserve.engine.kv_connectors.factory import make_connector
from splitserve.engine.kv_connectors.nccl_links import Link, plan_links
from tests.engine.test_head_copies import BLOCK_SIZE, HEAD_DIM, NUM_LAYERS, layout
from tests.service_harness import wait_until

NUM_BLOCKS = 8
CPU = torch.device("cpu")
PAIRS = [(1, 2), (2, 1), (2, 2), (4, 2), (2, 4)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Pair:
    """A prefill and a decode connector of the given layouts, pools placed and paired over gloo."""

    def __init__(self, prefill: KvLayout, decode: KvLayout, timeout_s: float = 5.0) -> None:
        stamp = f"{time.time_ns()}"
        self.prefill = make_connector({"transport": "nccl", "instance": f"p{stamp}", "timeout_s": timeout_s})
        self.decode = make_connector({"transport": "nccl", "instance": f"d{stamp}", "timeout_s": timeout_s})
        self.prefill_pool = self.prefill.kv_cache_factory(prefill, NUM_BLOCKS, CPU)
        self.decode_pool = self.decode.kv_cache_factory(decode, NUM_BLOCKS, CPU)
        self.name = f"{self.prefill.instance}->{self.decode.instance}"
        try:
            self.pair()
        except BaseException:
            self.close()  # the segments are unlinked whatever fails
            raise

    def pair(self) -> None:
        port, errors = free_port(), []

        def join():
            try:
                self.prefill.pair(self.name, 1, "127.0.0.1", port, "gloo", CPU)
            except Exception as exc:
                errors.append(exc)

        joining = threading.Thread(target=join)
        joining.start()
        try:
            self.decode.pair(self.name, 0, "127.0.0.1", port, "gloo", CPU)
        finally:
            joining.join(30)
        if errors:
            raise errors[0]

    def close(self) -> None:
        self.decode.close()
        self.prefill.close()


def pools_of(connector, pool: torch.Tensor) -> list[torch.Tensor]:
    return connector._rank_pools.tensors if connector._rank_pools is not None else [pool]


def fill_prefill(pair: Pair, prefill: KvLayout, full: torch.Tensor) -> None:
    """Each prefill rank's pool holds its heads of `full` (the model's every KV head), as the engine would."""
    for rank, pool in enumerate(pools_of(pair.prefill, pair.prefill_pool)):
        pool.copy_(full[..., list(prefill.heads_of_rank(rank)), :])


def pull(pair: Pair, spec, indices, dst_blocks, sent: list) -> Moved:
    """A decode pull whose SendWanted the prefill answers at once on a thread of its own (as SendKv would)."""

    def ask_send(need):
        ids = [spec.block_ids[i] for i in need.block_indices]
        threading.Thread(
            target=lambda: sent.append(pair.prefill.send(need.pair, ids, pair.prefill_pool, tag=spec.tag))
        ).start()

    return pair.decode.pull(spec, indices, dst_blocks, PullTarget(pair.decode_pool, ask_send))


@pytest.mark.parametrize("num_kv_heads", [4, 2, 1])
@pytest.mark.parametrize(("prefill_tp", "decode_tp"), PAIRS)
def test_each_decode_rank_receives_exactly_its_heads_from_the_ranks_holding_them(num_kv_heads, prefill_tp, decode_tp):
    prefill, decode = layout(num_kv_heads, prefill_tp), layout(num_kv_heads, decode_tp)
    torch.manual_seed(prefill_tp * 10 + decode_tp)
    full = torch.randn(NUM_BLOCKS, NUM_LAYERS, 2, BLOCK_SIZE, num_kv_heads, HEAD_DIM, dtype=torch.float64)
    pair = Pair(prefill, decode)
    try:
        links = [link for link, _ in pair.decode.groups[pair.name].links]
        assert links == plan_links(prefill, decode)
        assert [link for link, _ in pair.prefill.groups[pair.name].links] == links
        fill_prefill(pair, prefill, full)
        targets = pools_of(pair.decode, pair.decode_pool)
        assert len(targets) == decode_tp
        for target in targets:
            target.fill_(-1.0)
        # a cached prefix of one block: the pull takes handle indices 1..3 into decode blocks 7, 2, 3
        spec = SimpleNamespace(
            transport="nccl", prefill_instance=pair.prefill.instance, block_ids=[4, 5, 1, 6], tag=3,
            request_id="r1", layout=prefill,
        )  # fmt: skip
        sent = []
        moved = pull(pair, spec, [1, 2, 3], [7, 2, 3], sent)
        per_head = 3 * NUM_LAYERS * 2 * BLOCK_SIZE * HEAD_DIM * 8  # bytes of one head of three blocks
        # each decode rank's heads once: what it needs, no more (replicated heads go to each rank needing them)
        assert moved == Moved(per_head * decode.num_kv_heads * decode_tp)
        for rank, target in enumerate(targets):
            heads = list(decode.heads_of_rank(rank))
            assert torch.equal(target[[7, 2, 3]], full[[5, 1, 6]][..., heads, :]), f"decode rank {rank}"
            assert bool((target[[0, 1, 4, 5, 6]] == -1.0).all()), "a block outside the pull was written"
        wait_until(lambda: sent, 10, "the prefill's send to return")
        assert sent[0]["num_bytes"] == moved.num_bytes
    finally:
        pair.close()


def test_links_follow_the_plan_one_per_prefill_and_decode_rank_that_it_joins():
    # prefill TP 4 of 4 heads -> decode TP 2: each decode rank takes its two heads from two prefill ranks
    assert plan_links(layout(4, 4), layout(4, 2)) == [
        Link(0, 0, ((0, 0, 1),)), Link(1, 0, ((1, 0, 1),)), Link(2, 1, ((0, 0, 1),)), Link(3, 1, ((1, 0, 1),)),
    ]  # fmt: skip
    # prefill TP 1 -> decode TP 2: one prefill rank, two links, each a run of two heads
    assert plan_links(layout(4, 1), layout(4, 2)) == [Link(0, 0, ((0, 0, 2),)), Link(0, 1, ((0, 2, 2),))]
    # MQA at decode TP 2: both decode ranks hold head 0, from prefill ranks 0 and 1 in turn
    assert plan_links(layout(1, 2), layout(1, 2)) == [Link(0, 0, ((0, 0, 1),)), Link(1, 1, ((0, 0, 1),))]
    assert transfer_plan(layout(1, 2), layout(1, 2)) == (((0, 0, 0),), ((0, 1, 0),))


def test_an_unanswered_pull_times_out_drops_every_link_and_the_next_pairing_rebuilds_them():
    """No send comes: the receive gives up after the transfer timeout, the pair (all its links) is dropped and
    the destination blocks are as they were; pairing again builds every link anew, and a pull then lands."""
    prefill, decode = layout(2, 2), layout(2, 1)
    full = torch.randn(NUM_BLOCKS, NUM_LAYERS, 2, BLOCK_SIZE, 2, HEAD_DIM, dtype=torch.float64)
    pair = Pair(prefill, decode, timeout_s=0.5)
    try:
        fill_prefill(pair, prefill, full)
        pair.decode_pool.fill_(-1.0)
        spec = SimpleNamespace(
            transport="nccl", prefill_instance=pair.prefill.instance, block_ids=[2, 3], tag=5, request_id="r1",
            layout=prefill,
        )  # fmt: skip
        asks, started = [], time.monotonic()
        with pytest.raises(RuntimeError, match="[Tt]imed out"):
            pair.decode.pull(spec, [0, 1], [6, 7], PullTarget(pair.decode_pool, asks.append))
        assert 0.5 <= time.monotonic() - started < 3
        assert [(a.request_id, a.block_indices) for a in asks] == [("r1", [0, 1])]
        assert pair.name not in pair.decode.groups and bool((pair.decode_pool == -1.0).all())

        pair.pair()  # the next pull's pairing (the prefill's side is replaced too)
        assert len(pair.decode.groups[pair.name].links) == 2
        sent = []
        assert pull(pair, spec, [0, 1], [6, 7], sent) == Moved(2 * NUM_LAYERS * 2 * BLOCK_SIZE * 2 * HEAD_DIM * 8)
        assert torch.equal(pair.decode_pool[[6, 7]], full[[2, 3]])
        wait_until(lambda: sent, 10, "the prefill's send to return")
    finally:
        pair.close()


def test_a_handle_of_another_layout_than_the_paired_one_fails_the_pull_and_drops_nothing_else():
    """A prefill restarted at another TP size serves handles of a new layout: the pull fails naming both (the
    service then pairs again) and nothing was asked or received."""
    pair = Pair(layout(2, 2), layout(2, 1))
    try:
        spec = SimpleNamespace(
            transport="nccl", prefill_instance=pair.prefill.instance, block_ids=[1], tag=1, request_id="r1",
            layout=layout(2, 1),
        )  # fmt: skip
        asks = []
        with pytest.raises(RuntimeError) as failed:
            pair.decode.pull(spec, [0], [0], PullTarget(pair.decode_pool, asks.append))
        assert str(failed.value) == (
            f"the KV handle's layout [{layout(2, 1).describe()}] is not the one paired with "
            f"[{layout(2, 2).describe()}] (the prefill restarted?)"
        )
        assert asks == []
    finally:
        pair.close()


def test_layouts_no_plan_maps_fail_the_pairing_on_both_sides_naming_both():
    other = KvLayout(NUM_LAYERS, 1, HEAD_DIM, 8, "float64", "m", tensor_parallel_size=2, rank_kv_heads=((0,), (1,)))
    with pytest.raises(ValueError, match=r"^KV layouts cannot map \(block_size differ\): prefill \[.*\] vs decode \["):
        Pair(other, layout(2, 1))


@pytest.mark.slow
@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 3, reason="needs three CUDA GPUs (NCCL refuses two ranks on one)")
def test_on_gpus_nccl_lands_each_decode_ranks_heads_exactly(tmp_path):
    """benchmarks/nccl_tp_handoff.py's pulls (its prefill a process of its own) at (2,1) and (1,2), and (2,2) on
    four GPUs: every decode rank's blocks hold exactly its heads of the prefill's (bf16, Llama-3-8B's KV shape)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    pairs = [(2, 1), (1, 2)] + ([(2, 2)] if torch.cuda.device_count() >= 4 else [])
    out = tmp_path / "rows.json"
    script = Path(__file__).resolve().parents[2] / "benchmarks" / "nccl_tp_handoff.py"
    arg = ",".join(f"{p}:{d}" for p, d in pairs)
    command = [sys.executable, str(script), "--pairs", arg, "--prompt-len", "64", "--repeats", "1", "--json", str(out)]
    subprocess.run(command, check=True, timeout=600)
    rows = json.loads(out.read_text())["rows"]
    block_head_bytes = 32 * 2 * 16 * 128 * 2  # one KV head of one block: layers x (k, v) x tokens x dims x bf16
    assert [(r["prefill_tp"], r["decode_tp"], r["exact"], r["bytes"], r["bytes_sent"]) for r in rows] == [
        (p, d, True, 4 * 8 * block_head_bytes, 4 * 8 * block_head_bytes) for p, d in pairs
    ]
