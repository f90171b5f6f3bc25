"""The fused MoE kernel (Triton; the interpreter on CPU) against its torch reference computed in float64,
the expert alignment's exact layout, and the shape checks."""

import pytest
import torch

from splitserve.kernels.fused_moe import choose_config, fused_moe, fused_moe_ref, moe_align_block_size

TOL = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 3e-2}


def test_align_sorts_pairs_by_expert_padded_to_the_block(device):
    # 4 tokens, top-2 of 4 experts; flat pair numbers t * 2 + j
    topk_ids = torch.tensor([[2, 0], [0, 3], [2, 0], [0, 2]], dtype=torch.int64, device=device)
    sorted_ids, expert_ids, num_post = moe_align_block_size(topk_ids, block_m=4, num_experts=4)
    # expert 0: pairs 1, 2, 5, 6; expert 1: none; expert 2: 0, 4, 7 + one pad (8); expert 3: 3 + three pads
    assert num_post.tolist() == [12]
    assert sorted_ids[:12].tolist() == [1, 2, 5, 6, 0, 4, 7, 8, 3, 8, 8, 8]
    assert expert_ids[:3].tolist() == [0, 2, 3]
    # room for the worst case: 8 pairs over min(4, 8) experts, each padded by up to 3 rows
    assert sorted_ids.numel() == 20 and expert_ids.numel() == 5


