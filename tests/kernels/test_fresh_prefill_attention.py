"""Fresh-prompt prefill attention (TMA descriptors over the step's own k/v) against fp64 causal attention."""

import pytest
import torch

from splitserve.kernels.fresh_prefill_attention import fresh_prefill_attention, fresh_supported


def _dense_causal(q, k, v, qsl, scale):
    """fp64 causal attention of each sequence's rows: (T, Hq, D)."""
    group = q.shape[1] // k.shape[1]
    out = torch.zeros(q.shape, dtype=torch.float64)
    for start, end in zip(qsl[:-1], qsl[1:]):
        qi, ki, vi = (t[start:end].double().cpu() for t in (q, k, v))
        ki, vi = ki.repeat_interleave(group, dim=1), vi.repeat_interleave(group, dim=1)  # (L, Hq, D)
        scores = torch.einsum("qhd,khd->hqk", qi, ki) * scale
        n = end - start
        scores = scores.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
        out[start:end] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), vi)
    return out


@pytest.mark.parametrize(
    "lens,num_q_heads,num_kv_heads,head_dim,config",
    [
        ([37], 4, 2, 32, None),
        ([5, 16, 1, 23], 2, 1, 16, None),  # tiles cross sequence ends; a one-token prompt
        ([40, 9], 4, 4, 64, dict(BLOCK_M=32, BLOCK_N=16)),  # a diagonal of two key tiles
    ],
)
def test_matches_dense_causal(device, lens, num_q_heads, num_kv_heads, head_dim, config):
    gen = torch.Generator().manual_seed(3)
    total = sum(lens)
    width = (num_q_heads + 2 * num_kv_heads) * head_dim
    qkv = torch.randn(total, width, generator=gen).to(torch.float16).to(device)  # the projection's output
    q = qkv[:, : num_q_heads * head_dim].view(total, num_q_heads, head_dim)
    k = qkv[:, num_q_heads * head_dim : (num_q_heads + num_kv_heads) * head_dim].view(total, num_kv_heads, head_dim)
    v = qkv[:, (num_q_heads + num_kv_heads) * head_dim :].view(total, num_kv_heads, head_dim)
    assert fresh_supported(q, k, v)
    qsl = [0]
    for n in lens:
        qsl.append(qsl[-1] + n)
    scale = head_dim**-0.5
    out = fresh_prefill_attention(
        q, k, v, torch.tensor(qsl, dtype=torch.int32, device=device), max(lens), scale, config=config
    )
    torch.testing.assert_close(out.double().cpu(), _dense_causal(q, k, v, qsl, scale), atol=2e-3, rtol=2e-3)


def test_supported_needs_16_bit_data_and_contiguous_heads(device):
    q = torch.zeros(4, 2, 32, dtype=torch.float16, device=device)
    assert fresh_supported(q, q[:, :1], q[:, 1:])
    assert not fresh_supported(q.float(), q.float()[:, :1], q.float()[:, 1:])
    assert not fresh_supported(q[:, :, :16], q[:, :1, :16], q[:, 1:, :16])  # head rows not contiguous


def test_tiles_must_nest(device):
    q = torch.zeros(4, 2, 32, dtype=torch.float16, device=device)
    qsl = torch.tensor([0, 4], dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="BLOCK_M 16 must be a multiple of BLOCK_N 32"):
        fresh_prefill_attention(q, q, q, qsl, 4, 1.0, config=dict(BLOCK_M=16, BLOCK_N=32))
