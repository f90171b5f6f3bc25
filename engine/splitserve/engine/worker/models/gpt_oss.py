"""gpt-oss (`GptOssForCausalLM`): the Llama-family decoder with biases on q/k/v/o, a learned attention sink per
head, sliding-window attention in the layers `layer_types` names so, YaRN rotary, and a mixture of experts in
every layer (models/gpt_oss_moe.py).

Checkpoint names per layer i (besides the decoder's attention and norms):

    model.layers.{i}.self_attn.sinks                          (Hq,) each head's sink logit
    model.layers.{i}.mlp.router.{weight,bias}                 (E, H), (E,)
    model.layers.{i}.mlp.experts.gate_up_proj{,_bias}         (E, H, 2F), (E, 2F); gate/up interleaved
    model.layers.{i}.mlp.experts.down_proj{,_bias}            (E, F, H), (E, H)

Released checkpoints hold the experts' weights in MXFP4 instead (`..._blocks` + `..._scales`); they are
dequantized at load (engine.worker.mxfp4). The experts are stored output-major, as the fused MoE kernel reads
them (models/gpt_oss_moe.py), so the checkpoint's input-major tensors load through transposed views.

On CUDA the fused MoE kernel and the paged decode and prefill attention kernels take gpt-oss's extras (fresh
prompts attend through paged prefill; engine.worker.attention); on CPU their torch references, exact in float64.
"""

from __future__ import annotations

import torch

from splitserve.engine.worker.models.llama import DecoderForCausalLM
from splitserve.engine.worker.tensor_parallel import TpShard


class GptOssForCausalLM(DecoderForCausalLM):
    """The Llama-family decoder with gpt-oss's sinks, sliding layers and biased experts."""

    def checkpoint_targets(self) -> dict[str, torch.Tensor]:
        """The decoder's, with the experts' weights as the transposed views their input-major tensors fill."""
        targets = super().checkpoint_targets()
        for i, layer in enumerate(self.model.layers):
            for leaf, view in layer.mlp.checkpoint_views().items():
                targets[f"model.layers.{i}.mlp.{leaf}"] = view
        return targets

    def mxfp4_targets(self) -> dict[str, torch.Tensor]:
        """MXFP4 checkpoint tensor -> what its dequantized values fill: the experts' weights, output-major in
        both the checkpoint's blocks ((E, 2F, H), (E, H, F)) and our parameters."""
        targets = {}
        for i, layer in enumerate(self.model.layers):
            for name in ("gate_up_proj", "down_proj"):
                targets[f"model.layers.{i}.mlp.experts.{name}"] = getattr(layer.mlp.experts, name).data
        return targets

    def mxfp4_shards(self) -> dict[str, TpShard]:
        """Tensor parallel: MXFP4 checkpoint tensor -> the piece of its dequantized values this rank keeps."""
        if self.tp is None:
            return {}
        shards = {}
        for i, layer in enumerate(self.model.layers):
            for name, shard in layer.mlp.mxfp4_shards().items():
                shards[f"model.layers.{i}.mlp.experts.{name}"] = shard
        return shards

    def is_ignored_checkpoint_tensor(self, name: str) -> bool:
        if self.tp is not None and self.tp.rank > 0 and name.endswith(".mlp.experts.down_proj_bias"):
            return True  # the experts' down bias is added once: rank 0 holds it
        return super().is_ignored_checkpoint_tensor(name)
