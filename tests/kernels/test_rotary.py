"""Rotary embedding (Triton and reference) and the cos/sin cache builder, against HF Llama."""

import math

import pytest
import torch

from splitserve.kernels import build_cos_sin_cache, rotary_embedding

ON_GPU = torch.cuda.is_available()
needs_gpu = pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
TOL = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 8e-3}
LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


def hf_rotate(x, positions, cache):
    """HF apply_rotary_pos_emb in fp32: x * cat(cos, cos) + rotate_half(x) * cat(sin, sin)."""
    half = cache.shape[1] // 2
    cos, sin = cache[positions, :half].float(), cache[positions, half:].float()  # (T, D/2)
    cos, sin = torch.cat([cos, cos], -1)[:, None], torch.cat([sin, sin], -1)[:, None]  # (T, 1, D)
    xf = x.float()
    rotated = torch.cat([-xf[..., half:], xf[..., :half]], dim=-1)
    return xf * cos + rotated * sin


@pytest.mark.parametrize("impl", ["triton", "ref"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("num_q_heads,num_kv_heads,head_dim", [(4, 2, 16), (3, 1, 24), (2, 2, 64)])
def test_rotation_matches_hf(device, impl, dtype, num_q_heads, num_kv_heads, head_dim):
    gen = torch.Generator().manual_seed(0)
    cache = build_cos_sin_cache(head_dim, 100, 10000.0, LLAMA3, torch.float32, device=device)
    positions = torch.tensor([0, 5, 99, 42, 7], device=device)
    q = torch.randn(5, num_q_heads, head_dim, generator=gen).to(dtype).to(device)
    k = torch.randn(5, num_kv_heads, head_dim, generator=gen).to(dtype).to(device)
    want_q, want_k = hf_rotate(q, positions, cache), hf_rotate(k, positions, cache)
    rotary_embedding(positions, q, k, cache, impl=impl)
    torch.testing.assert_close(q.float(), want_q, atol=TOL[dtype], rtol=TOL[dtype])
    torch.testing.assert_close(k.float(), want_k, atol=TOL[dtype], rtol=TOL[dtype])


def test_rotates_strided_views_in_place(device):
    """q and k as views into one fused qkv projection output (T, (Hq + 2 Hkv) * D)."""
    qkv = torch.randn(3, (2 + 2 * 1) * 16, device=device)
    q, k = qkv[:, :32].view(3, 2, 16), qkv[:, 32:48].view(3, 1, 16)
    v_before = qkv[:, 48:].clone()
    cache = build_cos_sin_cache(16, 8, 10000.0, None, torch.float32, device=device)
    positions = torch.tensor([1, 2, 3], device=device)
    want_q, want_k = hf_rotate(q, positions, cache), hf_rotate(k, positions, cache)
    rotary_embedding(positions, q, k, cache, impl="triton")
    torch.testing.assert_close(q, want_q, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(k, want_k, atol=1e-6, rtol=1e-6)
    assert torch.equal(qkv[:, 48:], v_before)


def test_default_cache_values():
    cache = build_cos_sin_cache(4, 3, 100.0, None, torch.float64)  # inv_freq = [1, 0.1]
    angles = torch.tensor([[0.0, 0.0], [1.0, 0.1], [2.0, 0.2]], dtype=torch.float64)
    torch.testing.assert_close(cache, torch.cat([angles.cos(), angles.sin()], -1), atol=1e-7, rtol=1e-7)


def test_linear_scaling_divides_angles():
    plain = build_cos_sin_cache(8, 16, 10000.0, None, torch.float32)
    scaled = build_cos_sin_cache(8, 64, 10000.0, {"rope_type": "linear", "factor": 4.0}, torch.float32)
    torch.testing.assert_close(scaled[::4], plain, atol=1e-6, rtol=1e-6)  # position 4p scaled == p plain


@pytest.mark.parametrize(
    "rope_parameters",
    [
        {"rope_type": "default"},
        {"rope_type": "linear", "factor": 4.0},
        LLAMA3,
    ],
)
def test_cache_equals_hf_llama_rotary_embedding(rope_parameters):
    transformers = pytest.importorskip("transformers")
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = transformers.LlamaConfig(
        hidden_size=256,
        num_attention_heads=4,
        head_dim=64,
        max_position_embeddings=256,
        rope_parameters={**rope_parameters, "rope_theta": 500000.0},
    )
    cos, sin = LlamaRotaryEmbedding(config)(torch.zeros(1), torch.arange(200)[None])  # (1, 200, 64)
    cache = build_cos_sin_cache(64, 200, 500000.0, rope_parameters, torch.float32)
    assert torch.equal(cache[:, :32], cos[0, :, :32])
    assert torch.equal(cache[:, 32:], sin[0, :, :32])


def test_llama3_bands():
    """Short wavelengths are kept, long ones slowed by `factor`, the middle band blended."""
    inv = 1.0 / (10000.0 ** (torch.arange(0, 64, 2).float() / 64))
    cache = build_cos_sin_cache(64, 2, 10000.0, LLAMA3, torch.float64)
    got = torch.atan2(cache[1, 32:], cache[1, :32]).float()  # angle at position 1 = inv_freq
    wavelen = 2 * math.pi / inv
    short, long_ = wavelen < 64 / 4.0, wavelen > 64 / 1.0
    torch.testing.assert_close(got[short], inv[short], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(got[long_], inv[long_] / 8.0, atol=1e-7, rtol=1e-6)
    middle = ~short & ~long_
    assert middle.any() and bool(((got[middle] < inv[middle]) & (got[middle] > inv[middle] / 8.0)).all())


def test_unknown_rope_type_error():
    with pytest.raises(
        ValueError,
        match=r"^build_cos_sin_cache: rope_type 'dynamic' is not supported; choose one "
        r"of \('default', 'linear', 'llama3', 'yarn'\)$",
    ):
        build_cos_sin_cache(8, 4, 10000.0, {"rope_type": "dynamic", "factor": 2.0}, torch.float32)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_large(dtype):
    cache = build_cos_sin_cache(
        128, 8192, 500000.0, {**LLAMA3, "original_max_position_embeddings": 8192}, dtype, device="cuda"
    )
    positions = torch.randint(0, 8192, (1000,), device="cuda")
    q = torch.randn(1000, 32, 128, device="cuda").to(dtype)
    k = torch.randn(1000, 8, 128, device="cuda").to(dtype)
    want_q, want_k = hf_rotate(q, positions, cache), hf_rotate(k, positions, cache)
    rotary_embedding(positions, q, k, cache)
    torch.testing.assert_close(q.float(), want_q, atol=TOL[dtype], rtol=TOL[dtype])
    torch.testing.assert_close(k.float(), want_k, atol=TOL[dtype], rtol=TOL[dtype])
