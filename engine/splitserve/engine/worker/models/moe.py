"""The sparse MLP of a mixture-of-experts layer: a router and E SwiGLU experts, stacked.

    x (T, H) -> router logits (T, E) -> softmax (float32) -> top k -> [renormalise] -> weights (T, k)
             -> kernels.fused_moe(x, w13 (E, 2F, H), w2 (E, H, F), weights, ids) -> (T, H)

The experts' weights live as two stacked parameters, `experts.gate_up_proj` (E, 2F, H: each expert's gate rows,
then its up rows) and `experts.down_proj` (E, H, F), the layout transformers 5.x keeps in memory; a family's
model class (qwen3_moe.py, mixtral.py) maps its checkpoint's per-expert tensors onto their slices. The routing
numerics follow transformers per family (engine.worker.moe_config). On CUDA the experts run as the fused
Triton kernel (no host sync, so decode steps graph); elsewhere as its torch reference, exact in float64.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from splitserve.engine.worker.model_config import ModelConfig
from splitserve.engine.worker.models.gpt_oss_moe import GptOssMoeBlock
from splitserve.engine.worker.moe_config import MoeConfig


def _param(shape: tuple[int, ...], dtype: torch.dtype, device) -> nn.Parameter:
    """Uninitialised, frozen weight (the loader fills it)."""
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


def route(router_logits: torch.Tensor, moe: MoeConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights (T, k), expert ids (T, k) int64) from router logits (T, E), as transformers computes them:
    softmax in float32, top k, renormalised when the family does, cast to the model dtype when it does
    (kernels.moe_topk: one launch on CUDA, transformers' torch ops elsewhere)."""
    from splitserve.kernels.moe_topk import moe_topk  # lazily: the kernels package imports Triton

    out_dtype = router_logits.dtype if moe.weights_in_model_dtype else torch.float32
    return moe_topk(router_logits, moe.top_k, moe.renormalize, out_dtype)


class SparseMoeBlock(nn.Module):
    """A layer's router (`gate.weight`, (E, H)) and its experts; forward(x (T, H)) -> (T, H)."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, device):
        super().__init__()
        moe = config.moe
        self.moe = moe
        hidden, inter = config.hidden_size, moe.intermediate_size
        self.gate = nn.Module()
        self.gate.weight = _param((moe.num_experts, hidden), dtype, device)
        self.experts = nn.Module()
        self.experts.gate_up_proj = _param((moe.num_experts, 2 * inter, hidden), dtype, device)
        self.experts.down_proj = _param((moe.num_experts, hidden, inter), dtype, device)
        self.experts.gate_up_scale = self.experts.down_scale = None  # (E, 2F), (E, H) once quantized to fp8

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from splitserve.kernels.fused_moe import fused_moe  # lazily: the kernels package imports Triton

        weights, ids = route(F.linear(x, self.gate.weight), self.moe)  # (T, k) each
        experts = self.experts
        return fused_moe(
            x,
            experts.gate_up_proj,
            experts.down_proj,
            weights,
            ids,
            w13_scale=experts.gate_up_scale,
            w2_scale=experts.down_scale,
        )

    def quantize_fp8(self) -> None:
        """The experts' weights to e4m3 with one float32 scale per expert and output row (W8A16: activations
        stay 16-bit); the router stays in the model dtype, as in vLLM's fp8."""
        from splitserve.engine.worker.fp8 import quantize_experts

        quantize_experts(self.experts)

    def expert_targets(self, prefix: str, names: tuple[str, str, str]) -> dict[str, torch.Tensor]:
        """Checkpoint name -> the slice it fills, for per-expert tensors named
        f"{prefix}.{e}.{gate|up|down}.weight" with `names` = (gate, up, down)."""
        inter = self.moe.intermediate_size
        gate_up, down = self.experts.gate_up_proj.data, self.experts.down_proj.data
        targets = {}
        for e in range(self.moe.num_experts):
            targets[f"{prefix}.{e}.{names[0]}.weight"] = gate_up[e, :inter]
            targets[f"{prefix}.{e}.{names[1]}.weight"] = gate_up[e, inter:]
            targets[f"{prefix}.{e}.{names[2]}.weight"] = down[e]
        return targets


def mlp_for_layer(config: ModelConfig, layer_idx: int, dtype: torch.dtype, device) -> nn.Module | None:
    """The sparse MLP of layer `layer_idx` (gpt-oss's where its clamped SwiGLU is configured), or None where the
    layer keeps the dense MLP."""
    if config.moe is None or layer_idx not in config.moe.sparse_layers:
        return None
    if config.moe.clamped_swiglu is not None:
        return GptOssMoeBlock(config, dtype, device)
    return SparseMoeBlock(config, dtype, device)


def replace_expert_targets(
    targets: dict[str, torch.Tensor], layers: nn.ModuleList, block_name: str, expert_names: tuple[str, str, str]
) -> dict[str, torch.Tensor]:
    """`targets` (a decoder's checkpoint_targets) with each sparse layer's stacked parameters replaced by the
    checkpoint's names: f"model.layers.{i}.{block_name}.gate.weight" and per-expert
    f"model.layers.{i}.{block_name}.experts.{e}.{name}.weight", `expert_names` = (gate, up, down)."""
    for i, layer in enumerate(layers):
        if not isinstance(layer.mlp, SparseMoeBlock):
            continue
        ours = f"model.layers.{i}.mlp"
        for leaf in ("gate.weight", "experts.gate_up_proj", "experts.down_proj"):
            del targets[f"{ours}.{leaf}"]
        theirs = f"model.layers.{i}.{block_name}"
        targets[f"{theirs}.gate.weight"] = layer.mlp.gate.weight.data
        targets.update(layer.mlp.expert_targets(f"{theirs}.experts", expert_names))
    return targets
