"""gpt-oss: greedy tokens equal transformers `generate` in float64 through the offline LLM (prompts longer than the
sliding window, prefix hits, preemption); its config traits; the refusal of CUDA. Blocks return to where they
started in every run.
"""

import math

import pytest
import torch

from splitserve.engine import LLM, SamplingParams
from splitserve.engine.worker.model_config import ModelConfig
from splitserve.engine.worker.models.gpt_oss import GptOssForCausalLM
from tests.engine.test_engine_exact import make_prompts
from tests.model_factory import hf_greedy, make_tiny_model_dir

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
    intermediate_size=24,
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
    llm = LLM(model=str(model_dir), dtype="float64", device="cpu", block_size=4, **kwargs)
    free_before = llm.engine.num_free_blocks
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    assert llm.engine.num_free_blocks == free_before  # nothing leaked
    assert all(o.finish_reason == "length" for o in outs)
    return [o.token_ids for o in outs], llm


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
    assert (config.moe.num_experts, config.moe.top_k, config.moe.intermediate_size) == (4, 2, 24)
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


def test_cuda_is_refused_naming_what_is_missing(model_dir):
    config = ModelConfig.from_pretrained(model_dir)
    with pytest.raises(ValueError) as err:
        GptOssForCausalLM(config, torch.float32, "cuda")
    assert str(err.value) == (
        "GptOssForCausalLM runs on CPU only: the CUDA attention kernels do not implement attention sinks or "
        "sliding windows, and the fused MoE kernel does not implement expert biases or the clamped SwiGLU "
        "(device 'cuda'); use device='cpu'"
    )
