"""Mixture-of-experts models (Qwen3-MoE, Mixtral): greedy tokens equal transformers `generate` in float64,
through the offline LLM with prefix hits and with preemption; the sparse-layer rules and the checkpoint
names of each family. Block accounting returns to where it started in every run.
"""

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from splitserve.engine.worker.loader import load_model
from splitserve.engine.worker.model_config import ModelConfig
from splitserve.engine.worker.models.moe import SparseMoeBlock, route
from splitserve.engine.worker.moe_config import MoeConfig
from tests.engine.test_engine_exact import engine_greedy as exact_engine_greedy
from tests.engine.test_engine_exact import make_prompts
from tests.model_factory import hf_greedy, make_tiny_model_dir

MAX_NEW = 5
QWEN3_MOE = dict(arch="qwen3_moe", num_kv_heads=2, moe_intermediate_size=24, intermediate_size=40)
# name -> make_tiny_model_dir kwargs: top-2 and top-8, renormalised or not, dense layers among sparse ones
MOE_MODELS = {
    "qwen3moe-top2-dense1": dict(
        **QWEN3_MOE, num_hidden_layers=3, num_experts=4, num_experts_per_tok=2, mlp_only_layers=[1]
    ),
    "qwen3moe-top8-norm-step2": dict(
        **QWEN3_MOE,
        hidden_size=32,
        num_hidden_layers=4,
        num_experts=8,
        num_experts_per_tok=8,
        norm_topk_prob=True,
        decoder_sparse_step=2,
        tie=True,
    ),
    "mixtral-top2": dict(
        arch="mixtral", num_kv_heads=1, hidden_size=32, intermediate_size=24, num_local_experts=8, num_experts_per_tok=2
    ),
}


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe-models")
    return {name: make_tiny_model_dir(root, name=name, **cfg) for name, cfg in MOE_MODELS.items()}


@pytest.fixture(scope="module")
def prompts():
    return make_prompts(n=10)


@pytest.fixture(scope="module")
def expected(model_dirs, prompts):
    return {name: hf_greedy(path, prompts, MAX_NEW) for name, path in model_dirs.items()}


def engine_greedy(model_dir, prompts, **kwargs):
    return exact_engine_greedy(model_dir, prompts, MAX_NEW, **kwargs)


@pytest.mark.parametrize("name", sorted(MOE_MODELS))
def test_greedy_batch_equals_transformers_with_prefix_hits(name, model_dirs, prompts, expected):
    got, llm = engine_greedy(model_dirs[name], prompts, num_kv_blocks=256, max_num_batched_tokens=64)
    assert got == expected[name]
    assert llm.engine.stats()["prefix_hit_tokens"] > 0  # the shared prefixes were reused


def test_preemption_gives_the_same_tokens(model_dirs, prompts, expected):
    # 24 blocks of 4 tokens cannot hold 10 prompts of up to 45 tokens at once
    got, llm = engine_greedy(model_dirs["mixtral-top2"], prompts, num_kv_blocks=24)
    assert got == expected["mixtral-top2"]
    assert llm.engine.stats()["num_preemptions"] > 0


def test_sparse_layers_and_routing_follow_each_family(model_dirs):
    dense1 = ModelConfig.from_pretrained(model_dirs["qwen3moe-top2-dense1"])
    assert dense1.moe == MoeConfig(
        num_experts=4,
        top_k=2,
        intermediate_size=24,
        renormalize=False,
        weights_in_model_dtype=True,
        sparse_layers=(0, 2),
    )
    step2 = ModelConfig.from_pretrained(model_dirs["qwen3moe-top8-norm-step2"]).moe
    assert (step2.sparse_layers, step2.top_k, step2.renormalize) == ((1, 3), 8, True)
    mixtral = ModelConfig.from_pretrained(model_dirs["mixtral-top2"])
    assert mixtral.moe == MoeConfig(8, 2, 24, True, False, (0, 1))
    assert (mixtral.attention_bias, mixtral.o_proj_bias, mixtral.qk_norm) == (False, False, False)
    net, _ = load_model(model_dirs["qwen3moe-top2-dense1"], dtype="float64", device="cpu")
    kinds = [type(layer.mlp).__name__ for layer in net.model.layers]
    assert kinds == ["SparseMoeBlock", "MLP", "SparseMoeBlock"]

    logits = torch.tensor([[2.0, 0.0, 1.0, -1.0]], dtype=torch.bfloat16)
    probs = torch.softmax(logits.float(), -1)[0]
    weights, ids = route(logits, mixtral.moe)  # renormalised, kept in float32
    assert ids.tolist() == [[0, 2]] and weights.dtype == torch.float32
    torch.testing.assert_close(weights[0], probs[[0, 2]] / probs[[0, 2]].sum())
    weights, ids = route(logits, dense1.moe)  # not renormalised, cast to the model dtype
    assert ids.tolist() == [[0, 2]] and weights.dtype == torch.bfloat16
    assert weights[0].tolist() == probs[[0, 2]].to(torch.bfloat16).tolist()


