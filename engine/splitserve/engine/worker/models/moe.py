"""The sparse MLP of a mixture-of-experts layer: a router and E SwiGLU experts, stacked.

    x (T, H) -> router logits (T, E) -> softmax (float32) -> top k -> [renormalise] -> weights (T, k)
             -> kernels.fused_moe(x, w13 (E, 2F, H), w2 (E, H, F), weights, ids) -> (T, H)

The experts' weights live as two stacked parameters, `experts.gate_up_proj` (E, 2F, H: each expert's gate rows,
then its up rows) and `experts.down_proj` (E, H, F), the layout transformers 5.x keeps in memory; a family's
model class (qwen3_moe.py, mixtral.py) maps its checkpoint's per-expert tensors onto their slices. The routing
numerics follow transformers per family (engine.worker.moe_config). On CUDA the experts run as the fused
Triton kernel (no host sync, so decode steps graph); elsewhere as its torch reference, exact in float64.

Tensor parallel (N ranks): every rank holds every expert, and rows [r F/N, (r+1) F/N) of each expert's
intermediate dimension: its gate and up rows (column-parallel) and the matching columns of down (row-parallel).
The router is replicated, so every rank routes its tokens alike; each rank's output is its share of every
chosen expert's down projection, weighted, and one all-reduce after the block sums them (as MLP does).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from splitserve.engine.worker.model_config import ModelConfig
from splitserve.engine.worker.models.gpt_oss_moe import GptOssMoeBlock
from splitserve.engine.worker.moe_config import MoeConfig
from splitserve.engine.worker.tensor_parallel import TpGroup, TpShard


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


def expert_rows(moe: MoeConfig, tp: TpGroup | None) -> tuple[int, int]:
    """(first row, rows) of each expert's intermediate dimension that a rank holds (all of it without `tp`)."""
    if tp is None or tp.size == 1:
        return 0, moe.intermediate_size
    rows = moe.intermediate_size // tp.size
    return tp.rank * rows, rows


class SparseMoeBlock(nn.Module):
    """A layer's router (`gate.weight`, (E, H)) and its experts; forward(x (T, H)) -> (T, H). Under tensor
    parallelism, F/N rows of every expert (module docstring), summed over ranks after the block."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, device, tp: TpGroup | None = None):
        super().__init__()
        moe = config.moe
        self.moe = moe
        self.tp = tp if tp is not None and tp.size > 1 else None
        self.row_start, inter = expert_rows(moe, tp)
        hidden = config.hidden_size
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
        out = fused_moe(
            x,
            experts.gate_up_proj,
            experts.down_proj,
            weights,
            ids,
            w13_scale=experts.gate_up_scale,
            w2_scale=experts.down_scale,
        )  # (T, H): this rank's rows' share under tensor parallelism
        return out if self.tp is None else self.tp.all_reduce(out)

    def quantize_fp8(self) -> None:
        """The experts' weights to e4m3 with one float32 scale per expert and output row (W8A16: activations
        stay 16-bit); the router stays in the model dtype, as in vLLM's fp8. Under tensor parallelism a down
        row's scale is the whole row's (its columns are split over the ranks), so every rank holds the unsharded
        block's e4m3 values and scales."""
        from splitserve.engine.worker.fp8 import quantize_experts

        quantize_experts(self.experts, self.tp.all_reduce_max if self.tp is not None else None)

    def expert_targets(self, prefix: str, names: tuple[str, str, str]) -> dict[str, torch.Tensor]:
        """Checkpoint name -> the slice it fills, for per-expert tensors named
        f"{prefix}.{e}.{gate|up|down}.weight" with `names` = (gate, up, down)."""
        inter = self.experts.down_proj.shape[2]  # this rank's rows
        gate_up, down = self.experts.gate_up_proj.data, self.experts.down_proj.data
        targets = {}
        for e in range(self.moe.num_experts):
            targets[f"{prefix}.{e}.{names[0]}.weight"] = gate_up[e, :inter]
            targets[f"{prefix}.{e}.{names[1]}.weight"] = gate_up[e, inter:]
            targets[f"{prefix}.{e}.{names[2]}.weight"] = down[e]
        return targets

    def expert_shards(self, prefix: str, names: tuple[str, str, str]) -> dict[str, TpShard]:
        """Checkpoint name -> the rows (gate, up) or columns (down) of each per-expert tensor this rank reads."""
        rows = TpShard(0, self.row_start, self.experts.down_proj.shape[2])
        shards = {}
        for e in range(self.moe.num_experts):
            shards[f"{prefix}.{e}.{names[0]}.weight"] = shards[f"{prefix}.{e}.{names[1]}.weight"] = rows
            shards[f"{prefix}.{e}.{names[2]}.weight"] = TpShard(1, rows.start, rows.size)
        return shards

    def checkpoint_shards(self, prefix: str) -> dict[str, TpShard]:
        """None of our own names: the family names the experts' tensors (`replace_expert_shards`)."""
        return {}


def mlp_for_layer(
    config: ModelConfig, layer_idx: int, dtype: torch.dtype, device, tp: TpGroup | None = None
) -> nn.Module | None:
    """The sparse MLP of layer `layer_idx` (gpt-oss's where its clamped SwiGLU is configured), or None where the
    layer keeps the dense MLP."""
    if config.moe is None or layer_idx not in config.moe.sparse_layers:
        return None
    if config.moe.clamped_swiglu is not None:
        return GptOssMoeBlock(config, dtype, device, tp)
    return SparseMoeBlock(config, dtype, device, tp)


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


def replace_expert_shards(
    shards: dict[str, TpShard], layers: nn.ModuleList, block_name: str, expert_names: tuple[str, str, str]
) -> dict[str, TpShard]:
    """`shards` (a decoder's checkpoint_shards) with each sparse layer's per-expert tensors, under the
    checkpoint's names as in `replace_expert_targets`; the router is read whole (replicated)."""
    for i, layer in enumerate(layers):
        if isinstance(layer.mlp, SparseMoeBlock):
            shards.update(layer.mlp.expert_shards(f"model.layers.{i}.{block_name}.experts", expert_names))
    return shards
