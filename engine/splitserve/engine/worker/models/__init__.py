"""Model registry: `config.architectures[0]` -> the nn.Module class that implements it.

Every supported architecture is the one Llama-family decoder; the differences are config
flags (`engine.worker.model_config.ARCH_TRAITS`). Adding an architecture is one entry in each.
The mixture-of-experts families subclass it only to name their checkpoints' expert tensors (gpt-oss also
to refuse devices other than the CPU).
"""

from __future__ import annotations

from torch import nn

from splitserve.engine.worker.model_config import ARCH_TRAITS, ModelConfig, unsupported_architecture
from splitserve.engine.worker.models.gpt_oss import GptOssForCausalLM
from splitserve.engine.worker.models.llama import DecoderForCausalLM
from splitserve.engine.worker.models.mixtral import MixtralForCausalLM
from splitserve.engine.worker.models.qwen3_moe import Qwen3MoeForCausalLM

MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": DecoderForCausalLM,
    "MistralForCausalLM": DecoderForCausalLM,
    "Qwen2ForCausalLM": DecoderForCausalLM,
    "Qwen3ForCausalLM": DecoderForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "GptOssForCausalLM": GptOssForCausalLM,
}
assert set(MODEL_REGISTRY) == set(ARCH_TRAITS), "registry and ARCH_TRAITS must name the same architectures"


def model_class(config: ModelConfig) -> type[nn.Module]:
    """The class implementing `config.architecture` (ValueError naming the supported list)."""
    try:
        return MODEL_REGISTRY[config.architecture]
    except KeyError:
        raise unsupported_architecture(config.architecture) from None


__all__ = ["MODEL_REGISTRY", "DecoderForCausalLM", "model_class"]