def test_expert_tensors_load_into_their_slices_and_a_missing_one_is_named(model_dirs, tmp_path):
    path = model_dirs["mixtral-top2"]
    net, _ = load_model(path, dtype="float64", device="cpu")
    tensors = load_file(str(path / "model.safetensors"))
    block = net.model.layers[1].mlp
    assert isinstance(block, SparseMoeBlock)
    prefix = "model.layers.1.block_sparse_moe"
    assert torch.equal(block.gate.weight, tensors[f"{prefix}.gate.weight"])
    assert torch.equal(block.experts.gate_up_proj[5, :24], tensors[f"{prefix}.experts.5.w1.weight"])
    assert torch.equal(block.experts.gate_up_proj[5, 24:], tensors[f"{prefix}.experts.5.w3.weight"])
    assert torch.equal(block.experts.down_proj[5], tensors[f"{prefix}.experts.5.w2.weight"])

    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text((path / "config.json").read_text())
    del tensors[f"{prefix}.experts.7.w3.weight"]
    save_file(tensors, str(broken / "model.safetensors"))
    with pytest.raises(ValueError, match=r"is missing tensor 'model\.layers\.1\.block_sparse_moe\.experts\.7\.w3"):
        load_model(broken, dtype="float64", device="cpu")


def test_fp8_quantization_makes_the_experts_e4m3_with_row_scales(model_dirs):
    from splitserve.kernels.fused_moe import fused_moe_ref

    path = model_dirs["qwen3moe-top2-dense1"]
    plain, _ = load_model(path, dtype="float32", device="cpu")
    net, _ = load_model(path, dtype="float32", device="cpu", quantization="fp8")
    block, before = net.model.layers[2].mlp, plain.model.layers[2].mlp
    experts = block.experts
    assert experts.gate_up_proj.dtype == experts.down_proj.dtype == torch.float8_e4m3fn
    assert experts.gate_up_scale.shape == (4, 48) and experts.down_scale.shape == (4, 64)
    assert block.gate.weight.dtype == torch.float32  # the router is not quantized
    for name, scale in (("gate_up_proj", experts.gate_up_scale), ("down_proj", experts.down_scale)):
        original = getattr(before.experts, name)
        restored = getattr(experts, name).float() * scale[:, :, None]
        # e4m3 keeps 3 mantissa bits: within 2^-4 of each value, or 2^-9 of the row's scale near zero
        assert ((restored - original).abs() <= original.abs() / 16 + scale[:, :, None] / 512).all()
    x = torch.randn(5, 64)
    weights, ids = route(F.linear(x, block.gate.weight), block.moe)
    want = fused_moe_ref(
        x, experts.gate_up_proj, experts.down_proj, weights, ids, experts.gate_up_scale, experts.down_scale
    )
    assert torch.equal(block(x), want)
    assert not torch.allclose(
        want, fused_moe_ref(x, experts.gate_up_proj.float(), experts.down_proj.float(), weights, ids)
    )


def test_an_fp8_checkpoint_of_an_moe_model_is_refused_with_the_way_out(model_dirs, tmp_path):
    import json
    import shutil

    path = shutil.copytree(model_dirs["mixtral-top2"], tmp_path / "fp8")
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic"}
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError) as err:
        load_model(path, dtype="bfloat16", device="cpu")
    assert str(err.value) == (
        "fp8 checkpoints of mixture-of-experts models (MixtralForCausalLM) are not supported; "
        "load the bf16 checkpoint with --quantization fp8 (e4m3 experts, W8A16)"
    )
