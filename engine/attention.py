"""Attention over the paged KV cache, as the model calls it.

The runner builds one `AttentionMetadata` per step; every layer reads it. A step's
tokens are flattened: sequence i owns rows [query_start_loc[i], query_start_loc[i+1])
of q/k/v. Its context after the step is seq_lens[i] tokens, of which the last
q_len_i = query_start_loc[i+1] - query_start_loc[i] are new:

    positions   0 ........................ seq_len-q_len ........ seq_len-1
                |<--- already in cache --->|<---- new this step ---->|
    new token j (position seq_len - q_len + j) attends to positions 0..its own.

`attention_forward` first writes the new keys/values into their slots
(slot_mapping; negative slots are padding and skipped), then attends reading
everything from the cache. On CUDA it dispatches to the Triton kernels in
`kernels/`; elsewhere it runs the torch path below.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class AttentionMetadata:
    """Per-step inputs shared by every attention layer (built only by the model runner)."""

    query_start_loc: torch.Tensor  # (B+1,) int32, cumulative new-token counts
    seq_lens: torch.Tensor  # (B,) int32, context length after this step
    block_tables: torch.Tensor  # (B, max_blocks) int32, unused entries 0
    slot_mapping: torch.Tensor  # (T,) int64, slot of each new token; < 0 = padding
    max_query_len: int
    max_seq_len: int
    # Host copies for the torch path (no device sync needed to read them).
    query_start_loc_cpu: list[int]
    seq_lens_cpu: list[int]

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1


def write_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Scatter new keys/values (T, Hkv, D) into the caches (N, bs, Hkv, D) at their slots."""
    block_size = k_cache.shape[1]
    valid = slot_mapping >= 0
    if not bool(valid.all()):
        key, value, slot_mapping = key[valid], value[valid], slot_mapping[valid]
    blocks = slot_mapping // block_size
    offsets = slot_mapping % block_size
    k_cache[blocks, offsets] = key.to(k_cache.dtype)
    v_cache[blocks, offsets] = value.to(v_cache.dtype)


def _gather_context(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """One sequence's first seq_len cached tokens: (seq_len, Hkv, D)."""
    block_size = cache.shape[1]
    num_blocks = (seq_len + block_size - 1) // block_size
    blocks = cache[block_table[:num_blocks].long()]  # (nb, bs, Hkv, D)
    return blocks.reshape(-1, *cache.shape[2:])[:seq_len]


def attention_torch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Paged causal attention in plain torch: q (T, Hq, D) -> (T, Hq, D)."""
    num_q_heads = q.shape[1]
    num_kv_heads = k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    out = torch.empty_like(q)
    qsl = meta.query_start_loc_cpu
    for i, seq_len in enumerate(meta.seq_lens_cpu):
        start, end = qsl[i], qsl[i + 1]
        q_len = end - start
        if q_len == 0:
            continue
        k = _gather_context(k_cache, meta.block_tables[i], seq_len)  # (L, Hkv, D)
        v = _gather_context(v_cache, meta.block_tables[i], seq_len)
        if group > 1:
            k = k.repeat_interleave(group, dim=1)  # (L, Hq, D)
            v = v.repeat_interleave(group, dim=1)
        qi = q[start:end].transpose(0, 1)  # (Hq, q_len, D)
        ki = k.transpose(0, 1).to(q.dtype)  # (Hq, L, D)
        vi = v.transpose(0, 1).to(q.dtype)
        if q_len == 1:
            mask = None
        else:
            # new token j sits at position seq_len - q_len + j and sees positions <= it
            rows = torch.arange(q_len, device=q.device).unsqueeze(1) + (seq_len - q_len)
            cols = torch.arange(seq_len, device=q.device).unsqueeze(0)
            mask = cols <= rows  # (q_len, L)
        o = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, scale=scale)
        out[start:end] = o.transpose(0, 1)
    return out


def attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Write this step's k/v (T, Hkv, D) into the cache, then attend: q (T, Hq, D) -> (T, Hq, D)."""
    write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    return attention_torch(q, k_cache, v_cache, meta, scale)
