"""Paged prefill attention (Triton and reference) against fp64 dense causal attention."""

import pytest
import torch

from splitserve.kernels import paged_prefill_attention
from splitserve.kernels.paged_prefill_attention import paged_prefill_attention_triton

ON_GPU = torch.cuda.is_available()
needs_gpu = pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
# (seq_len after the step, new tokens): a full prefill, a chunk after a cached prefix, a
# decode-like row, a block multiple, a ragged chunk
SEQS = [(37, 37), (23, 6), (9, 1), (16, 16), (40, 17)]


def run_and_compare(compare_with_dense, device, *, seqs=SEQS, impl="triton", config=None, **shape):
    """Prefill attention of `seqs` (seq_len, new tokens) against fp64 dense attention; `config` runs the Triton
    kernel with those tiles; `shape`: compare_paged_attention's keywords (defaults: the small GQA case;
    `pad_rows` rows of q past the last sequence stay untouched)."""
    max_query_len = max(m for _, m in seqs)

    def attend(q, paged, query_start_loc, scale, out):
        args = (q, paged.k_cache, paged.v_cache, paged.block_tables, query_start_loc.to(device), paged.seq_lens)
        if config is None:
            return paged_prefill_attention(*args, max_query_len, scale, out=out, impl=impl)
        return paged_prefill_attention_triton(*args, max_query_len, scale, out=out, config=config)

    compare_with_dense(attend, seqs, device, **shape)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("num_q_heads,num_kv_heads", [(2, 2), (4, 2), (4, 1)])
@pytest.mark.parametrize("block_size", [4, 8])
def test_triton_matches_dense(compare_with_dense, device, dtype, num_q_heads, num_kv_heads, block_size):
    run_and_compare(
        compare_with_dense,
        device,
        num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads,
        block_size=block_size,
        dtype=dtype,
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_reference_matches_dense(compare_with_dense, device, dtype):
    run_and_compare(compare_with_dense, device, dtype=dtype, impl="ref", pad_rows=3)


@pytest.mark.parametrize("block_m,block_n,single_loop", [(32, 16, False), (16, 32, False), (16, 16, True)])
def test_tile_shapes_and_padding_rows(compare_with_dense, device, block_m, block_n, single_loop):
    """Tiles wider or taller than the block size move the masked/unmasked boundary (or every tile
    goes through the masked loop); trailing padding rows of q (beyond query_start_loc[-1]) are not
    written."""
    config = dict(BLOCK_M=block_m, BLOCK_N=block_n, num_warps=4, num_stages=1, SINGLE_LOOP=single_loop)
    run_and_compare(
        compare_with_dense,
        device,
        seqs=[(50, 45), (70, 3)],
        num_q_heads=2,
        num_kv_heads=1,
        head_dim=24,
        block_size=8,
        dtype=torch.float32,
        config=config,
        pad_rows=2,
    )


def test_cache_length_mismatch_error(device):
    q = torch.zeros(3, 2, 16, device=device)
    cache = torch.zeros(2, 4, 2, 16, device=device)
    bt = torch.zeros(2, 1, dtype=torch.int32, device=device)
    qsl = torch.tensor([0, 3], dtype=torch.int32, device=device)
    sl = torch.tensor([3, 1], dtype=torch.int32, device=device)
    with pytest.raises(
        ValueError,
        match=r"^paged_prefill_attention: for 2 sequences query_start_loc must be "
        r"\(3,\) and block_tables \(2, max_blocks\), got \(2,\) and \(2, 1\)$",
    ):
        paged_prefill_attention(q, cache, cache, bt, qsl, sl, 3, 1.0)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("num_q_heads,num_kv_heads,head_dim", [(32, 8, 128), (8, 1, 64)])
def test_gpu_large(compare_with_dense, dtype, block_size, num_q_heads, num_kv_heads, head_dim):
    seqs = [(1000, 1000), (812, 300), (2077, 77), (31, 1), (513, 513)]
    run_and_compare(
        compare_with_dense,
        "cuda",
        seqs=seqs,
        num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        dtype=dtype,
    )


@pytest.mark.gpu
@needs_gpu
def test_gpu_short_queries_use_small_tiles(compare_with_dense):
    """max_query_len 5 picks BLOCK_M 16 (a mixed chunked-prefill/decode batch)."""
    seqs = [(300, 5), (17, 2), (64, 1)]
    run_and_compare(
        compare_with_dense,
        "cuda",
        seqs=seqs,
        num_q_heads=32,
        num_kv_heads=8,
        head_dim=128,
        block_size=16,
        dtype=torch.bfloat16,
    )
