"""What the engine needs to know about a model, read from a Hugging Face config.

`ModelConfig` is frozen and built once, through `transformers.AutoConfig`, so both config
styles load: transformers 4.x (`rope_theta` + `rope_scaling` at the top level) and 5.x
(`rope_parameters`, which holds the theta and the scaling together).

Architectures differ only in a few traits (`ARCH_TRAITS`, keyed by
`config.architectures[0]`); one decoder implements them all (`engine.worker.models`).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from splitserve.common.kv_layout import KvLayout
from splitserve.engine.worker.moe_config import MoeConfig, gpt_oss_config, mixtral_config, qwen3_moe_config

ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def _bias_from_config(hf: Any) -> tuple[bool, bool]:
    """Llama / Qwen3: `attention_bias` puts a bias on q, k, v and o."""
    bias = bool(getattr(hf, "attention_bias", False))
    return bias, bias


@dataclass(frozen=True)
class ArchTraits:
    """How one architecture reads a config: which biases exist, q/k norm, sliding window."""

    model_type: str
    # (qkv_bias, o_proj_bias) for a config.
    bias_rule: Callable[[Any], tuple[bool, bool]] = _bias_from_config
    qk_norm: bool = False
    # Config flag that must be true for `sliding_window` to apply; None: applies whenever set.
    sliding_window_flag: str | None = None
    # The sparse layers' experts and routing (engine.worker.moe_config); None: a dense model.
    moe_rule: Callable[[Any], MoeConfig | None] | None = None
    # gpt-oss: a learned sink logit per head, and `sliding_window` applied in the layers `layer_types` names
    # "sliding_attention" (the others attend to the whole context).
    sinks_and_layer_types: bool = False


ARCH_TRAITS: dict[str, ArchTraits] = {
    "LlamaForCausalLM": ArchTraits("llama"),
    "MistralForCausalLM": ArchTraits("mistral", bias_rule=lambda hf: (False, False)),
    "Qwen2ForCausalLM": ArchTraits(
        "qwen2", bias_rule=lambda hf: (True, False), sliding_window_flag="use_sliding_window"
    ),
    "Qwen3ForCausalLM": ArchTraits("qwen3", qk_norm=True, sliding_window_flag="use_sliding_window"),
    "Qwen3MoeForCausalLM": ArchTraits(
        "qwen3_moe", qk_norm=True, sliding_window_flag="use_sliding_window", moe_rule=qwen3_moe_config
    ),
    "MixtralForCausalLM": ArchTraits("mixtral", bias_rule=lambda hf: (False, False), moe_rule=mixtral_config),
    "GptOssForCausalLM": ArchTraits("gpt_oss", moe_rule=gpt_oss_config, sinks_and_layer_types=True),
}
_ARCH_BY_MODEL_TYPE = {traits.model_type: name for name, traits in ARCH_TRAITS.items()}


def unsupported_architecture(name: str) -> ValueError:
    return ValueError(f"architecture {name!r} is not supported; supported: {', '.join(sorted(ARCH_TRAITS))}")


@dataclass(frozen=True)
class ModelConfig:
    """A decoder-only model's shape and conventions (all lengths in tokens).

    Invariants: num_heads % num_kv_heads == 0; rope_scaling is None for plain RoPE, else a
    dict with "rope_type" in ROPE_TYPES; eos_token_ids is a tuple (possibly empty).
    """

    model_id: str
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None = field(hash=False)
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # bias on q/k/v projections
    qk_norm: bool  # RMSNorm over each q/k head before rotary (Qwen3)
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    # Biases some HF variants also carry, and the sliding window (applied only in `sliding_layers`; a window
    # without them is not implemented by our attention: contexts beyond it differ from transformers).
    o_proj_bias: bool = False
    mlp_bias: bool = False
    sliding_window: int | None = None
    sliding_layers: tuple[int, ...] = ()  # layers that attend to the last `sliding_window` positions only
    attention_sinks: bool = False  # a learned logit per head in every softmax's denominator (gpt-oss)
    checkpoint_dtype: str | None = None  # the dtype config.json names, e.g. "bfloat16"
    moe: MoeConfig | None = None  # the mixture-of-experts layers; None: every layer's MLP is dense

    @classmethod
    def from_pretrained(cls, path: str | Path, model_id: str | None = None) -> ModelConfig:
        """Read a model directory (config.json, optional generation_config.json) or a config JSON file."""
        from transformers import AutoConfig

        path = Path(path)
        hf_config = AutoConfig.from_pretrained(str(path))
        config = cls.from_hf_config(hf_config, model_id=model_id or _default_model_id(path))
        gen_path = path / "generation_config.json"
        if path.is_dir() and gen_path.is_file():
            eos = json.loads(gen_path.read_text()).get("eos_token_id")
            if eos is not None:
                config = replace(config, eos_token_ids=_as_ids(eos))
        return config

    @classmethod
    def from_hf_config(cls, hf: Any, model_id: str | None = None) -> ModelConfig:
        """Build from a transformers config object (architecture from `architectures[0]`,
        else from `model_type`)."""
        architecture = _architecture_of(hf)
        traits = ARCH_TRAITS[architecture]
        act = getattr(hf, "hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"hidden_act {act!r} is not supported; only 'silu'")
        num_heads = hf.num_attention_heads
        num_kv_heads = getattr(hf, "num_key_value_heads", None) or num_heads
        if num_heads % num_kv_heads:
            raise ValueError(f"num_attention_heads {num_heads} is not a multiple of num_key_value_heads {num_kv_heads}")
        rope_theta, rope_scaling = _rope_of(hf)
        qkv_bias, o_bias = traits.bias_rule(hf)
        window = getattr(hf, "sliding_window", None)
        if traits.sliding_window_flag is not None and not getattr(hf, traits.sliding_window_flag, False):
            window = None
        sliding_layers = ()
        if traits.sinks_and_layer_types and window is not None:
            sliding_layers = tuple(i for i, kind in enumerate(hf.layer_types) if kind == "sliding_attention")
        return cls(
            model_id=model_id or Path(getattr(hf, "_name_or_path", "") or architecture).name,
            architecture=architecture,
            vocab_size=hf.vocab_size,
            hidden_size=hf.hidden_size,
            intermediate_size=hf.intermediate_size,
            num_layers=hf.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=getattr(hf, "head_dim", None) or hf.hidden_size // num_heads,
            rms_norm_eps=float(hf.rms_norm_eps),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=hf.max_position_embeddings,
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            attention_bias=qkv_bias,
            qk_norm=traits.qk_norm,
            eos_token_ids=_as_ids(getattr(hf, "eos_token_id", None)),
            bos_token_id=getattr(hf, "bos_token_id", None),
            o_proj_bias=o_bias,
            mlp_bias=bool(getattr(hf, "mlp_bias", False)),
            sliding_window=window,
            sliding_layers=sliding_layers,
            attention_sinks=traits.sinks_and_layer_types,
            checkpoint_dtype=_dtype_name_of(hf),
            moe=None if traits.moe_rule is None else traits.moe_rule(hf),
        )

    def kv_layout(
        self,
        block_size: int,
        dtype_name: str,
        kv_scales: list[tuple[float, float]] | None = None,
        tensor_parallel_size: int = 1,
    ) -> KvLayout:
        """The KV cache layout this model needs with `block_size` tokens per block; `kv_scales`
        (per-layer (k, v)) only for an fp8 dtype. Over `tensor_parallel_size` ranks each rank's pool holds
        its share of the KV heads (engine.worker.tensor_parallel), and the layout names every rank's."""
        from splitserve.engine.worker.tensor_parallel import kv_heads_of_rank

        size = tensor_parallel_size
        ranks = [tuple(kv_heads_of_rank(self.num_kv_heads, size, r)) for r in range(size)] if size > 1 else []
        return KvLayout(
            num_layers=self.num_layers,
            num_kv_heads=len(ranks[0]) if ranks else self.num_kv_heads,
            tensor_parallel_size=size,
            rank_kv_heads=tuple(ranks),
            head_dim=self.head_dim,
            block_size=block_size,
            dtype=dtype_name,
            model_id=self.model_id,
            k_scales=tuple(float(k) for k, _ in kv_scales or ()),
            v_scales=tuple(float(v) for _, v in kv_scales or ()),
        )


