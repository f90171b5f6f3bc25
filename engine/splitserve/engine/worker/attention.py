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
`kernels/`; elsewhere it runs the torch path below. gpt-oss's sinks and sliding windows: on CUDA the paged
decode and paged prefill kernels take them (a fresh prompt goes through paged prefill: the fresh-prompt
kernel takes neither); elsewhere `attention_sinks_window_torch`. Both are per-layer constants, so a decode
step with them still captures into a CUDA graph.

An fp8 cache holds k / k_scale and v / v_scale (per-layer scales): the write divides, and the
readers fold the scales in instead of multiplying every element back:
q . (k_scale k_c) = (scale k_scale) q . k_c, and sum p (v_scale v_c) = v_scale sum p v_c.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from splitserve.engine.worker.layers import cpu_ops_for


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


FP8_MAX = 448.0  # largest finite float8_e4m3fn


def _to_cache(x: torch.Tensor, cache: torch.Tensor, scale: float) -> torch.Tensor:
    """x in the cache's dtype: an fp8 cache stores clamp(x / scale) (e4m3 casts do not saturate)."""
    if cache.dtype != torch.float8_e4m3fn:
        return x.to(cache.dtype)
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(cache.dtype)


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Scatter new keys/values (T, Hkv, D) into the caches (N, bs, Hkv, D) at their slots."""
    block_size = k_cache.shape[1]
    valid = slot_mapping >= 0
    if not bool(valid.all()):
        key, value, slot_mapping = key[valid], value[valid], slot_mapping[valid]
    blocks = slot_mapping // block_size
    offsets = slot_mapping % block_size
    k_cache[blocks, offsets] = _to_cache(key, k_cache, k_scale)
    v_cache[blocks, offsets] = _to_cache(value, v_cache, v_scale)


def _gather_context(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """One sequence's first seq_len cached tokens: (seq_len, Hkv, D)."""
    block_size = cache.shape[1]
    num_blocks = (seq_len + block_size - 1) // block_size
    blocks = cache[block_table[:num_blocks].long()]  # (nb, bs, Hkv, D)
    return blocks.reshape(-1, *cache.shape[2:])[:seq_len]


@dataclass
class _HostPlan:
    """How the torch path splits a step (computed once per step, shared by all layers)."""

    decode_groups: list[tuple[torch.Tensor, torch.Tensor, int]]  # (rows, seq_lens, max_len) per group
    prefills: list[tuple[int, int, int, int]]  # (seq index, start row, end row, seq_len)
    decode_seqs: torch.Tensor | None  # every one-token sequence's index, for the CPU op (None: no decodes)


DECODE_GROUP_SIZE = 16  # decode rows sorted by length, batched in groups to bound padding


def _plan(meta: AttentionMetadata) -> _HostPlan:
    plan = getattr(meta, "_host_plan", None)
    if plan is not None:
        return plan
    qsl, lens = meta.query_start_loc_cpu, meta.seq_lens_cpu
    decodes = sorted((lens[i], i) for i in range(len(lens)) if qsl[i + 1] - qsl[i] == 1)
    prefills = [(i, qsl[i], qsl[i + 1], lens[i]) for i in range(len(lens)) if qsl[i + 1] - qsl[i] > 1]
    device = meta.seq_lens.device
    groups = []
    for g in range(0, len(decodes), DECODE_GROUP_SIZE):
        chunk = decodes[g : g + DECODE_GROUP_SIZE]
        seqs = [i for _, i in chunk]
        groups.append(
            (torch.tensor(seqs, device=device), torch.tensor([n for n, _ in chunk], device=device), chunk[-1][0])
        )
    decode_seqs = torch.tensor([i for _, i in decodes], device=device) if decodes else None
    plan = _HostPlan(groups, prefills, decode_seqs)
    meta._host_plan = plan
    return plan


def _decode_group(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    rows: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    max_len: int,
    scale: float,
) -> torch.Tensor:
    """Batched one-token attention for the sequences `rows`: q (G, Hq, D) -> (G, Hq, D)."""
    block_size, num_kv_heads, head_dim = k_cache.shape[1:]
    num_blocks = (max_len + block_size - 1) // block_size
    flat = block_tables[rows, :num_blocks].reshape(-1).long()  # (G*nb,)
    # index_select copies whole blocks; advanced indexing on the strided view is ~10x slower
    k = torch.index_select(k_cache, 0, flat).view(len(rows), -1, num_kv_heads, head_dim)  # (G, L, Hkv, D)
    v = torch.index_select(v_cache, 0, flat).view(len(rows), -1, num_kv_heads, head_dim)
    visible = torch.arange(k.shape[1], device=q.device).unsqueeze(0) < seq_lens.unsqueeze(1)  # (G, L)
    out = F.scaled_dot_product_attention(
        q.unsqueeze(2),
        k.transpose(1, 2).to(q.dtype),
        v.transpose(1, 2).to(q.dtype),  # (G, H, 1|L, D)
        attn_mask=visible[:, None, None, :],
        scale=scale,
        enable_gqa=q.shape[1] != num_kv_heads,
    )
    return out.squeeze(2)  # (G, Hq, D)


