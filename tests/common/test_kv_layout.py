"""KvLayout under tensor parallelism: each rank's KV heads, the wire round trip, and the transfer plan that
maps a decode's ranks to the prefill ranks holding their heads (refused, naming both, where it cannot)."""

from __future__ import annotations

import dataclasses

import pytest

from splitserve.common.kv_layout import KvLayout, transfer_plan
from splitserve.common.wire import layout_from_proto, layout_to_proto

BASE = KvLayout(num_layers=2, num_kv_heads=4, head_dim=16, block_size=4, dtype="float64", model_id="m")


def on_ranks(layout: KvLayout, *ranks: tuple[int, ...]) -> KvLayout:
    return dataclasses.replace(
        layout, num_kv_heads=len(ranks[0]), tensor_parallel_size=len(ranks), rank_kv_heads=tuple(ranks)
    )


TP2 = on_ranks(BASE, (0, 1), (2, 3))
TP4 = on_ranks(BASE, (0,), (1,), (2,), (3,))
MQA = dataclasses.replace(BASE, num_kv_heads=1)
MQA_TP2 = on_ranks(MQA, (0,), (0,))


def test_describe_names_each_ranks_heads_and_leaves_tp1_as_it_was():
    assert BASE.describe() == (
        "num_layers=2, num_kv_heads=4, head_dim=16, block_size=4, dtype=float64, model_id=m, layout=block_major_v1"
    )
    assert TP2.describe().endswith("layout=block_major_v1, tensor_parallel_size=2, rank_kv_heads=[0,1][2,3]")
    assert TP2.heads_of_rank(1) == (2, 3) and BASE.heads_of_rank(0) == (0, 1, 2, 3)


@pytest.mark.parametrize("layout", [BASE, TP2, TP4, MQA_TP2])
def test_wire_round_trip(layout):
    assert layout_from_proto(layout_to_proto(layout)) == layout


def test_inconsistent_rank_heads_are_refused():
    with pytest.raises(ValueError, match=r"^KV layout of tensor_parallel_size 2: 1 rank_kv_heads entries, expected 2$"):
        dataclasses.replace(TP2, rank_kv_heads=((0, 1),))
    with pytest.raises(ValueError, match=r"^KV layout: every rank_kv_heads entry must name num_kv_heads=2 heads$"):
        dataclasses.replace(TP2, rank_kv_heads=((0, 1), (2,)))


@pytest.mark.parametrize(
    ("prefill", "decode", "plan"),
    [
        (BASE, BASE, (((0, 0, 0), (1, 0, 1), (2, 0, 2), (3, 0, 3)),)),
        (TP2, BASE, (((0, 0, 0), (1, 0, 1), (2, 1, 0), (3, 1, 1)),)),  # decode TP 1 gathers from both ranks
        (BASE, TP2, (((0, 0, 0), (1, 0, 1)), ((0, 0, 2), (1, 0, 3)))),  # each decode rank reads its half
        (TP4, TP2, (((0, 0, 0), (1, 1, 0)), ((0, 2, 0), (1, 3, 0)))),
        (TP2, TP4, (((0, 0, 0),), ((0, 0, 1),), ((0, 1, 0),), ((0, 1, 1),))),
        (MQA, MQA_TP2, (((0, 0, 0),), ((0, 0, 0),))),  # replicated: both decode ranks read the one head
        (MQA_TP2, MQA, (((0, 0, 0),),)),
        (MQA_TP2, MQA_TP2, (((0, 0, 0),), ((0, 1, 0),))),  # a head on several prefill ranks: read in turn
    ],
)
def test_transfer_plan_maps_every_decode_head_to_a_prefill_rank(prefill, decode, plan):
    assert transfer_plan(prefill, decode) == plan


def test_layouts_that_cannot_map_are_refused_naming_both():
    other = dataclasses.replace(TP2, head_dim=8, model_id="x")
    with pytest.raises(ValueError) as info:
        transfer_plan(BASE, other)
    assert str(info.value) == (
        f"KV layouts cannot map (head_dim, model_id differ): prefill [{BASE.describe()}] vs decode [{other.describe()}]"
    )
    half = dataclasses.replace(BASE, num_kv_heads=2)  # a prefill whose pool holds heads 0 and 1 only
    with pytest.raises(ValueError) as info:
        transfer_plan(half, TP2)
    assert str(info.value).startswith("KV layouts cannot map (decode rank 1's head 2 is on no prefill rank): prefill [")