def test_align_counts_past_one_chunk_of_pairs(device):
    gen = torch.Generator().manual_seed(3)
    topk_ids = torch.stack([torch.randperm(8, generator=gen)[:3] for _ in range(100)]).to(device)  # 300 pairs
    sorted_ids, expert_ids, num_post = moe_align_block_size(topk_ids, block_m=16, num_experts=8)
    total = int(num_post)
    flat = topk_ids.reshape(-1).cpu()
    rows = sorted_ids[:total].cpu().reshape(-1, 16)
    for block, expert in zip(rows, expert_ids[: total // 16].cpu().tolist()):
        real = block[block < 300]
        assert (flat[real.long()] == expert).all()
    got = sorted_ids[:total].cpu()
    assert sorted(got[got < 300].tolist()) == list(range(300))  # every pair exactly once
    counts = torch.bincount(flat, minlength=8)
    assert total == int(((counts + 15) // 16 * 16).sum())


def _case(num_tokens, hidden, inter, num_experts, top_k, dtype, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=gen).to(dtype)
    w13 = (torch.randn(num_experts, 2 * inter, hidden, generator=gen) * hidden**-0.5).to(dtype)
    w2 = (torch.randn(num_experts, hidden, inter, generator=gen) * inter**-0.5).to(dtype)
    ids = torch.stack([torch.randperm(num_experts, generator=gen)[:top_k] for _ in range(num_tokens)])
    weights = torch.rand(num_tokens, top_k, generator=gen)
    return [t.to(device) for t in (x, w13, w2, weights, ids)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(
    "num_tokens,hidden,inter,num_experts,top_k,tiles",
    [
        (1, 32, 48, 4, 2, (16, 32, 16)),  # one token: every block mostly padding
        (7, 64, 40, 8, 2, (16, 32, 32)),  # ragged N and K tiles
        (5, 32, 16, 8, 8, (32, 16, 32)),  # top-8: every expert hit
    ],
)
def test_fused_moe_matches_the_float64_reference(num_tokens, hidden, inter, num_experts, top_k, tiles, dtype, device):
    x, w13, w2, weights, ids = _case(num_tokens, hidden, inter, num_experts, top_k, dtype, device)
    block_m, block_n, block_k = tiles
    config = dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4, num_stages=2)
    got = fused_moe(x, w13, w2, weights, ids, impl="triton", config=config)
    want = fused_moe_ref(*(t.double() for t in (x, w13, w2, weights)), ids)
    assert got.dtype == dtype and got.shape == (num_tokens, hidden)
    torch.testing.assert_close(got.double(), want, atol=TOL[dtype], rtol=TOL[dtype])


def test_cpu_tensors_take_the_reference_and_defaults_follow_the_token_count():
    x, w13, w2, weights, ids = _case(3, 32, 16, 4, 2, torch.float64, "cpu")
    assert torch.equal(fused_moe(x, w13, w2, weights, ids), fused_moe_ref(x, w13, w2, weights, ids))
    assert choose_config(x, 1, 32, 32)["BLOCK_M"] == 16
    assert choose_config(x, 256, 32, 32)["BLOCK_M"] == 64


def test_shapes_that_disagree_are_refused():
    x, w13, w2, weights, ids = _case(3, 32, 16, 4, 2, torch.float32, "cpu")
    disagree = r"^fused_moe: shapes disagree: x \(3, 32\), w13 \(4, 32, 32\), w2 \(4, 32, 8\)"
    with pytest.raises(ValueError, match=disagree):
        fused_moe(x, w13, w2[:, :, :8], weights, ids)
    with pytest.raises(ValueError, match=r"^fused_moe: topk_ids \(3, 2\) and topk_weights \(3, 1\) must both be"):
        fused_moe(x, w13, w2, weights[:, :1], ids)


def _quantized(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(E, N, K) -> (e4m3 weights, (E, N) float32 scales), one scale per expert and output row."""
    scale = w.float().abs().amax(dim=2) / 448.0  # (E, N)
    return (w.float() / scale[:, :, None]).to(torch.float8_e4m3fn), scale


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_fp8_experts_match_the_reference_on_their_dequantized_weights(dtype, device):
    x, w13, w2, weights, ids = _case(6, 64, 40, 8, 2, dtype, device, seed=4)
    (w13_q, w13_scale), (w2_q, w2_scale) = _quantized(w13), _quantized(w2)
    config = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, num_warps=4, num_stages=2)
    got = fused_moe(x, w13_q, w2_q, weights, ids, w13_scale=w13_scale, w2_scale=w2_scale, impl="triton", config=config)
    w13_d = w13_q.double() * w13_scale.double()[:, :, None]
    w2_d = w2_q.double() * w2_scale.double()[:, :, None]
    want = fused_moe_ref(x.double(), w13_d, w2_d, weights.double(), ids)
    torch.testing.assert_close(got.double(), want, atol=TOL[dtype], rtol=TOL[dtype])
    ref = fused_moe(x, w13_q, w2_q, weights, ids, w13_scale=w13_scale, w2_scale=w2_scale, impl="ref")
    torch.testing.assert_close(ref.double(), want, atol=TOL[dtype], rtol=TOL[dtype])
    with pytest.raises(ValueError, match=r"^fused_moe: e4m3 experts need both weights in e4m3 and both scales; got"):
        fused_moe(x, w13_q, w2_q, weights, ids, w13_scale=w13_scale)


def _interleaved(w13: torch.Tensor) -> torch.Tensor:
    """[gate | up] halves along dim 1 -> rows g0, u0, g1, u1, ... (gpt-oss's order)."""
    half = w13.shape[1] // 2
    return torch.stack((w13[:, :half], w13[:, half:]), dim=2).reshape(w13.shape)


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_biased_experts_with_the_clamped_swiglu_match_the_float64_reference(dtype, interleaved, device):
    x, w13, w2, weights, ids = _case(6, 64, 40, 8, 2, dtype, device, seed=5)
    gen = torch.Generator().manual_seed(6)
    b13 = (0.5 * torch.randn(8, 80, generator=gen)).to(dtype).to(device)
    b2 = (0.5 * torch.randn(8, 64, generator=gen)).to(dtype).to(device)
    double = dict(w13_bias=b13.double(), w2_bias=b2.double(), clamped_swiglu=(1.702, 0.6))
    want = fused_moe_ref(*(t.double() for t in (x, w13, w2, weights)), ids, **double)
    if interleaved:  # the same experts stored in gpt-oss's row order
        w13, b13 = _interleaved(w13), _interleaved(b13.unsqueeze(-1)).squeeze(-1)
    gpt_oss = dict(w13_bias=b13, w2_bias=b2, clamped_swiglu=(1.702, 0.6), interleaved=interleaved)
    config = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, num_warps=4, num_stages=2)
    got = fused_moe(x, w13, w2, weights, ids, **gpt_oss, impl="triton", config=config)
    torch.testing.assert_close(got.double(), want, atol=TOL[dtype], rtol=TOL[dtype])
    in_double = {**gpt_oss, "w13_bias": b13.double(), "w2_bias": b2.double()}
    ref = fused_moe(*(t.double() for t in (x, w13, w2, weights)), ids, **in_double, impl="ref")
    torch.testing.assert_close(ref, want, atol=1e-12, rtol=1e-12)
    gate_up = torch.einsum("th,efh->tef", x.double(), w13.double()) + b13.double()  # every expert's projections
    assert (gate_up.abs() > 0.6).float().mean() > 0.2  # the clamp bites
    plain = fused_moe(*(t.double() for t in (x, w13, w2, weights)), ids, **{**in_double, "clamped_swiglu": None})
    assert not torch.allclose(plain, want, atol=1e-2)  # the clamped activation is not SiLU's
    with pytest.raises(ValueError, match=r"^fused_moe: w2_bias must be \(8, 64\) \(E, rows of its weight\), got"):
        fused_moe(x, w13, w2, weights, ids, w2_bias=b2[:, :32])


def test_fp8_gpt_oss_experts_match_the_reference_on_their_dequantized_weights(device):
    """gpt-oss's experts under --quantization fp8: interleaved e4m3 rows with their row scales, biases and the
    clamped SwiGLU in one launch each, against the float64 reference on the dequantized weights."""
    dtype = torch.bfloat16
    x, w13, w2, weights, ids = _case(4, 32, 16, 4, 2, dtype, device, seed=8)
    gen = torch.Generator().manual_seed(9)
    b13 = (0.5 * torch.randn(4, 32, generator=gen)).to(dtype).to(device)
    b2 = (0.5 * torch.randn(4, 32, generator=gen)).to(dtype).to(device)
    (w13_q, w13_scale), (w2_q, w2_scale) = _quantized(_interleaved(w13)), _quantized(w2)
    gpt_oss = dict(w13_bias=b13, w2_bias=b2, clamped_swiglu=(1.702, 0.6), interleaved=True)
    config = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, num_warps=4, num_stages=2)
    scales = dict(w13_scale=w13_scale, w2_scale=w2_scale)
    got = fused_moe(x, w13_q, w2_q, weights, ids, **scales, **gpt_oss, impl="triton", config=config)
    w13_d = w13_q.double() * w13_scale.double()[:, :, None]
    w2_d = w2_q.double() * w2_scale.double()[:, :, None]
    in_double = {**gpt_oss, "w13_bias": b13.double(), "w2_bias": b2.double()}
    want = fused_moe_ref(x.double(), w13_d, w2_d, weights.double(), ids, **in_double)
    torch.testing.assert_close(got.double(), want, atol=TOL[dtype], rtol=TOL[dtype])
    ref = fused_moe(x, w13_q, w2_q, weights, ids, **scales, **gpt_oss, impl="ref")
    torch.testing.assert_close(ref.double(), want, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_captured_graph_replays_new_routing_without_host_syncs():
    """The default tiles at a bf16 shape with many experts; routing changed in place between replays of one
    captured graph gives the reference's answer for the new routing (no shape or host value baked in)."""
    x, w13, w2, weights, ids = _case(48, 256, 128, 32, 4, torch.bfloat16, "cuda", seed=7)
    out = torch.empty_like(x)
    fused_moe(x, w13, w2, weights, ids)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out.copy_(fused_moe(x, w13, w2, weights, ids))
    for seed in (8, 9):
        _, _, _, new_weights, new_ids = _case(48, 256, 128, 32, 4, torch.bfloat16, "cuda", seed=seed)
        weights.copy_(new_weights)
        ids.copy_(new_ids)
        graph.replay()
        want = fused_moe_ref(*(t.double() for t in (x, w13, w2, weights)), ids)
        torch.testing.assert_close(out.double(), want, atol=3e-2, rtol=3e-2)
