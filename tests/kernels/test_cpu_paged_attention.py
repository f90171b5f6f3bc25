"""The CPU paged decode attention op against the torch reference (fp32, fp64, GQA, ragged)."""

import pytest
import torch

from kernels import cpu_paged_attention


def dense_reference(q, k_cache, v_cache, tables, seq_lens, scale):
    """float64 attention over each sequence's gathered context (zeros for an empty one)."""
    out = torch.zeros(q.shape, dtype=torch.float64)
    group = q.shape[1] // k_cache.shape[2]
    for b, n in enumerate(seq_lens.tolist()):
        if n == 0:
            continue
        k = k_cache[tables[b].long()].reshape(-1, *k_cache.shape[2:])[:n].double()  # (n, Hkv, D)
        v = v_cache[tables[b].long()].reshape(-1, *v_cache.shape[2:])[:n].double()
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)  # (n, Hq, D)
        probs = (torch.einsum("hd,nhd->hn", q[b].double(), k) * scale).softmax(-1)
        out[b] = torch.einsum("hn,nhd->hd", probs, v)
    return out


@pytest.fixture(scope="module")
def op():
    module = cpu_paged_attention.load()
    assert module is not None, "the C++ op did not build (needs g++ and ninja; see scripts/install.sh)"
    return module


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 2e-6), (torch.float64, 1e-12)])
@pytest.mark.parametrize("num_q_heads, num_kv_heads", [(4, 4), (8, 4), (8, 2), (4, 1)])
@pytest.mark.parametrize("block_size", [4, 16])
def test_matches_reference(op, dtype, tol, num_q_heads, num_kv_heads, block_size):
    torch.manual_seed(0)
    head_dim, num_blocks, layers = 32, 64, 3
    kv = torch.randn(num_blocks, layers, 2, block_size, num_kv_heads, head_dim, dtype=dtype)  # block-major
    k_cache, v_cache = kv[:, 1, 0], kv[:, 1, 1]
    seq_lens = torch.tensor([1, block_size + 3, 5 * block_size, 2, 0], dtype=torch.int32)
    tables = torch.stack([torch.randperm(num_blocks)[:6] for _ in seq_lens]).int()
    q = torch.randn(len(seq_lens), num_q_heads, head_dim, dtype=dtype)
    got = cpu_paged_attention.paged_decode_attention_cpu(q, k_cache, v_cache, tables, seq_lens, 0.3)
    want = dense_reference(q, k_cache, v_cache, tables, seq_lens, 0.3)
    assert torch.allclose(got.double(), want, atol=tol, rtol=0)
    assert torch.equal(got[4], torch.zeros_like(got[4]))  # seq_len 0 -> zeros
