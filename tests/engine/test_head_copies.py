"""Blocks moved between pools of different tensor-parallel sizes by a transfer plan land exactly where each
decode rank's heads belong: every (prefill TP, decode TP) pair, GQA and MQA, float64."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from splitserve.common.kv_layout import KvLayout, transfer_plan
from splitserve.engine.kv_connectors.head_copies import copy_planned_heads, head_runs
from splitserve.engine.worker.tensor_parallel import kv_heads_of_rank

NUM_BLOCKS, BLOCK_SIZE, HEAD_DIM, NUM_LAYERS = 8, 4, 3, 2


def layout(num_kv_heads: int, size: int) -> KvLayout:
    ranks = [tuple(kv_heads_of_rank(num_kv_heads, size, r)) for r in range(size)] if size > 1 else []
    return KvLayout(
        num_layers=NUM_LAYERS,
        num_kv_heads=len(ranks[0]) if ranks else num_kv_heads,
        head_dim=HEAD_DIM,
        block_size=BLOCK_SIZE,
        dtype="float64",
        model_id="m",
        tensor_parallel_size=size,
        rank_kv_heads=tuple(ranks),
    )


def rank_pools(full: torch.Tensor, lay: KvLayout) -> list[torch.Tensor]:
    """Each rank's pool as the engine holds it: its heads of the full-head pool."""
    return [full[..., list(lay.heads_of_rank(r)), :].clone() for r in range(lay.tensor_parallel_size)]


@pytest.mark.parametrize("num_kv_heads", [4, 2, 1])
@pytest.mark.parametrize(("prefill_tp", "decode_tp"), [(1, 2), (2, 1), (2, 2), (4, 2), (2, 4), (4, 1), (1, 4)])
def test_every_decode_rank_gets_exactly_its_heads(num_kv_heads, prefill_tp, decode_tp):
    torch.manual_seed(0)
    full = torch.randn(NUM_BLOCKS, NUM_LAYERS, 2, BLOCK_SIZE, num_kv_heads, HEAD_DIM, dtype=torch.float64)
    prefill, decode = layout(num_kv_heads, prefill_tp), layout(num_kv_heads, decode_tp)
    sources = rank_pools(full, prefill)
    targets = [torch.zeros(NUM_BLOCKS, *pool.shape[1:], dtype=torch.float64) for pool in rank_pools(full, decode)]
    src_blocks, dst_blocks = [5, 1, 6], [0, 7, 2]
    moved = copy_planned_heads(sources, src_blocks, targets, dst_blocks, transfer_plan(prefill, decode))
    for rank, target in enumerate(targets):
        heads = list(decode.heads_of_rank(rank))
        assert torch.equal(target[dst_blocks], full[src_blocks][..., heads, :])
        untouched = [b for b in range(NUM_BLOCKS) if b not in dst_blocks]
        assert not target[untouched].any()  # nothing written outside the destination blocks
    per_head = len(src_blocks) * NUM_LAYERS * 2 * BLOCK_SIZE * HEAD_DIM * 8
    assert moved == per_head * decode.num_kv_heads * decode_tp


def test_consecutive_heads_of_one_rank_copy_as_one_run():
    plan = ((0, 0, 0), (1, 0, 1), (2, 1, 0), (3, 1, 1))  # decode TP 1 from prefill TP 2
    assert head_runs(plan) == [(0, 0, 0, 2), (2, 1, 0, 2)]
    assert head_runs(((0, 1, 1), (1, 1, 0))) == [(0, 1, 1, 1), (1, 1, 0, 1)]  # reversed: not one slice


def test_mismatched_block_lists_are_refused():
    full = torch.zeros(NUM_BLOCKS, NUM_LAYERS, 2, BLOCK_SIZE, 2, HEAD_DIM)
    plan = transfer_plan(layout(2, 1), layout(2, 1))
    with pytest.raises(ValueError, match=r"^copy_planned_heads: 2 source blocks vs 1 destination blocks$"):
        copy_planned_heads([full], [0, 1], [full.clone()], [0], plan)


