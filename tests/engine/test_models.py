"""The Llama-family decoder against transformers, logit for logit, in float64.

Each case runs two sequences through a paged cache (block size 4, scattered blocks):
sequence A's prompt in two chunks while B prefills then decodes, then single-token decode
steps for both. Every computed row's logits must equal transformers' full-sequence
logits at that position (causal, so teacher forcing gives the same numbers).
"""

from __future__ import annotations

import math

import pytest
import torch

from splitserve.engine.worker.kv_cache import allocate_kv_cache
from splitserve.engine.worker.layers import build_cos_sin_cache, rms_norm, rotary_embedding, silu_and_mul
from splitserve.engine.worker.loader import load_model
from splitserve.engine.worker.model_config import ARCH_TRAITS, ModelConfig
from splitserve.engine.worker.models import MODEL_REGISTRY, DecoderForCausalLM, model_class
from tests.model_factory import (
    LINEAR_SCALING,
    LLAMA3_SCALING,
    SeqSpec,
    build_meta,
    hf_logits,
    load_hf_reference,
    make_tiny_model_dir,
    step_positions,
    tiny_hf_config,
)

BLOCK_SIZE = 4
SEQ_A = [7, 300, 41, 502, 9, 88, 120, 3, 64, 250, 17, 401, 5, 6]  # 11 prompt + 3 fed as decodes
SEQ_B = [11, 12, 499, 13, 200, 1, 77, 310, 42, 8]  # 7 prompt + 3 fed as decodes
BLOCKS_A = (9, 2, 14, 5)  # scattered on purpose
BLOCKS_B = (1, 12, 7)

# (name, arch, factory kwargs): GQA ratios 1/2/4, tied, qkv bias, q/k norm, rope scaling.
CASES = [
    ("llama-mha-untied", "llama", dict(num_kv_heads=4)),
    ("llama-gqa2-tied-llama3", "llama", dict(num_kv_heads=2, tie=True, rope_scaling=LLAMA3_SCALING)),
    (
        "llama-mqa-linear-bias",
        "llama",
        dict(num_kv_heads=1, rope_scaling=LINEAR_SCALING, attention_bias=True, mlp_bias=True),
    ),
    ("mistral-gqa2", "mistral", dict(num_kv_heads=2)),
    ("qwen2-gqa2-tied", "qwen2", dict(num_kv_heads=2, tie=True)),
    ("qwen3-gqa4-headdim32", "qwen3", dict(num_kv_heads=1, head_dim=32)),
]


def _schedule() -> list[list[tuple[str, SeqSpec]]]:
    """Steps of (sequence, spec): A chunked 6 + 5 with B's prefill then decode, then decodes."""
    steps = [
        [("A", SeqSpec(0, 6, BLOCKS_A)), ("B", SeqSpec(0, 7, BLOCKS_B))],
        [("B", SeqSpec(7, 1, BLOCKS_B)), ("A", SeqSpec(6, 5, BLOCKS_A))],
    ]
    for i in range(2):
        steps.append([("A", SeqSpec(11 + i, 1, BLOCKS_A)), ("B", SeqSpec(8 + i, 1, BLOCKS_B))])
    steps.append([("A", SeqSpec(13, 1, BLOCKS_A))])
    return steps


