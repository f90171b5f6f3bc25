"""gpt-oss: greedy tokens equal transformers `generate` in float64 through the offline LLM (prompts longer than the
sliding window, prefix hits, preemption); its config traits and YaRN; MXFP4 experts dequantized as transformers
does; the CUDA path's dispatch of sinks and windows. Blocks return to where they started in every run.
"""

import math

import pytest
import torch
import torch.nn.functional as F

from splitserve.engine.worker.loader import load_model
from splitserve.engine.worker.model_config import ModelConfig
from tests.engine.test_engine_exact import engine_greedy as exact_engine_greedy
from tests.engine.test_engine_exact import make_prompts
from tests.model_factory import SeqSpec, build_meta, hf_greedy, make_tiny_model_dir

MAX_NEW = 5
WINDOW = 8
YARN = {
    "rope_type": "yarn",
    "factor": 8.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 16,
}
# layer 0 slides over 8 positions, layer 1 attends to all; a SwiGLU limit low enough that the clamp bites
GPT_OSS = dict(
    arch="gpt_oss",
    num_kv_heads=2,
    rope_scaling=YARN,
    intermediate_size=32,  # a multiple of 32: MXFP4 blocks hold 32 values
    num_local_experts=4,
    num_experts_per_tok=2,
    sliding_window=WINDOW,
    swiglu_limit=0.5,
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("gpt-oss"), name="tiny-gpt-oss", **GPT_OSS)


@pytest.fixture(scope="module")
def prompts():
    prompts = make_prompts(n=10)
    assert max(len(p) for p in prompts) > 4 * WINDOW  # most of the context lies outside the window
    return prompts


@pytest.fixture(scope="module")
def expected(model_dir, prompts):
    return hf_greedy(model_dir, prompts, MAX_NEW)


def engine_greedy(model_dir, prompts, **kwargs):
    return exact_engine_greedy(model_dir, prompts, MAX_NEW, **kwargs)


def test_greedy_batch_equals_transformers_with_prefix_hits(model_dir, prompts, expected):
    got, llm = engine_greedy(model_dir, prompts, num_kv_blocks=256, max_num_batched_tokens=64)
    assert got == expected
    assert llm.engine.stats()["prefix_hit_tokens"] > 0  # the shared prefixes were reused


def test_preemption_gives_the_same_tokens(model_dir, prompts, expected):
    # 24 blocks of 4 tokens cannot hold 10 prompts of up to 45 tokens at once
    got, llm = engine_greedy(model_dir, prompts, num_kv_blocks=24)
    assert got == expected
    assert llm.engine.stats()["num_preemptions"] > 0


def test_config_reads_sinks_sliding_layers_yarn_and_the_clamped_swiglu(model_dir):
    config = ModelConfig.from_pretrained(model_dir)
    assert (config.architecture, config.attention_sinks) == ("GptOssForCausalLM", True)
    assert (config.sliding_window, config.sliding_layers) == (WINDOW, (0,))
    assert (config.attention_bias, config.o_proj_bias) == (True, True)
    assert config.rope_scaling == YARN
    assert (config.moe.num_experts, config.moe.top_k, config.moe.intermediate_size) == (4, 2, 32)
    assert config.moe.clamped_swiglu == (1.702, 0.5)
    assert config.moe.sparse_layers == (0, 1)


@pytest.mark.parametrize("truncate", [False, True])
def test_yarn_frequencies_and_attention_factor_equal_transformers(truncate):
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from splitserve.kernels.rotary import build_cos_sin_cache, rope_attention_factor, rope_inv_freq

    scaling = {**YARN, "truncate": truncate}
    hf = AutoConfig.for_model(
        "gpt_oss", hidden_size=64, num_attention_heads=4, head_dim=16, rope_parameters={**scaling, "rope_theta": 1.5e5}
    )
    inv_freq, factor = ROPE_INIT_FUNCTIONS["yarn"](hf)
    assert torch.equal(rope_inv_freq(16, 1.5e5, scaling), inv_freq)
    assert rope_attention_factor(scaling) == factor == pytest.approx(1 + 0.1 * math.log(8.0))
    cache = build_cos_sin_cache(16, 5, 1.5e5, scaling, torch.float32)
    angles = torch.arange(5).float()[:, None] * inv_freq
    assert torch.equal(cache, torch.cat((angles.cos(), angles.sin()), dim=-1) * factor)


