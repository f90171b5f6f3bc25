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


@pytest.mark.parametrize("block_m,block_n", [(16, 16), (32, 16), (16, 32)])
def test_sinks_and_sliding_window_match_the_engines_cpu_attention(make_paged_kv, device, block_m, block_n):
    """The kernel with gpt-oss's sinks and a window of 7 against engine.worker.attention's per-sequence torch path
    (float64, the one the gpt-oss model test holds equal to transformers): windows that start mid-tile, before
    the tile's first row, and a context shorter than the window."""
    from splitserve.engine.worker.attention import AttentionMetadata, attention_sinks_window_torch

    seqs = [(37, 37), (23, 6), (9, 1), (5, 5), (40, 17)]
    paged = make_paged_kv([n for n, _ in seqs], 2, 16, 4, torch.float32, device)
    gen = torch.Generator().manual_seed(2)
    qsl = [0]
    for _, new in seqs:
        qsl.append(qsl[-1] + new)
    q = torch.randn(qsl[-1], 4, 16, generator=gen).to(device)
    sinks = (2.0 * torch.randn(4, generator=gen)).to(device)  # some heads' sinks outweigh their keys
    query_start_loc = torch.tensor(qsl, dtype=torch.int32, device=device)
    config = dict(BLOCK_M=block_m, BLOCK_N=block_n, num_warps=4, num_stages=1)
    args = (q, paged.k_cache, paged.v_cache, paged.block_tables, query_start_loc, paged.seq_lens, 37, 0.25)
    got = paged_prefill_attention_triton(*args, config=config, sinks=sinks, sliding_window=7)
    meta = AttentionMetadata(
        query_start_loc, paged.seq_lens, paged.block_tables, torch.empty(0), 37, 40, qsl, [n for n, _ in seqs]
    )
    want = attention_sinks_window_torch(
        q.double().cpu(), paged.k_cache.double().cpu(), paged.v_cache.double().cpu(), meta, 0.25, sinks.cpu(), 7
    )
    torch.testing.assert_close(got.double().cpu(), want, atol=1e-5, rtol=1e-5)
    ref = paged_prefill_attention(*args, impl="ref", sinks=sinks, sliding_window=7)
    torch.testing.assert_close(ref.double().cpu(), want, atol=1e-5, rtol=1e-5)
    plain = paged_prefill_attention(*args, impl="ref")
    assert not torch.allclose(plain, ref, atol=1e-2)  # the extras matter on these inputs
    with pytest.raises(ValueError, match=r"^paged_prefill_attention: sinks must be \(4,\) \(one per query head\)"):
        paged_prefill_attention(*args, sinks=sinks[:2])


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
