"""The engine on CUDA: exact against transformers in fp32 (tiny models of each architecture),
and near-exact in bf16 on the trained default model. Skipped without a GPU."""

import pytest
import torch

from splitserve.engine import LLM, SamplingParams
from tests.model_factory import LLAMA3_SCALING, load_hf_reference, make_tiny_model_dir
from tests.test_engine_exact import make_prompts

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

ARCHS = {
    "llama": dict(arch="llama", num_kv_heads=2),
    "llama-tied-llama3": dict(arch="llama", num_kv_heads=4, tie=True, rope_scaling=LLAMA3_SCALING),
    "mistral": dict(arch="mistral", num_kv_heads=1),
    "qwen2": dict(arch="qwen2", num_kv_heads=2),
    "qwen3": dict(arch="qwen3", num_kv_heads=2, tie=True),
}


def hf_greedy(path, prompts, dtype, max_new):
    model = load_hf_reference(path, dtype).cuda()
    outs = []
    with torch.no_grad():
        for p in prompts:
            ids = model.generate(
                torch.tensor([p], device="cuda"),
                max_new_tokens=max_new,
                min_new_tokens=max_new,
                do_sample=False,
                pad_token_id=0,
            )
            outs.append(ids[0, len(p) :].tolist())
    return outs


@pytest.mark.parametrize("name, eager", [(name, False) for name in sorted(ARCHS)] + [("llama", True)])
def test_fp32_greedy_equals_transformers(name, eager, tmp_path):
    path = make_tiny_model_dir(tmp_path, dtype=torch.float32, **ARCHS[name])
    prompts = make_prompts()
    expected = hf_greedy(path, prompts, torch.float32, 8)
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
    expected = hf_greedy(path, prompts, torch.bfloat16, 32)
    got = [
        o.token_ids
        for o in llm.generate(
            prompt_token_ids=prompts, sampling_params=SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
        )
    ]
    same = sum(a == b for a, b in zip(got, expected))
    assert same >= 14, f"only {same} of 16 prompts match transformers in bf16"
