"""What the engine needs to know about a mixture-of-experts model's sparse layers, per family.

A family's router is softmax over all experts, then the top k; the families differ only in whether the k
weights are renormalised to sum to one and in which dtype they reach the experts (transformers 5.x):

    family      softmax     top-k renormalised          weights applied in
    qwen3_moe   float32     when `norm_topk_prob`       the model dtype (cast after renormalising)
    mixtral     float32     always                      float32 (the product promotes, then is cast back)

gpt-oss routes the other way round: top k of the router's logits (it has a bias), then a softmax over those k
in the model dtype; its experts carry biases and a clamped SwiGLU (models/gpt_oss_moe.py).

Which layers are sparse is also the family's rule (Qwen3-MoE's `mlp_only_layers` / `decoder_sparse_step`);
the others keep the dense SwiGLU MLP of `intermediate_size`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# transformers releases before `swiglu_alpha` joined GptOssConfig hard-coded this value in the model
GPT_OSS_SWIGLU_ALPHA = 1.702


@dataclass(frozen=True)
class MoeConfig:
    """The sparse MLP of the layers in `sparse_layers`: `num_experts` SwiGLU experts of width
    `intermediate_size`, `top_k` of them per token."""

    num_experts: int
    top_k: int
    intermediate_size: int
    renormalize: bool  # the top-k weights divided by their sum
    weights_in_model_dtype: bool  # False: the float32 weights multiply the experts' output (Mixtral)
    sparse_layers: tuple[int, ...]
    # gpt-oss: (alpha, limit) of its clamped SwiGLU; the router and experts then carry biases, and the
    # softmax runs over the top k logits (models/gpt_oss_moe.py). None: the plain SwiGLU experts above.
    clamped_swiglu: tuple[float, float] | None = None


def _checked(num_experts: int, top_k: int, family: str) -> None:
    if num_experts < 1:
        raise ValueError(f"{family}: the number of experts must be at least 1, got {num_experts}")
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"{family}: num_experts_per_tok {top_k} must be in [1, {num_experts}] (the number of experts)")


def qwen3_moe_config(hf: Any) -> MoeConfig | None:
    """Qwen3-MoE: layer i is sparse unless listed in `mlp_only_layers` or (i + 1) % decoder_sparse_step != 0."""
    num_experts, top_k = int(hf.num_experts), int(hf.num_experts_per_tok)
    dense = set(getattr(hf, "mlp_only_layers", None) or ())
    step = int(getattr(hf, "decoder_sparse_step", 1) or 1)
    sparse = tuple(i for i in range(hf.num_hidden_layers) if i not in dense and num_experts > 0 and (i + 1) % step == 0)
    if not sparse:
        return None
    _checked(num_experts, top_k, "qwen3_moe")
    return MoeConfig(
        num_experts=num_experts,
        top_k=top_k,
        intermediate_size=int(hf.moe_intermediate_size),
        renormalize=bool(getattr(hf, "norm_topk_prob", False)),
        weights_in_model_dtype=True,
        sparse_layers=sparse,
    )


def mixtral_config(hf: Any) -> MoeConfig:
    """Mixtral: every layer sparse, experts of `intermediate_size`, the top-k weights always renormalised."""
    num_experts, top_k = int(hf.num_local_experts), int(hf.num_experts_per_tok)
    _checked(num_experts, top_k, "mixtral")
    return MoeConfig(
        num_experts=num_experts,
        top_k=top_k,
        intermediate_size=int(hf.intermediate_size),
        renormalize=True,
        weights_in_model_dtype=False,
        sparse_layers=tuple(range(hf.num_hidden_layers)),
    )


def gpt_oss_config(hf: Any) -> MoeConfig:
    """gpt-oss: every layer sparse, experts of `intermediate_size`, the clamped SwiGLU of `swiglu_alpha` and
    `swiglu_limit`."""
    num_experts, top_k = int(hf.num_local_experts), int(hf.num_experts_per_tok)
    _checked(num_experts, top_k, "gpt_oss")
    return MoeConfig(
        num_experts=num_experts,
        top_k=top_k,
        intermediate_size=int(hf.intermediate_size),
        renormalize=True,  # the softmax over the k chosen logits sums to one
        weights_in_model_dtype=True,
        sparse_layers=tuple(range(hf.num_hidden_layers)),
        clamped_swiglu=(float(getattr(hf, "swiglu_alpha", GPT_OSS_SWIGLU_ALPHA)), float(hf.swiglu_limit)),
    )
