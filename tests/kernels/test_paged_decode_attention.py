"""Paged decode attention (Triton and reference) against fp64 dense attention."""

import pytest
import torch

from splitserve.kernels import paged_decode_attention
from splitserve.kernels.paged_decode_config import choose_num_splits

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


EXTRAS_LENS = [1, 7, 37, 18]


def _sinks_window_case(make_paged_kv, device, dtype=torch.float32):
    """A decode batch over EXTRAS_LENS (2 KV heads, 4 query heads, block size 4), q, and sinks some of which
    outweigh every key."""
    paged = make_paged_kv(EXTRAS_LENS, 2, 16, 4, dtype, device)
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(len(EXTRAS_LENS), 4, 16, generator=gen).to(device)
    sinks = (2.0 * torch.randn(4, generator=gen)).to(device)
    return paged, q, sinks


def _engine_cpu_attention(q, paged, sinks, window, scale):
    """engine.worker.attention's float64 torch path (the one the gpt-oss model test holds equal to transformers)
    for one new token per sequence."""
    from splitserve.engine.worker.attention import AttentionMetadata, attention_sinks_window_torch

    batch = q.shape[0]
    qsl = list(range(batch + 1))
    meta = AttentionMetadata(
        torch.tensor(qsl, dtype=torch.int32),
        paged.seq_lens.cpu(),
        paged.block_tables.cpu(),
        torch.empty(0),
        1,
        max(EXTRAS_LENS),
        qsl,
        paged.seq_lens.tolist(),
    )
    k, v = paged.k_cache.double().cpu(), paged.v_cache.double().cpu()
    return attention_sinks_window_torch(q.double().cpu(), k, v, meta, scale, sinks, window)


# sinks alone; windows shorter than some contexts (5: shorter than 7, 18 and 37), starting mid-block and
# mid-tile (20), longer than every context (64); windows with sinks
@pytest.mark.parametrize("with_sinks,window", [(True, None), (False, 5), (False, 20), (True, 20), (True, 64)])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_sinks_and_window_match_the_engines_cpu_attention(make_paged_kv, device, with_sinks, window, num_splits):
    """16-token tiles, so three splits of a window share it (37 tokens, window 20: [17, 33), [33, 37), none)."""
    from splitserve.kernels.paged_decode_attention import paged_decode_attention_triton

    paged, q, sinks = _sinks_window_case(make_paged_kv, device)
    sinks = sinks if with_sinks else None
    want = _engine_cpu_attention(q, paged, None if sinks is None else sinks.double().cpu(), window, 0.25)
    args = (q, paged.k_cache, paged.v_cache, paged.block_tables, paged.seq_lens, 0.25)
    config = dict(BLOCK_N=16, num_warps=4, num_stages=1)
    got = paged_decode_attention_triton(*args, num_splits=num_splits, config=config, sinks=sinks, sliding_window=window)
    torch.testing.assert_close(got.double().cpu(), want, atol=1e-5, rtol=1e-5)
    ref = paged_decode_attention(*args, impl="ref", sinks=sinks, sliding_window=window)
    torch.testing.assert_close(ref.double().cpu(), want, atol=1e-5, rtol=1e-5)
    plain = paged_decode_attention(*args, impl="ref")
    assert not torch.allclose(plain, ref, atol=1e-2)  # the extras matter on these inputs


@pytest.mark.parametrize("num_splits", [1, 2])
def test_keys_outside_the_window_are_never_read(make_paged_kv, device, num_splits):
    """NaN in every key and value before each sequence's window (blocks wholly outside it, and the head of the
    block where it starts) leaves the output finite and equal to the clean cache's: those blocks are skipped,
    not masked (a masked score still multiplies its NaN value by zero)."""
    from splitserve.kernels.paged_decode_attention import paged_decode_attention_triton

    paged, q, sinks = _sinks_window_case(make_paged_kv, device)
    args = (q, paged.k_cache, paged.v_cache, paged.block_tables, paged.seq_lens, 0.25)
    extras = dict(num_splits=num_splits, sinks=sinks, sliding_window=6)
    want = paged_decode_attention_triton(*args, **extras)
    for b, seq_len in enumerate(EXTRAS_LENS):
        for pos in range(max(seq_len - 6, 0)):
            block = paged.block_tables[b, pos // 4]
            paged.k_cache[block, pos % 4] = float("nan")
            paged.v_cache[block, pos % 4] = float("nan")
    got = paged_decode_attention_triton(*args, **extras)
    assert torch.equal(got, want)


def test_sinks_and_window_over_an_fp8_cache(device):
    """An e4m3 cache takes the extras in the upcast kernel (the fp8 variants take none): equal to the reference
    on the same e4m3 values, split or not; a variant named with them is refused."""
    from splitserve.kernels.paged_decode_attention import paged_decode_attention_triton
    from tests.kernels.conftest import PagedKv

    paged = PagedKv(EXTRAS_LENS, 2, 16, 4, torch.float8_e4m3fn, device)
    gen = torch.Generator().manual_seed(4)
    q = torch.randn(len(EXTRAS_LENS), 4, 16, generator=gen).to(device)
    sinks = torch.randn(4, generator=gen).to(device)
    args = (q, paged.k_cache, paged.v_cache, paged.block_tables, paged.seq_lens, 0.25)
    want = paged_decode_attention(*args, impl="ref", sinks=sinks, sliding_window=9)
    for num_splits in (1, 2):
        got = paged_decode_attention_triton(*args, num_splits=num_splits, sinks=sinks, sliding_window=9)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match=r"^paged_decode_attention: sinks and sliding windows run in VARIANT "):
        paged_decode_attention_triton(*args, config=dict(VARIANT="rows"), sinks=sinks)


def test_sinks_and_window_refusals(device):
    q = torch.zeros(1, 4, 16, device=device)
    cache = torch.zeros(2, 4, 2, 16, device=device)
    args = (q, cache, cache, torch.zeros(1, 1, dtype=torch.int32, device=device), torch.ones(1, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"^paged_decode_attention: sinks must be \(4,\) \(one per query head\), "):
        paged_decode_attention(*args, 1.0, sinks=torch.zeros(2, device=device))
    with pytest.raises(ValueError, match=r"^paged_decode_attention: sliding_window must be at least 1, got 0$"):
        paged_decode_attention(*args, 1.0, sliding_window=0)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("num_splits", [None, 1, 8])
@pytest.mark.parametrize("window", [None, 128])
def test_gpu_gpt_oss_shape_with_sinks(make_paged_kv, cache_dtype, num_splits, window):
    """gpt-oss-120b's attention shape (64 query heads, 8 KV heads, head_dim 64, block 16) with sinks, over
    contexts from 1 to 3000 tokens, against the reference."""
    seq_lens = [3000, 1, 517, 2048, 33, 130]
    paged = make_paged_kv(seq_lens, 8, 64, 16, cache_dtype, "cuda")
    gen = torch.Generator().manual_seed(6)
    q = torch.randn(len(seq_lens), 64, 64, generator=gen).to("cuda", torch.bfloat16)
    sinks = torch.randn(64, generator=gen).to("cuda", torch.bfloat16)
    args = (q, paged.k_cache, paged.v_cache, paged.block_tables, paged.seq_lens, 0.125)
    extras = dict(sinks=sinks, sliding_window=window)
    got = paged_decode_attention(*args, num_splits=num_splits, **extras)
    want = paged_decode_attention(*args, impl="ref", **extras)
    torch.testing.assert_close(got.float(), want.float(), atol=1.6e-2, rtol=1.6e-2)
