"""Tensor parallelism: the shard arithmetic, and TP 1, 2 and 4 engines against transformers in float64.

The engine tests start N - 1 rank processes each (forked from one server that imports torch once), so
they are marked slow and kept few: tiny models (4 query heads, vocabulary 503 so no rank's share is even),
block size 4, a handful of prompts.
"""

from __future__ import annotations

import os
import signal

import pytest

from splitserve.common.sampling_params import SamplingParams
from splitserve.engine import LLM
from splitserve.engine.worker.tensor_parallel import (
    TensorParallelError,
    check_shardable,
    kv_heads_of_rank,
    vocab_rows,
)
from tests.engine.test_engine_exact import make_prompts
from tests.model_factory import TINY_MODELS, hf_greedy, make_tiny_model_dir
from tests.service_harness import wait_until

MAX_NEW = 5
NUM_BLOCKS = 96


# -- shard arithmetic (no processes) ---------------------------------------------------------------
@pytest.mark.parametrize(
    ("num_kv_heads", "size", "expected"),
    [
        (4, 2, [range(0, 2), range(2, 4)]),  # sharded
        (2, 2, [range(0, 1), range(1, 2)]),
        (2, 4, [range(0, 1), range(0, 1), range(1, 2), range(1, 2)]),  # each head on 2 ranks
        (1, 4, [range(0, 1)] * 4),  # MQA: the one head everywhere
        (8, 1, [range(0, 8)]),
    ],
)
def test_kv_heads_of_each_rank(num_kv_heads, size, expected):
    assert [kv_heads_of_rank(num_kv_heads, size, rank) for rank in range(size)] == expected


def test_vocabulary_rows_pad_the_last_rank():
    # 503 rows over 4 ranks: 126 each, the last fills 125 and holds one zero row
    assert [vocab_rows(503, 4, rank) for rank in range(4)] == [
        (0, 126, 126),
        (126, 126, 126),
        (252, 126, 126),
        (378, 125, 126),
    ]
    assert vocab_rows(503, 1, 0) == (0, 503, 503)


@pytest.mark.parametrize(
    ("heads", "size", "message"),
    [
        ((4, 2, 96), 3, "tensor_parallel_size 3 does not divide num_attention_heads 4"),
        ((12, 4, 96), 6, "tensor_parallel_size 6 and num_key_value_heads 4: one must divide the other"),
        ((8, 2, 100), 8, "tensor_parallel_size 8 does not divide intermediate_size 100"),
    ],
)
def test_unshardable_models_are_refused_naming_the_field(heads, size, message):
    with pytest.raises(ValueError, match=f"^{message}$"):
        check_shardable(*heads, size)


def test_an_unshardable_model_refuses_at_start_with_no_rank_left(tmp_path):
    path = make_tiny_model_dir(tmp_path, "llama", num_kv_heads=2)
    with pytest.raises(ValueError, match="^tensor_parallel_size 3 does not divide num_attention_heads 4$"):
        LLM(model=str(path), dtype="float64", device="cpu", tensor_parallel_size=3, num_kv_blocks=8)


def test_a_mixture_of_experts_model_refuses_tensor_parallelism(tmp_path):
    path = make_tiny_model_dir(tmp_path, "qwen3_moe", num_kv_heads=2, moe_intermediate_size=24, intermediate_size=40)
    with pytest.raises(ValueError, match=r"^mixture-of-experts models do not support --tensor-parallel-size > 1 yet"):
        LLM(model=str(path), dtype="float64", device="cpu", tensor_parallel_size=2, num_kv_blocks=8)


# -- engines against transformers ------------------------------------------------------------------
# (model, tensor_parallel_size; TP 1 of the same models: test_engine_exact.py): GQA 2 sharded and
# replicated, MHA (group 1) sharded 4 ways, MQA on 4 ranks, qkv biases sharded with their rows,
# Qwen3's q/k norm with a tied (vocab-parallel) head
CASES = [
    ("llama-gqa2", 2),
    ("llama-gqa2", 4),
    ("llama-mha-tied-llama3rope", 4),
    ("mistral-gqa4", 4),
    ("qwen2-bias", 2),
    ("qwen3-qknorm", 4),
]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp-models")
    names = {name for name, _ in CASES}
    return {name: make_tiny_model_dir(root, name=name, **TINY_MODELS[name]) for name in names}


@pytest.fixture(scope="module")
def prompts():
    return make_prompts(n=6)


@pytest.fixture(scope="module")
def expected(model_dirs, prompts):
    return {name: hf_greedy(path, prompts, MAX_NEW) for name, path in model_dirs.items()}


