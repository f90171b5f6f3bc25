"""Tiny random Hugging Face models and hand-built attention metadata, for tests.

- `make_tiny_model_dir` writes config.json + safetensors with transformers' own
  `save_pretrained` (random weights, norms and biases perturbed so a wrongly loaded one shows).
- `load_hf_reference` loads the same directory as a transformers model; in float64 it
  swaps in float64 RMSNorm / rotary math (transformers computes both in float32 even for a
  float64 model), so the reference is true float64 like our engine. `hf_greedy` generates with it.
- `engine_reference` is what the service tests compare against: the in-process engine's greedy and seeded tokens.
- `TINY_MODELS`: the architectures the engine-exactness tests (CPU and CUDA) compare.
- `SeqSpec` + `build_meta` + `step_positions` build one step's AttentionMetadata by hand.

Shared by the model, loader and engine tests; no pytest fixtures here.
"""

from __future__ import annotations

import json
import types
from dataclasses import dataclass
from pathlib import Path

import torch

from splitserve.engine import LLM, SamplingParams
from splitserve.engine.worker.attention import AttentionMetadata

ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "gpt_oss": "GptOssForCausalLM",
}
LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}
LINEAR_SCALING = {"rope_type": "linear", "factor": 2.0}
# The engine-exactness models (CPU float64 and CUDA float32): name -> make_tiny_model_dir kwargs.
# 4 query heads each: GQA 2, MHA tied with llama3 rope, MQA, qkv bias (qwen2), q/k norm tied (qwen3).
TINY_MODELS = {
    "llama-gqa2": dict(arch="llama", num_kv_heads=2),
    "llama-mha-tied-llama3rope": dict(arch="llama", num_kv_heads=4, tie=True, rope_scaling=LLAMA3_SCALING),
    "mistral-gqa4": dict(arch="mistral", num_kv_heads=1),
    "qwen2-bias": dict(arch="qwen2", num_kv_heads=2),
    "qwen3-qknorm": dict(arch="qwen3", num_kv_heads=2, tie=True),
}


def tiny_hf_config(
    arch: str = "llama",
    *,
    num_kv_heads: int = 2,
    tie: bool = False,
    rope_scaling: dict | None = None,
    vocab_size: int = 503,
    **overrides,
):
    """A transformers config: 2 layers, hidden 64, 4 query heads of 16, FFN 96, 128 positions."""
    from transformers import AutoConfig

    rope = {"rope_type": "default", **(rope_scaling or {}), "rope_theta": 10000.0}
    fields = dict(
        architectures=[ARCHITECTURES[arch]],
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=num_kv_heads,
        head_dim=16,
        max_position_embeddings=128,
        rms_norm_eps=1e-6,
        rope_parameters=rope,
        tie_word_embeddings=tie,
        initializer_range=0.1,
        bos_token_id=1,
        eos_token_id=2,
    )
    fields.update(overrides)
    return AutoConfig.for_model(arch, **fields)


def make_tiny_model_dir(
    tmp_path: Path,
    arch: str = "llama",
    *,
    num_kv_heads: int = 2,
    tie: bool = False,
    rope_scaling: dict | None = None,
    vocab_size: int = 503,
    dtype: torch.dtype = torch.float64,
    seed: int = 0,
    max_shard_size: str | None = None,
    name: str | None = None,
    **overrides,
) -> Path:
    """Save a random tiny `arch` model with transformers; returns the directory."""
    from transformers import AutoModelForCausalLM

    config = tiny_hf_config(
        arch, num_kv_heads=num_kv_heads, tie=tie, rope_scaling=rope_scaling, vocab_size=vocab_size, **overrides
    )
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config)
        with torch.no_grad():
            for param_name, param in model.named_parameters():
                if param_name.endswith("norm.weight"):
                    param.copy_(1.0 + 0.2 * torch.randn_like(param))
                elif param_name.endswith((".bias", "_bias")):  # gpt-oss's experts: gate_up_proj_bias, ...
                    param.copy_(0.1 * torch.randn_like(param))
    out = Path(tmp_path) / (name or f"tiny-{arch}")
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.to(dtype).save_pretrained(out, **kwargs)
    return out


def load_hf_reference(path: Path, dtype: torch.dtype = torch.float64):
    """The transformers model of `path` in `dtype` (sdpa attention, eager for gpt-oss; eval mode).

    For float64, RMSNorm and rotary modules compute in float64 (per instance; the classes
    are untouched), matching engine.layers, and experts run eagerly; other dtypes run transformers unchanged.
    """
    from transformers import AutoModelForCausalLM

    # transformers' default grouped-GEMM experts take no float64; its eager per-expert loop does
    experts = {"experts_implementation": "eager"} if dtype == torch.float64 else {}
    # gpt-oss's attention sinks exist only in its eager attention (transformers refuses sdpa for it)
    attn = "eager" if json.loads((Path(path) / "config.json").read_text())["model_type"] == "gpt_oss" else "sdpa"
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation=attn, **experts).eval()
    if dtype == torch.float64:
        for module in model.modules():
            kind = type(module).__name__
            if kind.endswith("RMSNorm"):
                module.forward = types.MethodType(_rms_norm_float64, module)
            elif kind == "GptOssRotaryEmbedding":  # its cos/sin are (.., D/2): it rotates halves itself
                module.forward = types.MethodType(_rotary_halves_float64, module)
            elif kind.endswith("RotaryEmbedding"):
                module.forward = types.MethodType(_rotary_float64, module)
    return model


