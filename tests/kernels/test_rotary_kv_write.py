"""The fused rotary + KV write against the two unfused ops it replaces (rotary_embedding, write_kv)."""

import pytest
import torch

from splitserve.kernels.kv_write import write_kv
from splitserve.kernels.rotary import build_cos_sin_cache, rotary_embedding
from splitserve.kernels.rotary_kv_write import rotary_kv_write


def _inputs(device, dtype, num_tokens, num_q_heads, num_kv_heads, head_dim, block_size):
    gen = torch.Generator().manual_seed(1)
    width = (num_q_heads + 2 * num_kv_heads) * head_dim
    qkv = torch.randn(num_tokens, width, generator=gen).to(dtype).to(device)  # one fused projection's output
    q_end, k_end = num_q_heads * head_dim, (num_q_heads + num_kv_heads) * head_dim
    q = qkv[:, :q_end].view(num_tokens, num_q_heads, head_dim)
    k = qkv[:, q_end:k_end].view(num_tokens, num_kv_heads, head_dim)
    v = qkv[:, k_end:].view(num_tokens, num_kv_heads, head_dim)
    num_blocks = num_tokens // block_size + 3
    kv = torch.full((num_blocks, 2, 2, block_size, num_kv_heads, head_dim), 7.0, dtype=dtype, device=device)
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
