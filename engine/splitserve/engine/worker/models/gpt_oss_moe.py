"""gpt-oss's sparse MLP: a router with a bias, and E experts with biases and a clamped SwiGLU.

    x (T, H) -> logits = x Wr^T + br (T, E) -> top k logits -> softmax over those k (model dtype) -> weights (T, k)
    expert e: gu = x W_gu[e] + b_gu[e] (T, 2F), gate = gu[:, 0::2], up = gu[:, 1::2] (interleaved columns)
              gate <- min(gate, limit); up <- clamp(up, -limit, limit)
              h = (up + 1) * gate * sigmoid(alpha * gate)          (T, F)
              y = h W_d[e] + b_d[e]                                (T, H)

The experts run as `kernels.fused_moe` with its gpt-oss options (biases, the clamped SwiGLU, interleaved rows):
its torch reference on CPU, exact in float64. `--quantization fp8` makes both experts' weights e4m3 with a scale
per expert and output row (W8A16; the router and the biases stay in the model dtype).
The weights are stored as the kernel reads them, output-major:
`experts.gate_up_proj` (E, 2F, H) with rows g0, u0, g1, u1, ... and `experts.down_proj` (E, H, F); the biases
(E, 2F), same order, and (E, H). The checkpoint's tensors are input-major ((E, H, 2F), (E, F, H)): they load
through transposed views (models/gpt_oss.py), and its MXFP4 blocks, output-major, load straight in.

Tensor parallel (N ranks): rank r holds intermediate rows [r F/N, (r+1) F/N) of every expert, which are the
interleaved rows [2 r F/N, 2 (r+1) F/N) of gate_up (one contiguous run) with their biases, and those columns of
down. The clamped SwiGLU is elementwise per (gate, up) pair, so each rank's h is exact; down's bias is added on
rank 0 only, and the all-reduce after the block sums the ranks' weighted shares:

    sum_r sum_e w_e (h_e[rows_r] W_d[e][:, rows_r] + [r == 0] b_d[e]) = sum_e w_e (h_e W_d[e] + b_d[e])
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from splitserve.engine.worker.model_config import ModelConfig
from splitserve.engine.worker.tensor_parallel import TpGroup, TpShard


def _param(shape: tuple[int, ...], dtype: torch.dtype, device) -> nn.Parameter:
    """Uninitialised, frozen weight (the loader fills it)."""
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


def route_topk_softmax(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights (T, k) in the logits' dtype, ids (T, k)): the top k logits, then a softmax over them."""
    top, ids = torch.topk(logits, top_k, dim=-1)
    return F.softmax(top, dim=-1, dtype=top.dtype), ids


class GptOssMoeBlock(nn.Module):
    """A layer's `router` (weight (E, H), bias (E,)) and `experts`; forward(x (T, H)) -> (T, H). Under tensor
    parallelism F/N rows of every expert (module docstring); `experts.down_proj_bias` only on rank 0."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, device, tp: TpGroup | None = None):
        super().__init__()
        moe = config.moe
        self.top_k = moe.top_k
        self.alpha, self.limit = moe.clamped_swiglu
        self.tp = tp if tp is not None and tp.size > 1 else None
        rank, size = (tp.rank, tp.size) if self.tp is not None else (0, 1)
        num_experts, hidden, inter = moe.num_experts, config.hidden_size, moe.intermediate_size // size
        self.row_start = rank * inter
        self.router = nn.Module()
        self.router.weight = _param((num_experts, hidden), dtype, device)
        self.router.bias = _param((num_experts,), dtype, device)
        self.experts = nn.Module()
        self.experts.gate_up_proj = _param((num_experts, 2 * inter, hidden), dtype, device)
        self.experts.gate_up_proj_bias = _param((num_experts, 2 * inter), dtype, device)
        self.experts.down_proj = _param((num_experts, hidden, inter), dtype, device)
        self.experts.down_proj_bias = _param((num_experts, hidden), dtype, device) if rank == 0 else None
        self.experts.gate_up_scale = self.experts.down_scale = None  # (E, 2F), (E, H) once quantized to fp8

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from splitserve.kernels.fused_moe import fused_moe  # lazily: the kernels package imports Triton

        weights, ids = route_topk_softmax(F.linear(x, self.router.weight, self.router.bias), self.top_k)  # (T, k)
        experts = self.experts
        out = fused_moe(
            x,
            experts.gate_up_proj,
            experts.down_proj,
            weights,
            ids,
            w13_scale=experts.gate_up_scale,
            w2_scale=experts.down_scale,
            w13_bias=experts.gate_up_proj_bias,
            w2_bias=experts.down_proj_bias,
            clamped_swiglu=(self.alpha, self.limit),
            interleaved=True,
        )  # (T, H): this rank's rows' share under tensor parallelism
        return out if self.tp is None else self.tp.all_reduce(out)

    def quantize_fp8(self) -> None:
        """The experts' weights to e4m3 (engine.worker.fp8.quantize_experts: rows in their interleaved order, each
        with its scale; under tensor parallelism a down row's scale is the whole row's); the router and the biases
        stay in the model dtype, as in vLLM's fp8."""
        from splitserve.engine.worker.fp8 import quantize_experts

        quantize_experts(self.experts, self.tp.all_reduce_max if self.tp is not None else None)

    def checkpoint_views(self) -> dict[str, torch.Tensor]:
        """Leaf name -> the view of our parameter that the checkpoint's (input-major) tensor fills."""
        experts = self.experts
        return {
            "experts.gate_up_proj": experts.gate_up_proj.data.transpose(1, 2),  # (E, H, 2F)
            "experts.down_proj": experts.down_proj.data.transpose(1, 2),  # (E, F, H)
        }

    def checkpoint_shards(self, prefix: str) -> dict[str, TpShard]:
        """The pieces of the checkpoint's (input-major) expert tensors this rank reads (the router: whole)."""
        inter = self.experts.down_proj.shape[2]
        rows = TpShard(2, 2 * self.row_start, 2 * inter)  # interleaved gate/up columns of (E, H, 2F)
        return {
            f"{prefix}.experts.gate_up_proj": rows,
            f"{prefix}.experts.gate_up_proj_bias": TpShard(1, rows.start, rows.size),  # (E, 2F)
            f"{prefix}.experts.down_proj": TpShard(1, self.row_start, inter),  # (E, F, H)
        }

    def mxfp4_shards(self) -> dict[str, TpShard]:
        """Leaf -> the piece of an MXFP4 tensor's dequantized (output-major) values this rank keeps."""
        inter = self.experts.down_proj.shape[2]
        return {
            "gate_up_proj": TpShard(1, 2 * self.row_start, 2 * inter),
            "down_proj": TpShard(2, self.row_start, inter),
        }