def run_engine(net: DecoderForCausalLM, config: ModelConfig, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Our logits for every token of SEQ_A and SEQ_B, computed over the schedule: name -> (L, V)."""
    seqs = {"A": SEQ_A, "B": SEQ_B}
    kv_cache = allocate_kv_cache(config.kv_layout(BLOCK_SIZE, str(dtype).removeprefix("torch.")), 16, "cpu")
    rows: dict[str, list[torch.Tensor]] = {"A": [], "B": []}
    with torch.inference_mode():
        for step in _schedule():
            specs = [spec for _, spec in step]
            ids = torch.tensor([t for name, s in step for t in seqs[name][s.num_computed : s.num_computed + s.num_new]])
            hidden = net(ids, step_positions(specs), kv_cache, build_meta(specs, BLOCK_SIZE))  # (T, H)
            logits = net.compute_logits(hidden)  # (T, V)
            start = 0
            for name, spec in step:
                rows[name].append(logits[start : start + spec.num_new])
                start += spec.num_new
    return {name: torch.cat(parts) for name, parts in rows.items()}


@pytest.mark.parametrize("name,arch,kwargs", CASES, ids=[c[0] for c in CASES])
def test_logits_equal_transformers_float64(tmp_path, name, arch, kwargs):
    path = make_tiny_model_dir(tmp_path, arch, vocab_size=503, **kwargs)
    net, config = load_model(path, dtype=torch.float64, device="cpu")
    reference = load_hf_reference(path, torch.float64)
    ours = run_engine(net, config, torch.float64)
    for seq_name, tokens in (("A", SEQ_A), ("B", SEQ_B)):
        want = hf_logits(reference, tokens)  # (L, 503)
        assert ours[seq_name].dtype == torch.float64 and ours[seq_name].shape == (len(tokens), 503)
        torch.testing.assert_close(ours[seq_name], want, atol=1e-10, rtol=0)
        assert ours[seq_name].argmax(-1).tolist() == want.argmax(-1).tolist()
        assert want.std() > 0.3  # random weights large enough that a wrong weight would show


def test_float32_matches_unmodified_transformers(tmp_path):
    """In float32 transformers runs unpatched (float32 norm/rotary): same logits up to float32 rounding."""
    path = make_tiny_model_dir(tmp_path, "llama", num_kv_heads=2, rope_scaling=LLAMA3_SCALING, dtype=torch.float32)
    net, config = load_model(path, dtype=torch.float32, device="cpu")
    reference = load_hf_reference(path, torch.float32)
    ours = run_engine(net, config, torch.float32)
    assert ours["A"].dtype == torch.float32
    torch.testing.assert_close(ours["A"], hf_logits(reference, SEQ_A), atol=2e-5, rtol=0)
    torch.testing.assert_close(ours["B"], hf_logits(reference, SEQ_B), atol=2e-5, rtol=0)


def test_bfloat16_logits_are_float32(tmp_path):
    path = make_tiny_model_dir(tmp_path, "qwen3", num_kv_heads=2, dtype=torch.float32)
    net, config = load_model(path, dtype=torch.bfloat16, device="cpu")
    assert net.model.layers[0].self_attn.qkv_proj.weight.dtype == torch.bfloat16
    ours = run_engine(net, config, torch.bfloat16)
    want = hf_logits(load_hf_reference(path, torch.float64), SEQ_A)
    assert ours["A"].dtype == torch.float32
    assert (ours["A"] - want).abs().max().item() < 0.1  # bf16 rounding, not a wrong weight


def test_registry_maps_every_architecture_to_the_one_decoder():
    dense = ["LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"]
    sparse = ["GptOssForCausalLM", "MixtralForCausalLM", "Qwen3MoeForCausalLM"]  # subclasses: their expert tensors
    assert sorted(MODEL_REGISTRY) == sorted(dense + sparse)
    assert {MODEL_REGISTRY[name] for name in dense} == {DecoderForCausalLM}
    assert all(issubclass(MODEL_REGISTRY[name], DecoderForCausalLM) for name in sparse)
    assert set(ARCH_TRAITS) == set(MODEL_REGISTRY)


@pytest.mark.parametrize(
    "arch,qkv_bias,o_bias,qk_norm",
    [
        ("llama", False, False, False),
        ("mistral", False, False, False),
        ("qwen2", True, False, False),
        ("qwen3", False, False, True),
    ],
)
def test_config_traits_per_architecture(arch, qkv_bias, o_bias, qk_norm):
    config = ModelConfig.from_hf_config(tiny_hf_config(arch), model_id="m")
    assert (config.attention_bias, config.o_proj_bias, config.qk_norm) == (qkv_bias, o_bias, qk_norm)
    assert model_class(config) is DecoderForCausalLM


def test_config_fields_from_hf_config():
    hf = tiny_hf_config(
        "llama", num_kv_heads=1, tie=True, rope_scaling=LLAMA3_SCALING, attention_bias=True, eos_token_id=[2, 9]
    )
    config = ModelConfig.from_hf_config(hf, model_id="tiny")
    assert config == ModelConfig(
        model_id="tiny",
        architecture="LlamaForCausalLM",
        vocab_size=503,
        hidden_size=64,
        intermediate_size=96,
        num_layers=2,
        num_heads=4,
        num_kv_heads=1,
        head_dim=16,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        rope_scaling=LLAMA3_SCALING,
        max_position_embeddings=128,
        tie_word_embeddings=True,
        attention_bias=True,
        qk_norm=False,
        eos_token_ids=(2, 9),
        bos_token_id=1,
        o_proj_bias=True,
        mlp_bias=False,
        sliding_window=None,
        checkpoint_dtype=None,
    )
    assert hash(config) == hash(ModelConfig.from_hf_config(hf, model_id="tiny"))  # usable as a dict key
    layout = config.kv_layout(16, "bfloat16")
    assert (
        layout.num_layers,
        layout.num_kv_heads,
        layout.head_dim,
        layout.block_size,
        layout.dtype,
        layout.model_id,
    ) == (2, 1, 16, 16, "bfloat16", "tiny")


def test_config_reads_transformers4_style_rope_and_sliding_window(tmp_path):
    (tmp_path / "config.json").write_text(
        '{"architectures": ["MistralForCausalLM"], "model_type": "mistral", "hidden_size": 64,'
        ' "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,'
        ' "num_key_value_heads": 2, "vocab_size": 503, "rope_theta": 500000.0,'
        ' "rope_scaling": {"type": "linear", "factor": 4.0}, "sliding_window": 64}'
    )
    config = ModelConfig.from_pretrained(tmp_path)
    assert (config.rope_theta, config.rope_scaling) == (500000.0, {"rope_type": "linear", "factor": 4.0})
    assert config.sliding_window == 64 and config.model_id == tmp_path.name


def test_unsupported_rope_type_and_activation():
    with pytest.raises(ValueError) as err:
        ModelConfig.from_hf_config(tiny_hf_config("llama", rope_scaling={"rope_type": "dynamic", "factor": 2.0}))
    assert str(err.value) == "rope_type 'dynamic' is not supported; supported: default, linear, llama3, yarn"
    with pytest.raises(ValueError) as err:
        ModelConfig.from_hf_config(tiny_hf_config("llama", hidden_act="gelu"))
    assert str(err.value) == "hidden_act 'gelu' is not supported; only 'silu'"


def test_rms_norm_fused_residual():
    x = torch.tensor([[1.0, 2.0, 3.0, 4.0]], dtype=torch.float64)
    residual = torch.tensor([[1.0, 0.0, -1.0, 0.0]], dtype=torch.float64)
    weight = torch.tensor([1.0, 2.0, 1.0, 0.5], dtype=torch.float64)
    out, new_residual = rms_norm(x, weight, 0.0, residual)
    assert new_residual.tolist() == [[2.0, 2.0, 2.0, 4.0]]
    rms = math.sqrt((4 + 4 + 4 + 16) / 4)
    assert out[0].tolist() == pytest.approx([2 / rms, 4 / rms, 2 / rms, 2 / rms], abs=1e-15)
    assert torch.equal(rms_norm(new_residual, weight, 0.0), out)


def test_silu_and_mul():
    x = torch.tensor([[0.0, 1.0, 3.0, 5.0]], dtype=torch.float64)  # gate [0, 1], up [3, 5]
    assert silu_and_mul(x)[0].tolist() == pytest.approx([0.0, 5 / (1 + math.exp(-1))], abs=1e-15)


def test_rotary_rotates_half_pairs_in_place():
    cache = build_cos_sin_cache(4, 8, 10000.0, None, torch.float64)  # inv_freq = [1, 0.01]
    assert cache.shape == (8, 4)
    q = torch.tensor([[[1.0, 0.0, 0.0, 0.0]]], dtype=torch.float64)  # (T=1, H=1, D=4)
    k = torch.tensor([[[0.0, 0.0, 1.0, 0.0]]], dtype=torch.float64)
    rotary_embedding(torch.tensor([3]), q, k, cache)
    assert q[0, 0].tolist() == pytest.approx([math.cos(3), 0.0, math.sin(3), 0.0], abs=1e-15)
    assert k[0, 0].tolist() == pytest.approx([-math.sin(3), 0.0, math.cos(3), 0.0], abs=1e-15)


@pytest.mark.parametrize("scaling", [None, LINEAR_SCALING, LLAMA3_SCALING])
def test_cos_sin_cache_equals_transformers_rotary(scaling):
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    hf = tiny_hf_config("llama", rope_scaling=scaling)
    cos, sin = LlamaRotaryEmbedding(hf)(torch.zeros(1, dtype=torch.float32), torch.arange(128)[None])
    cache = build_cos_sin_cache(16, 128, 10000.0, scaling, torch.float32)  # (128, 16)
    torch.testing.assert_close(cache[:, :8], cos[0, :, :8], atol=1e-6, rtol=0)
    torch.testing.assert_close(cache[:, 8:], sin[0, :, :8], atol=1e-6, rtol=0)
