"""Paged decode attention (Triton and reference) against fp64 dense attention."""

import pytest
import torch

from splitserve.kernels import paged_decode_attention
from splitserve.kernels.paged_decode_attention import choose_num_splits

ON_GPU = torch.cuda.is_available()
needs_gpu = pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
RAGGED = [1, 7, 37, 18]


def run_and_compare(compare_with_dense, device, *, seq_lens=RAGGED, num_splits=None, impl="triton", **shape):
    """Decode attention (one new token per sequence) over `seq_lens` cached tokens against fp64 dense attention;
    `shape`: compare_paged_attention's keywords (defaults: the small GQA case)."""

    def attend(q, paged, query_start_loc, scale, out):
        return paged_decode_attention(
            q,
            paged.k_cache,
            paged.v_cache,
            paged.block_tables,
            paged.seq_lens,
            scale,
            out=out,
            num_splits=num_splits,
            impl=impl,
        )

    compare_with_dense(attend, [(n, 1) for n in seq_lens], device, **shape)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("num_q_heads,num_kv_heads", [(2, 2), (4, 2), (8, 2)])
@pytest.mark.parametrize("block_size", [4, 8])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_triton_matches_dense(compare_with_dense, device, dtype, num_q_heads, num_kv_heads, block_size, num_splits):
    run_and_compare(
        compare_with_dense,
        device,
        num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads,
        block_size=block_size,
        dtype=dtype,
        num_splits=num_splits,
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_reference_matches_dense(compare_with_dense, device, dtype):
    run_and_compare(compare_with_dense, device, dtype=dtype, impl="ref")


def test_mqa_odd_head_dim_and_heuristic_splits(compare_with_dense, device):
    """One KV head for 8 query heads, head_dim 24 (masked columns), block 16, splits by heuristic."""
    run_and_compare(
        compare_with_dense,
        device,
        seq_lens=[70, 3],
        num_q_heads=8,
        num_kv_heads=1,
        head_dim=24,
        block_size=16,
        dtype=torch.float32,
        num_splits=None,
    )


@pytest.mark.parametrize("impl", ["triton", "ref"])
@pytest.mark.parametrize("num_splits", [1, 2])
def test_empty_sequence_gives_zeros(make_paged_kv, device, impl, num_splits):
    paged = make_paged_kv([5, 0], 2, 16, 4, torch.float32, device)
    q = torch.randn(2, 2, 16, device=device)
    out = torch.full_like(q, float("nan"))
    paged_decode_attention(
        q,
        paged.k_cache,
        paged.v_cache,
        paged.block_tables,
        paged.seq_lens,
        0.25,
        out=out,
        num_splits=num_splits,
        impl=impl,
    )
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    assert not torch.isnan(out[0]).any()


def test_choose_num_splits_values():
    assert choose_num_splits(64, 8, 2048, 132) == 1  # 512 programs: about 4 per SM already
    assert choose_num_splits(256, 8, 512, 132) == 1
    assert choose_num_splits(4, 8, 32768, 132) == 16  # 528 // 32 = 16
    assert choose_num_splits(16, 8, 8192, 132) == 4  # 528 // 128 = 4
    assert choose_num_splits(1, 8, 8192, 132) == 32  # 66 wanted, 32 by 256 tokens per split
    assert choose_num_splits(1, 8, 700, 132) == 2  # 700 // 256 = 2
    assert choose_num_splits(3, 8, 1 << 20, 132) == 16  # 528 // 24 = 22 -> power of two below
    assert choose_num_splits(1, 1, 1 << 20, 132) == 64  # capped by the maximum


def test_head_mismatch_error(device):
    q = torch.zeros(1, 3, 16, device=device)
    cache = torch.zeros(2, 4, 2, 16, device=device)
    bt = torch.zeros(1, 1, dtype=torch.int32, device=device)
    sl = torch.ones(1, dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match=r"^paged_decode_attention: query heads 3 must be a multiple of KV heads 2$"):
        paged_decode_attention(q, cache, cache, bt, sl, 1.0)


def test_unknown_impl_error(device):
    q = torch.zeros(1, 2, 16, device=device)
    cache = torch.zeros(2, 4, 2, 16, device=device)
    bt = torch.zeros(1, 1, dtype=torch.int32, device=device)
    sl = torch.ones(1, dtype=torch.int32, device=device)
    with pytest.raises(
        ValueError, match=r"^paged_decode_attention: impl='cuda' is not one of \('auto', 'triton', 'ref'\)$"
    ):
        paged_decode_attention(q, cache, cache, bt, sl, 1.0, impl="cuda")


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("num_splits", [None, 1, 8])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("num_q_heads,num_kv_heads,head_dim", [(32, 8, 128), (16, 1, 64)])
def test_gpu_large(compare_with_dense, dtype, num_splits, block_size, num_q_heads, num_kv_heads, head_dim):
    run_and_compare(
        compare_with_dense,
        "cuda",
        seq_lens=[3000, 1, 517, 2048, 33, 1500],
        num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        dtype=dtype,
        num_splits=num_splits,
    )