def test_shm_cuda_ipc_and_nccl_move_kv_of_tensor_parallel_instances_nixl_refuses():
    from splitserve.engine.kv_connectors.factory import connector_class

    tp2, tp1 = layout(2, 2), layout(2, 1)
    nixl = connector_class("nixl")({"role": "decode"})
    with pytest.raises(ValueError) as refused:
        nixl.check_layout(tp2, tp1)
    assert str(refused.value) == (
        "the nixl transport does not move KV of tensor-parallel instances (shm, cuda_ipc and nccl do): "
        f"[{tp2.describe()}] vs [{tp1.describe()}]"
    )
    nixl.check_layout(tp1, tp1)
    for transport in ("shm", "cuda_ipc", "nccl"):
        moving = connector_class(transport)({"role": "decode"})
        moving.check_layout(tp2, tp1)  # a plan maps them
        moving.check_layout(tp2, tp2)
        with pytest.raises(ValueError, match=r"^KV layouts cannot map \(block_size differ\): prefill \["):
            moving.check_layout(layout(2, 2), KvLayout(NUM_LAYERS, 2, HEAD_DIM, 8, "float64", "m"))
        with pytest.raises(ValueError, match=r"^KV layouts differ: \["):
            moving.check_layout(tp1, KvLayout(NUM_LAYERS, 2, HEAD_DIM, 8, "float64", "m"))


@pytest.mark.parametrize(("prefill_tp", "decode_tp"), [(2, 1), (1, 2), (4, 2), (2, 4)])
def test_a_cuda_ipc_pull_between_tp_sizes_follows_the_plan(prefill_tp, decode_tp):
    """The cuda_ipc connector's tensor-parallel pull on CPU tensors standing in for the GPUs' pools (no GPU
    here): a prefill endpoint's per-rank handles become one mapping each, in rank order, and the pull writes every
    decode rank's pool (its rank 0 holds them all) with exactly its heads."""
    from splitserve.engine.kv_connectors.base import PullTarget
    from splitserve.engine.kv_connectors.cuda_ipc import CudaIpcConnector

    torch.manual_seed(1)
    full = torch.randn(NUM_BLOCKS, NUM_LAYERS, 2, BLOCK_SIZE, 2, HEAD_DIM, dtype=torch.float64)
    prefill, decode = layout(2, prefill_tp), layout(2, decode_tp)
    connector = CudaIpcConnector({"role": "decode"})
    connector.layout = decode
    targets = [torch.zeros(NUM_BLOCKS, *pool.shape[1:], dtype=torch.float64) for pool in rank_pools(full, decode)]
    connector._rank_tensors = targets if decode_tp > 1 else []
    handles = [f"h{rank}" for rank in range(prefill_tp)]
    endpoint = {"cuda_ipc": "h0", "num_blocks": str(NUM_BLOCKS), "device": "0"}
    if prefill_tp > 1:
        endpoint["cuda_ipc_ranks"] = ",".join(handles)
        assert connector._rank_endpoints(endpoint) == [{"cuda_ipc": h, "num_blocks": str(NUM_BLOCKS)} for h in handles]
    else:
        assert connector._rank_endpoints(endpoint) is None
    spec = SimpleNamespace(block_ids=[5, 1, 6, 3], layout=prefill)
    target = PullTarget(targets[0], None, rank_pools(full, prefill) if prefill_tp > 1 else full.clone())
    moved = connector.pull(spec, [0, 2, 3], [0, 7, 2], target)
    for rank, pool in enumerate(targets):
        assert torch.equal(pool[[0, 7, 2]], full[[5, 6, 3]][..., list(decode.heads_of_rank(rank)), :])
        assert not pool[[1, 3, 4, 5, 6]].any()
    assert moved.num_bytes == 3 * NUM_LAYERS * 2 * BLOCK_SIZE * HEAD_DIM * 8 * decode.num_kv_heads * decode_tp
