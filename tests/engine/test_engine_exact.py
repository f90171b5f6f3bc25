"""The engine's greedy tokens equal transformers `generate`, one unpadded prompt at a time.

float64 on CPU so near-tied logits cannot flip. Every test also checks that block
accounting returns exactly to where it started.
"""

import random

import pytest

from splitserve.engine import LLM, SamplingParams
from tests.model_factory import TINY_MODELS, hf_greedy, make_tiny_model_dir

MAX_NEW = 6


def make_prompts(n=16, seed=0, vocab=503):
    """Mixed lengths 3..40; prompts 0-5 and 6-9 share long prefixes."""
    rng = random.Random(seed)
    shared_a = [rng.randrange(3, vocab) for _ in range(21)]
    shared_b = [rng.randrange(3, vocab) for _ in range(12)]
    prompts = []
    for i in range(n):
        tail = [rng.randrange(3, vocab) for _ in range(rng.randrange(1, 20))]
        if i < 6:
            prompts.append(shared_a + tail)
        elif i < 10:
            prompts.append(shared_b + tail)
        else:
            prompts.append(tail + [rng.randrange(3, vocab) for _ in range(rng.randrange(2, 20))])
    return prompts


def engine_greedy(model_dir, prompts, max_new: int = MAX_NEW, **kwargs):
    """The float64 CPU engine's greedy tokens (max_new each) and the engine; no block may leak."""
    llm = LLM(model=str(model_dir), dtype="float64", device="cpu", block_size=4, **kwargs)
    free_before = llm.engine.num_free_blocks
    params = SamplingParams(temperature=0, max_tokens=max_new, ignore_eos=True)
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    assert llm.engine.num_free_blocks == free_before  # nothing leaked
    assert all(o.finish_reason == "length" for o in outs)
    return [o.token_ids for o in outs], llm


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return {name: make_tiny_model_dir(root, name=name, **cfg) for name, cfg in TINY_MODELS.items()}


@pytest.fixture(scope="module")
def prompts():
    return make_prompts()


@pytest.fixture(scope="module")
def expected(model_dirs, prompts):
    return {name: hf_greedy(path, prompts, MAX_NEW) for name, path in model_dirs.items()}


@pytest.mark.parametrize("name", sorted(TINY_MODELS))
def test_greedy_batch_equals_transformers(name, model_dirs, prompts, expected):
    got, llm = engine_greedy(model_dirs[name], prompts, num_kv_blocks=256, max_num_batched_tokens=64)
    assert got == expected[name]
    stats = llm.engine.stats()
    assert stats["prefix_hit_tokens"] > 0  # the shared prefixes were reused


def test_chunked_prefill_gives_the_same_tokens(model_dirs, prompts, expected):
    got, llm = engine_greedy(
        model_dirs["llama-gqa2"], prompts, num_kv_blocks=256, max_num_batched_tokens=7, enable_prefix_caching=False
    )
    assert got == expected["llama-gqa2"]
    assert llm.engine.num_steps > sum(len(p) for p in prompts) // 7  # prompts were chunked


def test_preemption_gives_the_same_tokens(model_dirs, prompts, expected):
    # 40 blocks of 4 tokens cannot hold 16 prompts of up to 46 tokens at once
    got, llm = engine_greedy(model_dirs["qwen2-bias"], prompts, num_kv_blocks=40)
    assert got == expected["qwen2-bias"]
    assert llm.engine.stats()["num_preemptions"] > 0


def test_prefix_cache_computes_only_new_tokens(model_dirs):
    path = model_dirs["llama-gqa2"]
    llm = LLM(model=str(path), dtype="float64", device="cpu", block_size=4, num_kv_blocks=64)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    base = list(range(10, 30))  # 20 tokens = 5 full blocks
    first = llm.generate(prompt_token_ids=[base], sampling_params=params)[0]
    assert first.num_cached_tokens == 0
    follow = base + [40, 41, 42]
    second = llm.generate(prompt_token_ids=[follow], sampling_params=params)[0]
    assert second.num_cached_tokens == 20  # 5 cached blocks; only 3 new prompt tokens computed
    fresh = LLM(
        model=str(path), dtype="float64", device="cpu", block_size=4, num_kv_blocks=64, enable_prefix_caching=False
    )
    assert fresh.generate(prompt_token_ids=[follow], sampling_params=params)[0].token_ids == second.token_ids
    assert llm.engine.num_free_blocks == 64


def test_refuses_requests_that_can_never_fit(model_dirs):
    from splitserve.engine.outputs import RequestError

    llm = LLM(
        model=str(model_dirs["llama-gqa2"]),
        dtype="float64",
        device="cpu",
        block_size=4,
        num_kv_blocks=8,
        max_model_len=40,
    )
    with pytest.raises(RequestError, match=r"^prompt has 40 tokens; max_model_len is 40, leaving no room to generate$"):
        llm.generate(prompt_token_ids=[[5] * 40])
    with pytest.raises(
        RequestError, match=r"^prompt \(30 tokens\) \+ max_tokens \(20\) = 50 exceeds max_model_len 40$"
    ):
        llm.generate(prompt_token_ids=[[5] * 30], sampling_params=SamplingParams(max_tokens=20))
    with pytest.raises(RequestError, match=r"^prompt \+ max_tokens needs 9 KV blocks; the pool has 8 in all$"):
        llm.generate(prompt_token_ids=[[5] * 30], sampling_params=SamplingParams(max_tokens=4))
    with pytest.raises(RequestError, match=r"^prompt must contain at least one token$"):
        llm.generate(prompt_token_ids=[[]])
    with pytest.raises(RequestError, match=r"^prompt token id 503 is out of range \[0, 503\)$"):
        llm.generate(prompt_token_ids=[[503]])
    assert llm.engine.num_free_blocks == 8 and not llm.engine.has_unfinished()


def test_logit_bias_forces_and_bans_tokens_as_transformers_logits_say(model_dirs, prompts):
    """+100 on a token makes greedy pick it at every step; -100 on the token transformers' greedy
    would pick makes the engine pick the best of the rest: the argmax of transformers' float64
    logits with the same bias added, step by step."""
    import torch

    from tests.model_factory import hf_logits, load_hf_reference

    path = model_dirs["llama-gqa2"]
    llm = LLM(model=str(path), dtype="float64", device="cpu", block_size=4, num_kv_blocks=64)
    free_before = llm.engine.num_free_blocks
    hf = load_hf_reference(path)
    greedy = dict(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    forced = llm.generate(prompt_token_ids=prompts[:2], sampling_params=SamplingParams(**greedy, logit_bias={7: 100}))
    assert [o.token_ids for o in forced] == [[7] * MAX_NEW, [7] * MAX_NEW]
    banned_id = hf_logits(hf, prompts[0])[-1].argmax().item()
    bias = {banned_id: -100, 11: 0.5}
    banned = llm.generate(prompt_token_ids=prompts[:1], sampling_params=SamplingParams(**greedy, logit_bias=bias))
    expected = []
    for _ in range(MAX_NEW):
        logits = hf_logits(hf, prompts[0] + expected)[-1].clone()
        for token_id, value in bias.items():
            logits[token_id] += value
        expected.append(int(torch.argmax(logits)))
    assert banned[0].token_ids == expected and banned_id not in expected
    assert llm.engine.num_free_blocks == free_before
