"""The engine on CUDA: exact against transformers in fp32 (tiny models of each architecture),
and near-exact in bf16 on the trained default model. Skipped without a GPU."""

import pytest
import torch

from splitserve.engine import LLM, SamplingParams
from tests.model_factory import TINY_MODELS, hf_greedy, make_tiny_model_dir
from tests.test_engine_exact import make_prompts

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("name, eager", [(name, False) for name in sorted(TINY_MODELS)] + [("llama-gqa2", True)])
def test_fp32_greedy_equals_transformers(name, eager, tmp_path):
    path = make_tiny_model_dir(tmp_path, dtype=torch.float32, **TINY_MODELS[name])
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
    outs = llm.generate(
        prompt_token_ids=prompts, sampling_params=SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    )
    assert [o.token_ids for o in outs] == expected
    assert llm.engine.num_free_blocks == 128


def test_bf16_default_model_matches_transformers_on_most_prompts():
    from splitserve.common.default_model_path import default_model_path

    path = default_model_path()
    llm = LLM(model=str(path), dtype="bfloat16", device="cuda", max_num_seqs=16, num_kv_blocks=256)
    tok = llm.tokenizer
    texts = [
        f"def {name}("
        for name in (
            "fibonacci",
            "parse_args",
            "main",
            "read_file",
            "sort_items",
            "merge",
            "validate",
            "connect",
            "encode",
            "decode",
            "tokenize",
            "flatten",
            "unique",
            "chunks",
            "retry",
            "timer",
        )
    ]
    prompts = [tok.encode(t, add_special_tokens=False) for t in texts]
    expected = hf_greedy(path, prompts, 32, torch.bfloat16, "cuda")
    got = [
        o.token_ids
        for o in llm.generate(
            prompt_token_ids=prompts, sampling_params=SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
        )
    ]
    same = sum(a == b for a, b in zip(got, expected))
    assert same >= 14, f"only {same} of 16 prompts match transformers in bf16"
