"""MKL-packed linear weights (float32 on CPU) give the same logits and tokens as plain F.linear."""

import torch

from splitserve.engine import LLM, SamplingParams
from splitserve.engine.loader import load_model
from tests.model_factory import make_tiny_model_dir


def test_packed_weights_match_plain_linear(tmp_path, monkeypatch):
    path = make_tiny_model_dir(tmp_path, "llama", dtype=torch.float32)
    packed, _ = load_model(path, dtype=torch.float32, device="cpu")
    monkeypatch.setenv("SPLITSERVE_CPU_PACKED", "0")
    plain, _ = load_model(path, dtype=torch.float32, device="cpu")
    assert packed.lm_head.weight is not None and packed._lm_head_packed is not None
    assert plain._lm_head_packed is None and plain.model.layers[0].mlp.down_proj.packed is None
    x = torch.randn(37, packed.config.hidden_size)
    for a, b in ((packed.model.layers[0].mlp.down_proj, plain.model.layers[0].mlp.down_proj),):
        xin = torch.randn(37, a.weight.shape[1])
        assert torch.allclose(a(xin), b(xin), atol=1e-5, rtol=1e-5)
    assert torch.allclose(packed.compute_logits(x), plain.compute_logits(x), atol=1e-5, rtol=1e-5)


def test_float32_engine_tokens_with_and_without_packing(tmp_path, monkeypatch):
    path = make_tiny_model_dir(tmp_path, "qwen2", dtype=torch.float32)
    prompts = [[5, 9, 13, 200, 7], list(range(30, 70))]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    args = dict(dtype="float32", device="cpu", block_size=4, num_kv_blocks=64)
    with_packing = [
        o.token_ids for o in LLM(model=str(path), **args).generate(prompt_token_ids=prompts, sampling_params=params)
    ]
    monkeypatch.setenv("SPLITSERVE_CPU_PACKED", "0")
    without = [
        o.token_ids for o in LLM(model=str(path), **args).generate(prompt_token_ids=prompts, sampling_params=params)
    ]
    assert with_packing == without