def attention_torch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    k_new: torch.Tensor | None = None,
    v_new: torch.Tensor | None = None,
) -> torch.Tensor:
    """Paged causal attention in plain torch: q (T, Hq, D) -> (T, Hq, D).

    One-token (decode) sequences run batched, in groups of similar length; multi-token
    sequences run one SDPA each, reading the new keys directly when nothing is cached yet.
    """
    num_kv_heads = k_cache.shape[2]
    gqa = q.shape[1] != num_kv_heads
    # the C++ decode attention, when built (it reads caches of q's dtype only)
    op = cpu_ops_for(q, (torch.float32, torch.float64)) if k_cache.dtype == q.dtype else None
    if meta.is_decode_only and op is not None:
        return op.paged_decode_attention_cpu(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, scale)
    out = torch.empty_like(q)
    plan = _plan(meta)
    qsl = meta.query_start_loc
    if op is not None and plan.decode_seqs is not None:  # a mixed step's one-token rows, in one call
        seqs = plan.decode_seqs
        rows = qsl[seqs].long()
        out[rows] = op.paged_decode_attention_cpu(
            q[rows], k_cache, v_cache, meta.block_tables[seqs], meta.seq_lens[seqs], scale
        )
    else:
        for rows, seq_lens, max_len in plan.decode_groups:
            token_rows = qsl[rows].long()
            out[token_rows] = _decode_group(
                q[token_rows], k_cache, v_cache, rows, meta.block_tables, seq_lens, max_len, scale
            )
    for i, start, end, seq_len in plan.prefills:
        q_len = end - start
        if seq_len == q_len and k_new is not None:
            k, v = k_new[start:end], v_new[start:end]  # fresh prompt: its keys are the new ones
        else:
            k = _gather_context(k_cache, meta.block_tables[i], seq_len)  # (L, Hkv, D)
            v = _gather_context(v_cache, meta.block_tables[i], seq_len)
        # 4-D (1, H, L, D): torch's CPU flash kernel takes only 4-D inputs; 3-D ones fall back to
        # the math path, 2.5-4x slower at prompt lengths of 100-512
        qi = q[start:end].transpose(0, 1).unsqueeze(0)  # (1, Hq, q_len, D)
        ki = k.transpose(0, 1).to(q.dtype).unsqueeze(0)  # (1, Hkv, L, D)
        vi = v.transpose(0, 1).to(q.dtype).unsqueeze(0)
        if seq_len == q_len:
            o = F.scaled_dot_product_attention(qi, ki, vi, is_causal=True, scale=scale, enable_gqa=gqa)
        else:
            # new token j sits at position seq_len - q_len + j and sees positions <= it
            rows_pos = torch.arange(q_len, device=q.device).unsqueeze(1) + (seq_len - q_len)
            cols = torch.arange(seq_len, device=q.device).unsqueeze(0)
            o = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=cols <= rows_pos, scale=scale, enable_gqa=gqa)
        out[start:end] = o[0].transpose(0, 1)
    return out


