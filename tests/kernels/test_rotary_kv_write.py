"""The fused rotary + KV write against the two unfused ops it replaces (rotary_embedding, write_kv)."""

import pytest
import torch

from splitserve.kernels.kv_write import write_kv
from splitserve.kernels.rmsnorm import rms_norm
from splitserve.kernels.rotary import build_cos_sin_cache, rotary_embedding
from splitserve.kernels.rotary_kv_write import rotary_kv_write


def _inputs(device, dtype, num_tokens, num_q_heads, num_kv_heads, head_dim, block_size, cache_dtype=None):
    gen = torch.Generator().manual_seed(1)
    width = (num_q_heads + 2 * num_kv_heads) * head_dim
    qkv = torch.randn(num_tokens, width, generator=gen).to(dtype).to(device)  # one fused projection's output
    q_end, k_end = num_q_heads * head_dim, (num_q_heads + num_kv_heads) * head_dim
    q = qkv[:, :q_end].view(num_tokens, num_q_heads, head_dim)
    k = qkv[:, q_end:k_end].view(num_tokens, num_kv_heads, head_dim)
    v = qkv[:, k_end:].view(num_tokens, num_kv_heads, head_dim)
    num_blocks = num_tokens // block_size + 3
    kv_shape = (num_blocks, 2, 2, block_size, num_kv_heads, head_dim)
    kv = torch.full(kv_shape, 7.0, dtype=cache_dtype or dtype, device=device)
    k_cache, v_cache = kv[:, 1, 0], kv[:, 1, 1]  # strided, as engine.kv_layout hands them out
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[1] = -1  # a padding row: nothing written
    positions = torch.randint(0, 200, (num_tokens,), generator=gen)
    cache = build_cos_sin_cache(head_dim, 256, 10000.0, None, dtype, device=device)
    return qkv, q, k, v, kv, k_cache, v_cache, slots.to(device), positions.to(device), cache


@pytest.mark.parametrize("impl", ["triton", "ref"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("num_q_heads,num_kv_heads,head_dim,block_size", [(4, 2, 16, 4), (3, 1, 24, 16), (2, 2, 64, 8)])
def test_equals_rotary_then_write(device, impl, dtype, num_q_heads, num_kv_heads, head_dim, block_size):
    args = _inputs(device, dtype, 9, num_q_heads, num_kv_heads, head_dim, block_size)
    qkv, q, k, v, kv, k_cache, v_cache, slots, positions, cache = args
    want_qkv, want_kv = qkv.clone(), kv.clone()
    q_end, k_end = q.shape[1] * head_dim, (q.shape[1] + k.shape[1]) * head_dim
    wq = want_qkv[:, :q_end].view(q.shape)
    wk, wv = want_qkv[:, q_end:k_end].view(k.shape), want_qkv[:, k_end:].view(v.shape)
    rotary_embedding(positions, wq, wk, cache, impl="ref")
    write_kv(wk, wv, want_kv[:, 1, 0], want_kv[:, 1, 1], slots, impl="ref")

    rotary_kv_write(positions, q, k, v, k_cache, v_cache, slots, cache, impl=impl)

    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-3, rtol=1e-3)
    torch.testing.assert_close(qkv, want_qkv, **tol)  # q and k rotated in place, v untouched
    torch.testing.assert_close(kv, want_kv, **tol)  # the written slots, and nothing else (7.0 stays)
    assert (kv[:, 0] == 7.0).all() and (kv[:, 1] == 7.0).sum() == (want_kv[:, 1] == 7.0).sum()


def test_rejects_a_bad_positions_shape(device):
    qkv, q, k, v, kv, k_cache, v_cache, slots, positions, cache = _inputs(device, torch.float32, 4, 2, 1, 16, 4)
    with pytest.raises(ValueError, match=r"rotary_kv_write: positions must be \(4,\), got \(3,\)"):
        rotary_kv_write(positions[:3], q, k, v, k_cache, v_cache, slots, cache)


FP8 = torch.float8_e4m3fn


def _bits(x: torch.Tensor) -> torch.Tensor:
    """x's bytes as integers of its width, on the CPU (exact comparison, nan and -0.0 included)."""
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32}
    return x.cpu().view(ints[x.element_size()])


