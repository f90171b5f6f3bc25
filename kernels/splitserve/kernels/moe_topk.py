"""A mixture of experts' routing in one launch: softmax over the experts in float32, the top k, optionally
renormalised to sum to one, in the weights' dtype.

    logits (T, E) -> weights (T, k) out_dtype, ids (T, k) int64

The torch reference is the sequence transformers runs (softmax, topk, divide, cast: five launches on a GPU);
the kernel does it per row in registers, picking the k largest by repeated max (ties to the lower expert id).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from splitserve.kernels._common import next_pow2, use_triton

OP = "moe_topk"
_ROWS = 4  # rows a program routes


def moe_topk_ref(
    logits: torch.Tensor, top_k: int, renormalize: bool, out_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)  # (T, E)
    weights, ids = torch.topk(probs, top_k, dim=-1)  # (T, k) each
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(out_dtype), ids


def moe_topk(
    logits: torch.Tensor, top_k: int, renormalize: bool, out_dtype: torch.dtype, *, impl: str = "auto"
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights (T, k) in `out_dtype`, expert ids (T, k) int64) of router logits (T, E)."""
    num_tokens, num_experts = logits.shape
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"{OP}: top_k {top_k} must be in [1, {num_experts}] (the number of experts)")
    if not use_triton(impl, logits, OP):
        return moe_topk_ref(logits, top_k, renormalize, out_dtype)
    logits = logits.contiguous()
    weights = torch.empty(num_tokens, top_k, dtype=out_dtype, device=logits.device)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int64, device=logits.device)
    grid = (triton.cdiv(num_tokens, _ROWS),)
    _moe_topk_kernel[grid](
        logits,
        weights,
        ids,
        num_tokens,
        E=num_experts,
        TOP_K=top_k,
        BLOCK_E=next_pow2(num_experts),
        BLOCK_K=next_pow2(top_k),
        ROWS=_ROWS,
        RENORMALIZE=renormalize,
    )
    return weights, ids


@triton.jit
def _moe_topk_kernel(
    logits_ptr, weights_ptr, ids_ptr, num_tokens, E: tl.constexpr, TOP_K: tl.constexpr, BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr, ROWS: tl.constexpr, RENORMALIZE: tl.constexpr,
):  # fmt: skip
    experts = tl.arange(0, BLOCK_E)
    slots = tl.arange(0, BLOCK_K)
    for r in range(ROWS):
        row = tl.program_id(0) * ROWS + r
        if row < num_tokens:
            x = tl.load(logits_ptr + row * E + experts, mask=experts < E, other=-float("inf")).to(tl.float32)
            p = tl.exp(x - tl.max(x, 0))
            p = p / tl.sum(p, 0)  # softmax in float32
            p = tl.where(experts < E, p, -1.0)  # padding lanes are never picked
            picked = tl.zeros([BLOCK_K], dtype=tl.float32)
            picked_ids = tl.zeros([BLOCK_K], dtype=tl.int32)
            for j in range(TOP_K):  # the largest left, its lowest id, then drop it
                best = tl.max(p, 0)
                best_id = tl.min(tl.where(p == best, experts, BLOCK_E), 0)
                picked = tl.where(slots == j, best, picked)
                picked_ids = tl.where(slots == j, best_id, picked_ids)
                p = tl.where(experts == best_id, -1.0, p)
            if RENORMALIZE:
                picked = picked / tl.sum(picked, 0)
            out = row * TOP_K + slots
            tl.store(weights_ptr + out, picked.to(weights_ptr.dtype.element_ty), mask=slots < TOP_K)
            tl.store(ids_ptr + out, picked_ids.to(tl.int64), mask=slots < TOP_K)