def _rms_norm_float64(self, x: torch.Tensor) -> torch.Tensor:
    variance = x.pow(2).mean(-1, keepdim=True)
    return self.weight * (x * torch.rsqrt(variance + self.variance_epsilon))


def _rotary_float64(self, x: torch.Tensor, position_ids: torch.Tensor):
    freqs = position_ids[..., None].to(torch.float64) * self.inv_freq.to(x.device, torch.float64)
    emb = torch.cat((freqs, freqs), dim=-1)  # (B, L, D)
    return (emb.cos() * self.attention_scaling).to(x.dtype), (emb.sin() * self.attention_scaling).to(x.dtype)


def _rotary_halves_float64(self, x: torch.Tensor, position_ids: torch.Tensor):
    freqs = position_ids[..., None].to(torch.float64) * self.inv_freq.to(x.device, torch.float64)  # (B, L, D/2)
    return (freqs.cos() * self.attention_scaling).to(x.dtype), (freqs.sin() * self.attention_scaling).to(x.dtype)


def hf_greedy(
    path: Path, prompts: list[list[int]], max_new: int, dtype: torch.dtype = torch.float64, device: str = "cpu"
) -> list[list[int]]:
    """transformers' greedy `max_new` tokens (EOS ignored) after each prompt, one unpadded prompt at a time."""
    model = load_hf_reference(path, dtype).to(device)
    outs = []
    with torch.no_grad():
        for p in prompts:
            ids = model.generate(
                torch.tensor([p], device=device),
                max_new_tokens=max_new,
                min_new_tokens=max_new,
                do_sample=False,
                pad_token_id=0,
            )
            outs.append(ids[0, len(p) :].tolist())
    return outs


def engine_reference(
    llm: LLM, prompts: list[list[int]], max_tokens: int, seeded: list[dict]
) -> tuple[list[list[int]], list[list[int]]]:
    """`llm`'s tokens (EOS ignored, `max_tokens` each): greedy after every prompt, and sampled after the
    first len(`seeded`) prompts, prompt i with the SamplingParams fields seeded[i] (temperature, seed, ...)."""
    greedy = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    sampled = [SamplingParams(**fields, max_tokens=max_tokens, ignore_eos=True) for fields in seeded]
    return (
        [o.token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=greedy)],
        [o.token_ids for o in llm.generate(prompt_token_ids=prompts[: len(sampled)], sampling_params=sampled)],
    )


def hf_logits(model, token_ids: list[int]) -> torch.Tensor:
    """transformers' logits at every position of one unpadded sequence: (L, V)."""
    with torch.no_grad():
        return model(torch.tensor([token_ids])).logits[0]


@dataclass(frozen=True)
class SeqSpec:
    """One sequence in a step: `num_computed` tokens already cached, `num_new` computed now,
    stored in `block_ids` (enough blocks for num_computed + num_new tokens)."""

    num_computed: int
    num_new: int
    block_ids: tuple[int, ...]


def build_meta(specs: list[SeqSpec], block_size: int, device: str | torch.device = "cpu") -> AttentionMetadata:
    """AttentionMetadata for one step over `specs`, rows in spec order."""
    query_start_loc, seq_lens, slots = [0], [], []
    for spec in specs:
        seq_len = spec.num_computed + spec.num_new
        if len(spec.block_ids) * block_size < seq_len:
            raise ValueError(f"{len(spec.block_ids)} blocks of {block_size} cannot hold {seq_len} tokens")
        for pos in range(spec.num_computed, seq_len):
            slots.append(spec.block_ids[pos // block_size] * block_size + pos % block_size)
        query_start_loc.append(query_start_loc[-1] + spec.num_new)
        seq_lens.append(seq_len)
    max_blocks = max(len(spec.block_ids) for spec in specs)
    tables = [list(spec.block_ids) + [0] * (max_blocks - len(spec.block_ids)) for spec in specs]
    return AttentionMetadata(
        query_start_loc=torch.tensor(query_start_loc, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=torch.tensor(tables, dtype=torch.int32, device=device),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        max_query_len=max(spec.num_new for spec in specs),
        max_seq_len=max(seq_lens),
        query_start_loc_cpu=query_start_loc,
        seq_lens_cpu=seq_lens,
    )


def step_positions(specs: list[SeqSpec], device: str | torch.device = "cpu") -> torch.Tensor:
    """Positions of this step's tokens (T,) int64, rows in spec order."""
    return torch.cat([torch.arange(s.num_computed, s.num_computed + s.num_new, dtype=torch.int64) for s in specs]).to(
        device
    )
