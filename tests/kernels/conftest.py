"""Kernel-test setup: the Triton interpreter on CPU-only machines, paged-cache factories, and the
comparison of a paged attention op against fp64 dense attention.

TRITON_INTERPRET=1 must be in the environment before any @triton.jit decorator runs, i.e.
before `kernels` is imported; it is set only when no CUDA device is present, so on a GPU the
same tests compile real kernels.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture
def device() -> str:
    """Where the kernel tests run: the GPU when there is one, else the CPU interpreter."""
    return DEVICE


class PagedKv:
    """A block-major KV tensor (num_blocks, num_layers, 2, block_size, Hkv, D) poisoned with NaN,
    one layer's strided k/v views, shuffled block tables and the dense K/V of each sequence."""

    def __init__(
        self, seq_lens, num_kv_heads, head_dim, block_size, dtype, device, num_layers=3, layer=1, spare_blocks=3, seed=0
    ):
        gen = torch.Generator().manual_seed(seed)
        blocks_per_seq = [-(-n // block_size) for n in seq_lens]
        num_blocks = sum(blocks_per_seq) + spare_blocks
        shape = (num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim)
        self.kv = torch.full(shape, float("nan"), dtype=dtype, device=device)
        self.k_cache, self.v_cache = self.kv[:, layer, 0], self.kv[:, layer, 1]  # (N, bs, Hkv, D)
        order = torch.randperm(num_blocks, generator=gen).tolist()
        max_blocks = max(blocks_per_seq + [1]) + 1  # one unused (zero) entry per row at least
        table = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32)
        self.keys, self.values = [], []  # dense (L, Hkv, D) per sequence, fp32 on CPU
        for i, (n, nb) in enumerate(zip(seq_lens, blocks_per_seq)):
            ids = [order.pop() for _ in range(nb)]
            table[i, :nb] = torch.tensor(ids, dtype=torch.int32)
            k = torch.randn(n, num_kv_heads, head_dim, generator=gen).to(dtype)
            v = torch.randn(n, num_kv_heads, head_dim, generator=gen).to(dtype)
            pos = torch.arange(n)
            blk = torch.tensor(ids, dtype=torch.int64)[pos // block_size].to(device)  # (L,)
            off = (pos % block_size).to(device)
            self.k_cache[blk, off] = k.to(device)
            self.v_cache[blk, off] = v.to(device)
            self.keys.append(k.float())
            self.values.append(v.float())
        self.block_tables = table.to(device)
        self.seq_lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)


@pytest.fixture
def make_paged_kv():
    """Factory: make_paged_kv(seq_lens, num_kv_heads, head_dim, block_size, dtype, device) -> PagedKv."""
    return PagedKv


def dense_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float, first_pos: int
) -> torch.Tensor:
    """fp64 causal attention of q (Lq, Hq, D) at positions first_pos.. over keys/values (L, Hkv, D)."""
    dev = q.device
    q, keys, values = q.double(), keys.to(dev, torch.float64), values.to(dev, torch.float64)
    group = q.shape[1] // keys.shape[1]
    k = keys.repeat_interleave(group, dim=1)  # (L, Hq, D)
    v = values.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,lhd->hql", q, k) * scale  # (Hq, Lq, L)
    pos = torch.arange(q.shape[0], device=dev)[:, None] + first_pos
    scores = scores.masked_fill(torch.arange(k.shape[0], device=dev)[None, :] > pos, float("-inf"))
    return torch.einsum("hql,lhd->qhd", scores.softmax(-1), v).cpu()  # (Lq, Hq, D)


# tolerance of a paged attention op against fp64 dense attention, by the op's dtype
ATOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def compare_paged_attention(
    attend,
    seqs,
    device,
    *,
    num_q_heads=4,
    num_kv_heads=2,
    head_dim=32,
    block_size=4,
    dtype=torch.float32,
    pad_rows=0,
    seed=0,
):
    """Paged attention of `seqs` ((seq_len after the step, new tokens) each; defaults: the small GQA case)
    against fp64 dense causal attention. `attend(q, paged, query_start_loc, scale, out)` runs the op under
    test on q (T, Hq, D) and a PagedKv; it must return `out`, written for every sequence's rows, and leave
    the `pad_rows` rows of q past the last sequence untouched."""
    seq_lens = [n for n, _ in seqs]
    q_lens = [m for _, m in seqs]
    paged = PagedKv(seq_lens, num_kv_heads, head_dim, block_size, dtype, device, seed=seed)
    qsl = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0).to(torch.int32)  # (B+1,)
    num_tokens = int(qsl[-1]) + pad_rows
    gen = torch.Generator().manual_seed(seed + 1)
    q = torch.randn(num_tokens, num_q_heads, head_dim, generator=gen).to(dtype).to(device)  # (T, Hq, D)
    scale = head_dim**-0.5
    out = torch.full_like(q, float("nan"))
    result = attend(q, paged, qsl, scale, out)
    assert result is out
    real = int(qsl[-1])
    assert not torch.isnan(out[:real]).any(), "an output element was not written"
    assert torch.isnan(out[real:]).all(), "padding rows must stay untouched"
    for b, (n, m) in enumerate(seqs):
        start = int(qsl[b])
        want = dense_attention(q[start : start + m], paged.keys[b], paged.values[b], scale, first_pos=n - m)
        torch.testing.assert_close(out[start : start + m].double().cpu(), want, atol=ATOL[dtype], rtol=ATOL[dtype])


@pytest.fixture
def compare_with_dense():
    """compare_paged_attention: a paged attention op against fp64 dense attention (the ground truth)."""
    return compare_paged_attention