def random_mxfp4(shape: tuple[int, ...], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Blocks (*shape, K/32, 16) of random codes and scales (*shape, K/32) of exponents 2^-20 .. 2^9."""
    gen = torch.Generator().manual_seed(seed)
    *rows, k = shape
    blocks = torch.randint(0, 256, (*rows, k // 32, 16), dtype=torch.uint8, generator=gen)
    return blocks, torch.randint(107, 137, (*rows, k // 32), dtype=torch.uint8, generator=gen)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
def test_mxfp4_dequantization_equals_transformers(dtype):
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from splitserve.engine.worker.mxfp4 import dequantize_mxfp4

    blocks, scales = random_mxfp4((3, 6, 64), seed=1)
    want = convert_moe_packed_tensors(blocks, scales, dtype=dtype)  # (3, 64, 6): transformers' input-major layout
    got = dequantize_mxfp4(blocks, scales, dtype)  # (3, 6, 64): the checkpoint's rows
    assert got.dtype == dtype and torch.equal(got.transpose(1, 2), want)
    with pytest.raises(ValueError, match=r"MXFP4 blocks \(3, 6, 2, 16\) and scales \(3, 6\) do not pair"):
        dequantize_mxfp4(blocks, scales[..., 0], dtype)


def test_an_mxfp4_checkpoint_loads_its_experts_dequantized(model_dir, tmp_path):
    import json
    import shutil

    from safetensors.torch import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    path = shutil.copytree(model_dir, tmp_path / "mxfp4")
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}
    (path / "config.json").write_text(json.dumps(config))
    tensors = load_file(str(path / "model.safetensors"))
    packed = {}
    for i in range(2):
        for name, rows, k in (("gate_up_proj", 64, 64), ("down_proj", 64, 32)):  # output-major (E, rows, K)
            key = f"model.layers.{i}.mlp.experts.{name}"
            del tensors[key]
            packed[key] = random_mxfp4((4, rows, k), seed=10 * i + rows)
            tensors[key + "_blocks"], tensors[key + "_scales"] = packed[key]
    save_file(tensors, str(path / "model.safetensors"))
    net, _ = load_model(path, dtype="float64", device="cpu")
    for key, (blocks, scales) in packed.items():
        got = net.get_parameter(key).transpose(1, 2)  # ours output-major, transformers' input-major
        assert torch.equal(got, convert_moe_packed_tensors(blocks, scales, dtype=torch.float64))
    assert torch.equal(net.model.layers[1].mlp.router.bias, tensors["model.layers.1.mlp.router.bias"])

    del tensors["model.layers.1.mlp.experts.down_proj_scales"]
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(ValueError) as err:
        load_model(path, dtype="float64", device="cpu")
    assert str(err.value) == (
        f"checkpoint in {path} has MXFP4 'model.layers.1.mlp.experts.down_proj_blocks' but not its other part"
    )


# a step of fresh prompts, a decode beside a chunk after a cached prefix, a decode-only step (block size 4)
ROUTED_STEPS = [
    [SeqSpec(0, 11, (3, 1, 6)), SeqSpec(0, 3, (5,))],
    [SeqSpec(11, 1, (3, 1, 6)), SeqSpec(3, 10, (5, 7, 2, 4))],
    [SeqSpec(12, 1, (3, 1, 6, 0)), SeqSpec(13, 1, (5, 7, 2, 4))],
]


def test_the_cuda_route_passes_sinks_and_windows_to_the_paged_kernels(monkeypatch):
    """paged_attention_cuda, the CUDA path's dispatch (on CPU tensors the kernels' references run), with sinks and a
    window of 5 equals attention_sinks_window_torch over fresh, mixed and decode-only steps; fresh prompts go
    through paged prefill even where the fresh-prompt kernel would take them (it has neither extra)."""
    from splitserve.engine.worker.attention import attention_sinks_window_torch, paged_attention_cuda, write_kv
    from splitserve.kernels import fresh_prefill_attention as fresh

    def refused(*args, **kwargs):
        raise AssertionError("the fresh-prompt kernel ran with sinks or a window")

    monkeypatch.setattr(fresh, "fresh_supported", lambda *args: True)
    monkeypatch.setattr(fresh, "fresh_prefill_attention", refused)
    gen = torch.Generator().manual_seed(5)
    kv = torch.zeros(8, 2, 4, 2, 16, dtype=torch.float64)  # (blocks, k|v, block size, Hkv, D)
    sinks = 2.0 * torch.randn(4, generator=gen, dtype=torch.float64)
    for specs in ROUTED_STEPS:
        meta = build_meta(specs, 4)
        q, k, v = (torch.randn(len(meta.slot_mapping), h, 16, generator=gen, dtype=torch.float64) for h in (4, 2, 2))
        write_kv(k, v, kv[:, 0], kv[:, 1], meta.slot_mapping)
        got = paged_attention_cuda(q, kv[:, 0], kv[:, 1], meta, 0.25, k, v, sinks=sinks, sliding_window=5)
        want = attention_sinks_window_torch(q, kv[:, 0], kv[:, 1], meta, 0.25, sinks, 5)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)  # the references compute in float32
        plain = attention_sinks_window_torch(q, kv[:, 0], kv[:, 1], meta, 0.25, None, None)
        assert not torch.allclose(plain, want, atol=1e-2)


def test_fp8_quantization_makes_the_experts_e4m3_and_the_cpu_path_their_dequantized_moe(model_dir):
    """--quantization fp8: both experts' weights e4m3 with a scale per expert and (interleaved) output row; the
    router and the biases stay float64; the block equals the float64 MoE on the dequantized weights exactly."""
    from splitserve.engine.worker.models.gpt_oss_moe import route_topk_softmax
    from splitserve.kernels.fused_moe import fused_moe_ref

    plain, _ = load_model(model_dir, dtype="float64", device="cpu")
    net, _ = load_model(model_dir, dtype="float64", device="cpu", quantization="fp8")
    block, before = net.model.layers[1].mlp, plain.model.layers[1].mlp
    experts = block.experts
    assert experts.gate_up_proj.dtype == experts.down_proj.dtype == torch.float8_e4m3fn
    assert experts.gate_up_scale.shape == (4, 64) and experts.down_scale.shape == (4, 64)
    assert block.router.weight.dtype == experts.gate_up_proj_bias.dtype == experts.down_proj_bias.dtype == torch.float64
    dequantized = {}
    for name, scale in (("gate_up_proj", experts.gate_up_scale), ("down_proj", experts.down_scale)):
        original = getattr(before.experts, name)
        dequantized[name] = (getattr(experts, name).float() * scale[:, :, None]).double()
        # e4m3 keeps 3 mantissa bits: within 2^-4 of each value, or 2^-9 of the row's scale near zero
        assert ((dequantized[name] - original).abs() <= original.abs() / 16 + scale[:, :, None] / 512).all()
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    weights, ids = route_topk_softmax(F.linear(x, block.router.weight, block.router.bias), 2)
    extras = dict(
        w13_bias=experts.gate_up_proj_bias,
        w2_bias=experts.down_proj_bias,
        clamped_swiglu=(block.alpha, block.limit),
        interleaved=True,
    )
    want = fused_moe_ref(x, dequantized["gate_up_proj"], dequantized["down_proj"], weights, ids, **extras)
    assert torch.equal(block(x), want)
    unquantized = fused_moe_ref(x, before.experts.gate_up_proj, before.experts.down_proj, weights, ids, **extras)
    assert not torch.equal(want, unquantized)