def _architecture_of(hf: Any) -> str:
    architectures = getattr(hf, "architectures", None) or []
    if architectures:
        name = architectures[0]
    else:
        model_type = getattr(hf, "model_type", "")
        name = _ARCH_BY_MODEL_TYPE.get(model_type, f"(model_type {model_type!r})")
    if name not in ARCH_TRAITS:
        raise unsupported_architecture(name)
    return name


def _rope_of(hf: Any) -> tuple[float, dict | None]:
    """(theta, scaling or None) from either `rope_parameters` (5.x) or `rope_theta` + `rope_scaling` (4.x)."""
    params = getattr(hf, "rope_parameters", None)
    if isinstance(params, dict) and "rope_theta" in params:
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
        theta = float(params["rope_theta"])
    else:
        scaling = dict(getattr(hf, "rope_scaling", None) or {})
        theta = float(getattr(hf, "rope_theta", 10000.0))
    legacy_type = scaling.pop("type", None)  # transformers 4.x name of rope_type
    scaling.setdefault("rope_type", legacy_type or "default")
    rope_type = scaling.get("rope_type", "default")
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"rope_type {rope_type!r} is not supported; supported: {', '.join(ROPE_TYPES)}")
    partial = scaling.get("partial_rotary_factor", getattr(hf, "partial_rotary_factor", 1.0))
    if partial not in (None, 1.0):
        raise ValueError(f"partial_rotary_factor {partial} is not supported; only 1.0")
    if rope_type == "default":
        return theta, None
    return theta, scaling


def _as_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def _default_model_id(path: Path) -> str:
    path = path.resolve()
    return path.stem if path.is_file() else path.name


def _dtype_name_of(hf: Any) -> str | None:
    value = getattr(hf, "dtype", None) or getattr(hf, "torch_dtype", None)
    return None if value is None else str(value).removeprefix("torch.")
