"""Qwen3-MoE (`Qwen3MoeForCausalLM`): the Qwen3 decoder (q/k norm) with sparse MLPs (models/moe.py).

Checkpoint names per sparse layer i (dense layers, per `mlp_only_layers` / `decoder_sparse_step`, keep Qwen3's):

    model.layers.{i}.mlp.gate.weight                               router (E, H)
    model.layers.{i}.mlp.experts.{e}.{gate,up,down}_proj.weight    expert e's SwiGLU
"""

from __future__ import annotations

import torch

from splitserve.engine.worker.models.llama import DecoderForCausalLM
from splitserve.engine.worker.models.moe import replace_expert_shards, replace_expert_targets
from splitserve.engine.worker.tensor_parallel import TpShard


class Qwen3MoeForCausalLM(DecoderForCausalLM):
    """The Llama-family decoder whose sparse layers hold a mixture of experts (Qwen3-MoE's checkpoint names)."""

    def checkpoint_targets(self) -> dict[str, torch.Tensor]:
        return replace_expert_targets(
            super().checkpoint_targets(), self.model.layers, "mlp", ("gate_proj", "up_proj", "down_proj")
        )

    def checkpoint_shards(self) -> dict[str, TpShard]:
        return replace_expert_shards(
            super().checkpoint_shards(), self.model.layers, "mlp", ("gate_proj", "up_proj", "down_proj")
        )