def attention_sinks_window_torch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sinks: torch.Tensor | None,
    sliding_window: int | None,
) -> torch.Tensor:
    """Paged causal attention with gpt-oss's extras, one sequence at a time: q (T, Hq, D) -> (T, Hq, D).

    `sinks` (Hq,): each head's learned logit, one more term of the softmax's denominator that weighs no value.
    `sliding_window` W: the token at position p sees positions p - W + 1 .. p only. The softmax is
    transformers' eager one (max subtracted over the keys and the sink), so float64 matches it.
    """
    out = torch.empty_like(q)
    num_heads, num_kv_heads = q.shape[1], k_cache.shape[2]
    qsl, lens = meta.query_start_loc_cpu, meta.seq_lens_cpu
    for i, seq_len in enumerate(lens):
        start, end = qsl[i], qsl[i + 1]
        if end == start:
            continue
        k = _gather_context(k_cache, meta.block_tables[i], seq_len).to(q.dtype)  # (L, Hkv, D)
        v = _gather_context(v_cache, meta.block_tables[i], seq_len).to(q.dtype)
        k = k.repeat_interleave(num_heads // num_kv_heads, dim=1).transpose(0, 1)  # (Hq, L, D)
        v = v.repeat_interleave(num_heads // num_kv_heads, dim=1).transpose(0, 1)
        logits = torch.matmul(q[start:end].transpose(0, 1), k.transpose(1, 2)) * scale  # (Hq, q_len, L)
        rows = torch.arange(end - start, device=q.device).unsqueeze(1) + (seq_len - (end - start))  # positions
        cols = torch.arange(seq_len, device=q.device).unsqueeze(0)
        visible = cols <= rows
        if sliding_window is not None:
            visible &= cols > rows - sliding_window
        logits = logits.masked_fill(~visible, float("-inf"))
        if sinks is not None:
            sink = sinks.to(q.dtype).view(num_heads, 1, 1).expand(num_heads, end - start, 1)
            logits = torch.cat((logits, sink), dim=-1)  # (Hq, q_len, L + 1)
        logits = logits - logits.amax(dim=-1, keepdim=True)
        probs = torch.softmax(logits, dim=-1)[..., :seq_len]  # the sink's share weighs no value
        out[start:end] = torch.matmul(probs, v).transpose(0, 1)  # (q_len, Hq, D)
    return out


def attention_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    sinks: torch.Tensor | None = None,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Write this step's k/v (T, Hkv, D) into the cache, then attend: q (T, Hq, D) -> (T, Hq, D).

    k_scale / v_scale: what an fp8 cache's values are multiplied by to be keys / values (1.0 else).
    sinks (Hq,) / sliding_window: gpt-oss's (attention_sinks_window_torch says what they mean)."""
    extras = sinks is not None or sliding_window is not None
    if q.is_cuda:
        scales = (k_scale, v_scale)
        out = _attention_cuda(q, k, v, k_cache, v_cache, meta, scale, scales, sinks, sliding_window)
    elif extras:
        write_kv(k, v, k_cache, v_cache, meta.slot_mapping, k_scale, v_scale)
        out = attention_sinks_window_torch(q, k_cache, v_cache, meta, scale * k_scale, sinks, sliding_window)
    else:
        ops = cpu_ops_for(k) if k_cache.dtype == k.dtype else None
        if ops is not None:
            ops.write_kv_cpu(k, v, k_cache, v_cache, meta.slot_mapping)
        else:
            write_kv(k, v, k_cache, v_cache, meta.slot_mapping, k_scale, v_scale)
        fresh = k_cache.dtype == k.dtype  # an fp8 cache's prompts attend over the stored (quantized) keys
        out = attention_torch(q, k_cache, v_cache, meta, scale * k_scale, k if fresh else None, v if fresh else None)
    return out if v_scale == 1.0 else out.mul_(v_scale)


def _attention_cuda(q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale, scales, sinks, window):
    """The Triton kernels: KV write (k / k_scale, v / v_scale of `scales`), then paged decode (all one-token) or
    paged prefill attention; the caller multiplies the output by v_scale."""
    from splitserve import kernels

    k_scale, v_scale = scales
    kernels.write_kv(k, v, k_cache, v_cache, meta.slot_mapping, k_scale=k_scale, v_scale=v_scale)
    return paged_attention_cuda(q, k_cache, v_cache, meta, scale * k_scale, sinks=sinks, sliding_window=window)


def all_fresh(meta: AttentionMetadata) -> bool:
    """No sequence of the step has cached tokens (each one's context is its new tokens); once per step."""
    fresh = getattr(meta, "_all_fresh", None)
    if fresh is None:
        qsl = meta.query_start_loc_cpu
        fresh = all(qsl[i + 1] - qsl[i] == n for i, n in enumerate(meta.seq_lens_cpu))
        meta._all_fresh = fresh
    return fresh


def paged_attention_cuda(
    q, k_cache, v_cache, meta: AttentionMetadata, scale: float, k_new=None, v_new=None, sinks=None,
    sliding_window=None,
):  # fmt: skip
    """Attention over keys/values already in the cache (Triton): paged decode when every sequence has
    one new token; when none has cached tokens and the step's own k_new/v_new (T, Hkv, D) are given,
    the fresh-prompt kernel reading those (TMA); else paged prefill. q (T, Hq, D) -> (T, Hq, D).
    sinks / sliding_window (attention_sinks_window_torch): paged decode or paged prefill, never the fresh kernel."""
    from splitserve import kernels

    extras = dict(sinks=sinks, sliding_window=sliding_window)
    plain = sinks is None and sliding_window is None
    if plain and not meta.is_decode_only and k_new is not None and all_fresh(meta):
        from splitserve.kernels.fresh_prefill_attention import fresh_prefill_attention, fresh_supported

        if fresh_supported(q, k_new, v_new):
            return fresh_prefill_attention(q, k_new, v_new, meta.query_start_loc, meta.max_query_len, scale)
    if meta.is_decode_only:
        return kernels.paged_decode_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, scale, **extras)
    return kernels.paged_prefill_attention(
        q, k_cache, v_cache, meta.block_tables, meta.query_start_loc, meta.seq_lens, meta.max_query_len, scale,
        **extras,
    )  # fmt: skip
