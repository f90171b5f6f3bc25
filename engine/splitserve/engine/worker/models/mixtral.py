"""Mixtral (`MixtralForCausalLM`): the Mistral decoder with a mixture of experts in every layer (models/moe.py).

Checkpoint names per layer i:

    model.layers.{i}.block_sparse_moe.gate.weight                  router (E, H)
    model.layers.{i}.block_sparse_moe.experts.{e}.w1.weight        expert e's gate (F, H)
    model.layers.{i}.block_sparse_moe.experts.{e}.w3.weight        its up (F, H)
    model.layers.{i}.block_sparse_moe.experts.{e}.w2.weight        its down (H, F)
"""

from __future__ import annotations

import torch

from splitserve.engine.worker.models.llama import DecoderForCausalLM
from splitserve.engine.worker.models.moe import replace_expert_shards, replace_expert_targets
from splitserve.engine.worker.tensor_parallel import TpShard


class MixtralForCausalLM(DecoderForCausalLM):
    """The Llama-family decoder with a sparse MLP in every layer (Mixtral's checkpoint names)."""

    def checkpoint_targets(self) -> dict[str, torch.Tensor]:
        return replace_expert_targets(
            super().checkpoint_targets(), self.model.layers, "block_sparse_moe", ("w1", "w3", "w2")
        )

    def checkpoint_shards(self) -> dict[str, TpShard]:
        return replace_expert_shards(
            super().checkpoint_shards(), self.model.layers, "block_sparse_moe", ("w1", "w3", "w2")
        )
