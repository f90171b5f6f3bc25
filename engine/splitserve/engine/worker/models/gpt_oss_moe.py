"""gpt-oss's sparse MLP: a router with a bias, and E experts with biases and a clamped SwiGLU.

    x (T, H) -> logits = x Wr^T + br (T, E) -> top k logits -> softmax over those k (model dtype) -> weights (T, k)
    expert e: gu = x W_gu[e] + b_gu[e] (T, 2F), gate = gu[:, 0::2], up = gu[:, 1::2] (interleaved columns)
              gate <- min(gate, limit); up <- clamp(up, -limit, limit)
              h = (up + 1) * gate * sigmoid(alpha * gate)          (T, F)
              y = h W_d[e] + b_d[e]                                (T, H)

The weights keep the checkpoint's (and transformers') layout, input-major: `experts.gate_up_proj` (E, H, 2F) with
gate and up interleaved in its columns, `experts.down_proj` (E, F, H); the biases (E, 2F) and (E, H). The forward
is transformers' per-expert loop in plain torch (exact in float64): the fused Triton MoE kernel has no expert
biases or clamped activation, so this block runs on CPU only (models/gpt_oss.py refuses other devices).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from splitserve.engine.worker.model_config import ModelConfig


def _param(shape: tuple[int, ...], dtype: torch.dtype, device) -> nn.Parameter:
    """Uninitialised, frozen weight (the loader fills it)."""
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


def route_topk_softmax(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights (T, k) in the logits' dtype, ids (T, k)): the top k logits, then a softmax over them."""
    top, ids = torch.topk(logits, top_k, dim=-1)
    return F.softmax(top, dim=-1, dtype=top.dtype), ids


def clamped_swiglu(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """(T, 2F) interleaved [g0, u0, g1, u1, ...] -> (up + 1) * gate * sigmoid(alpha * gate), both clamped."""
    gate = gate_up[..., ::2].clamp(max=limit)
    up = gate_up[..., 1::2].clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


class GptOssMoeBlock(nn.Module):
    """A layer's `router` (weight (E, H), bias (E,)) and `experts`; forward(x (T, H)) -> (T, H)."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, device):
        super().__init__()
        moe = config.moe
        self.top_k = moe.top_k
        self.alpha, self.limit = moe.clamped_swiglu
        num_experts, hidden, inter = moe.num_experts, config.hidden_size, moe.intermediate_size
        self.router = nn.Module()
        self.router.weight = _param((num_experts, hidden), dtype, device)
        self.router.bias = _param((num_experts,), dtype, device)
        self.experts = nn.Module()
        self.experts.gate_up_proj = _param((num_experts, hidden, 2 * inter), dtype, device)
        self.experts.gate_up_proj_bias = _param((num_experts, 2 * inter), dtype, device)
        self.experts.down_proj = _param((num_experts, inter, hidden), dtype, device)
        self.experts.down_proj_bias = _param((num_experts, hidden), dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = route_topk_softmax(F.linear(x, self.router.weight, self.router.bias), self.top_k)  # (T, k)
        experts = self.experts
        out = torch.zeros_like(x)  # (T, H)
        # experts in increasing order, each adding into its tokens' rows: transformers' order of the sums
        for expert in torch.unique(ids).tolist():
            tokens, slot = torch.where(ids == expert)  # (n,) each
            gate_up = x[tokens] @ experts.gate_up_proj[expert] + experts.gate_up_proj_bias[expert]  # (n, 2F)
            y = clamped_swiglu(gate_up, self.alpha, self.limit) @ experts.down_proj[expert]  # (n, H)
            y = (y + experts.down_proj_bias[expert]) * weights[tokens, slot, None]
            out.index_add_(0, tokens, y.to(x.dtype))
        return out