def tp_llm(path, size: int, **kwargs) -> LLM:
    return LLM(
        model=str(path),
        dtype="float64",
        device="cpu",
        block_size=4,
        num_kv_blocks=NUM_BLOCKS,
        max_num_batched_tokens=48,
        tensor_parallel_size=size,
        **kwargs,
    )


@pytest.mark.slow
@pytest.mark.parametrize(("name", "size"), CASES, ids=[f"{name}-tp{size}" for name, size in CASES])
def test_greedy_tokens_equal_transformers(name, size, model_dirs, prompts, expected):
    with tp_llm(model_dirs[name], size) as llm:
        params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
        assert [o.token_ids for o in outs] == expected[name]
        heads = [tuple(kv_heads_of_rank(TINY_MODELS[name]["num_kv_heads"], size, r)) for r in range(size)]
        layout = llm.engine.layout  # rank 0's pool: its heads; the layout names every rank's
        assert (layout.num_kv_heads, layout.tensor_parallel_size, layout.rank_kv_heads) == (
            len(heads[0]),
            size,
            tuple(heads),
        )
        assert llm.engine.num_free_blocks == NUM_BLOCKS
        assert llm.engine.stats()["prefix_hit_tokens"] > 0  # the shared prefixes were reused on every rank


@pytest.mark.slow
def test_aborts_forks_and_seeded_sampling_match_tp1_and_free_every_block(model_dirs, prompts):
    """Sampling (seeded, on rank 0 from the gathered logits) equals TP 1's, forks (n = 3: a partial block
    copied on every rank) too; an abort mid-decode frees its blocks: the pool ends full on both."""
    results = {}
    for size in (1, 2):
        with tp_llm(model_dirs["qwen3-qknorm"], size) as llm:
            engine = llm.engine
            sampled = SamplingParams(temperature=1.0, seed=11, max_tokens=MAX_NEW, ignore_eos=True)
            engine.add_request("forked", prompts[0], sampled, fork_ids=["forked-1", "forked-2"])
            engine.add_request("aborted", prompts[1], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
            tokens: dict[str, list[int]] = {}
            while engine.has_unfinished():
                for out in engine.step():
                    tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
                    if out.request_id == "aborted" and len(tokens["aborted"]) == 3:
                        assert engine.abort("aborted")
            assert engine.num_free_blocks == NUM_BLOCKS
            results[size] = tokens
    assert results[2] == results[1]
    assert sorted(results[1]) == ["aborted", "forked", "forked-1", "forked-2"]
    assert len(results[1]["aborted"]) == 3


@pytest.mark.slow
def test_prompt_logprobs_match_tp1(model_dirs, prompts):
    """Prompt logprobs gather the logits of every prompt row on every rank: ranks and tokens equal TP 1's,
    values to float64 rounding (the all-reduces sum in another order)."""
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=2, logprobs=1, ignore_eos=True)
    got = {}
    for size in (1, 2):
        with tp_llm(model_dirs["llama-gqa2"], size) as llm:
            got[size] = llm.generate(prompt_token_ids=prompts[:2], sampling_params=params)
    for one, two in zip(got[1], got[2]):
        assert two.token_ids == one.token_ids and two.prompt_logprobs[0] is None
        for a, b in zip(one.prompt_logprobs[1:] + one.logprobs, two.prompt_logprobs[1:] + two.logprobs):
            assert (b.token_id, b.rank, [t for t, _ in b.top]) == (a.token_id, a.rank, [t for t, _ in a.top])
            assert b.logprob == pytest.approx(a.logprob, abs=1e-9)


@pytest.mark.slow
def test_a_rank_that_dies_fails_the_next_step_naming_it(model_dirs, prompts):
    with tp_llm(model_dirs["llama-gqa2"], 2) as llm:
        engine = llm.engine
        engine.add_request("r", prompts[0], SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True))
        engine.step()
        rank1 = engine.tp_workers.processes[0]
        os.kill(rank1.pid, signal.SIGKILL)
        wait_until(lambda: rank1.exitcode is not None, 10, "rank 1 did not exit after SIGKILL")
        dead = r"^tensor-parallel rank 1 of 2 exited \(exit code -9\)$"
        with pytest.raises(TensorParallelError, match=dead):
            engine.check_ranks()  # what the core loop asks every turn, idle or not
        with pytest.raises(TensorParallelError, match=dead):
            engine.step()
    assert llm.engine is None  # closed, nothing left running
    assert rank1.exitcode == -9