@pytest.mark.parametrize("impl", ["triton", "ref"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("k_scale,v_scale", [(1.0, 1.0), (0.37, 2.5)])
@pytest.mark.parametrize("num_q_heads,num_kv_heads,head_dim,block_size", [(4, 2, 16, 4), (6, 1, 32, 16)])
def test_fp8_cache_bytes_equal_rotary_then_write(
    device, impl, dtype, k_scale, v_scale, num_q_heads, num_kv_heads, head_dim, block_size
):
    """Into an e4m3 cache with per-layer scales: the cached bytes, and q and k rotated in place, equal
    rotary_embedding then write_kv (same impl) bit for bit; padding rows (slot -1) and every other slot keep
    their bytes. Triton is compared with Triton: the interpreter's float32 -> e4m3 cast differs from torch's
    in places (it can lose a rounding carry), the same in both kernels; on a GPU they compile for real."""
    args = _inputs(device, dtype, 9, num_q_heads, num_kv_heads, head_dim, block_size, cache_dtype=FP8)
    qkv, q, k, v, kv, k_cache, v_cache, slots, positions, cache = args
    k_end = (num_q_heads + num_kv_heads) * head_dim
    qkv[0, k_end - 1] = 2000.0  # a key past 448 * k_scale, and a value: clamped to +-448, never nan
    qkv[2, -1] = -3000.0
    want_qkv, want_kv = qkv.clone(), kv.clone()
    q_end = num_q_heads * head_dim
    wq = want_qkv[:, :q_end].view(q.shape)
    wk, wv = want_qkv[:, q_end:k_end].view(k.shape), want_qkv[:, k_end:].view(v.shape)
    rotary_embedding(positions, wq, wk, cache, impl=impl)
    write_kv(wk, wv, want_kv[:, 1, 0], want_kv[:, 1, 1], slots, impl=impl, k_scale=k_scale, v_scale=v_scale)

    rotary_kv_write(positions, q, k, v, k_cache, v_cache, slots, cache, impl=impl, k_scale=k_scale, v_scale=v_scale)

    assert torch.equal(_bits(qkv), _bits(want_qkv))  # q and k rotated in place, v untouched
    assert torch.equal(_bits(kv), _bits(want_kv))
    written = torch.zeros(kv.shape[0], block_size, dtype=torch.bool)  # (num_blocks, bs)
    for slot in slots.tolist():
        if slot >= 0:
            written[slot // block_size, slot % block_size] = True
    assert int(written.sum()) == 8  # nine tokens, one padding row
    untouched = torch.cat([kv[:, 0].flatten(), kv[:, 1].transpose(0, 1)[:, ~written.to(device)].flatten()])
    assert bool((untouched.float() == 7.0).all()), "a padding row or another slot was written"
    assert bool((kv[:, 1].float().abs() <= 448).all()) and float(kv[:, 1].float().abs().max()) == 448.0


@pytest.mark.parametrize("impl", ["triton", "ref"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cache_dtype", [None, FP8])
def test_qk_norms_then_rotary_then_write(device, impl, dtype, cache_dtype):
    """Qwen3's per-head q/k RMSNorm taken in: equal to rms_norm over each head, then rotary_embedding and write_kv in
    the same impl (every norm weight distinct, so a head normalized with the other's weight shows). The references
    bit for bit; the kernel's mean of squares adds two halves' sums, so a 16-bit head may round a last bit apart
    before the rotation mixes it (within 2 ulps after it), and an e4m3 byte fed by it with it."""
    heads, kv_heads, dim, bs = 4, 2, 32, 4
    args = _inputs(device, dtype, 9, heads, kv_heads, dim, bs, cache_dtype)
    qkv, q, k, v, kv, k_cache, v_cache, slots, positions, cache = args
    gen = torch.Generator().manual_seed(2)
    q_w, k_w = (torch.rand(dim, generator=gen).add(0.5).to(dtype).to(device) for _ in range(2))
    want_qkv, want_kv = qkv.clone(), kv.clone()
    wq = want_qkv[:, : heads * dim].view(q.shape)
    wk = want_qkv[:, heads * dim : (heads + kv_heads) * dim].view(k.shape)
    wv = want_qkv[:, (heads + kv_heads) * dim :].view(v.shape)
    wq.copy_(rms_norm(wq, q_w, 1e-6, impl=impl))
    wk.copy_(rms_norm(wk, k_w, 1e-6, impl=impl))
    rotary_embedding(positions, wq, wk, cache, impl=impl)
    write_kv(wk, wv, want_kv[:, 1, 0], want_kv[:, 1, 1], slots, impl=impl, k_scale=0.5, v_scale=2.0)

    rotary_kv_write(
        positions, q, k, v, k_cache, v_cache, slots, cache, impl=impl, k_scale=0.5, v_scale=2.0, q_norm=q_w,
        k_norm=k_w, eps=1e-6,
    )  # fmt: skip

    differ = int((_bits(kv) != _bits(want_kv)).sum())
    if impl == "ref":
        assert torch.equal(_bits(qkv), _bits(want_qkv)) and differ == 0
        return
    if dtype == torch.float32:
        torch.testing.assert_close(qkv, want_qkv, atol=1e-5, rtol=1e-5)
    else:  # 2 bf16 ulps of the larger of the two values the rotation mixed
        bound = 2 * 2.0 ** (torch.floor(torch.log2(want_qkv.float().abs().view(9, -1, dim).amax(-1, True))) - 7)
        err = (qkv.float() - want_qkv.float()).abs().view(9, -1, dim)
        assert bool((err <= bound).all()), f"max error {err.max():.3g}"
    assert (qkv[:, (heads + kv_heads) * dim :] == want_qkv[:, (heads + kv_heads) * dim :]).all()  # v untouched
    if cache_dtype is None:
        torch.testing.assert_close(kv, want_kv, atol=1e-5 if dtype == torch.float32 else 0.07, rtol=1e-5)
    else:  # of the 9 x 2 x 32 key bytes written, only those whose bf16 key rounded apart
        assert differ <= (1 if dtype == torch.float32 else 20), f"{differ} cache bytes differ"


def test_norms_come_together_and_fit_the_head_dim(device):
    qkv, q, k, v, kv, k_cache, v_cache, slots, positions, cache = _inputs(device, torch.float32, 4, 2, 1, 16, 4)
    w = torch.ones(16, device=device)
    with pytest.raises(ValueError, match="rotary_kv_write: q_norm and k_norm come together"):
        rotary_kv_write(positions, q, k, v, k_cache, v_cache, slots, cache, q_norm=w)
    with pytest.raises(ValueError, match=r"rotary_kv_write: k_norm must be a contiguous \(16,\), got \(8,\)"):
        rotary_kv_write(positions, q, k, v, k_cache, v_cache, slots, cache, q_norm=w, k_norm=w[:8])
