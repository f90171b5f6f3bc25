"""Mixture-of-experts models on CUDA (the fused Triton MoE kernel, decode steps in CUDA graphs): greedy tokens
equal transformers in fp32. Skipped without a GPU."""

import pytest
import torch

from splitserve.engine import LLM, SamplingParams
from tests.engine.test_engine_exact import make_prompts
from tests.engine.test_moe_exact import MOE_MODELS
from tests.model_factory import hf_greedy, make_tiny_model_dir

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize(
    "name, eager", [(name, False) for name in sorted(MOE_MODELS)] + [("qwen3moe-top2-dense1", True)]
)
def test_fp32_greedy_equals_transformers(name, eager, tmp_path):
    path = make_tiny_model_dir(tmp_path, dtype=torch.float32, **MOE_MODELS[name])
    prompts = make_prompts()
    expected = hf_greedy(path, prompts, 8, torch.float32, "cuda")
    llm = LLM(
        model=str(path),
        dtype="float32",
        device="cuda",
        block_size=16,
        num_kv_blocks=128,
        max_num_seqs=16,
        enforce_eager=eager,
    )
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=greedy)
    assert [o.token_ids for o in outs] == expected
    assert llm.engine.num_free_blocks == 128
