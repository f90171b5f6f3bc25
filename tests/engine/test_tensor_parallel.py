"""Tensor parallelism: the shard arithmetic, and TP 1, 2 and 4 engines against transformers in float64.

The engine tests start N - 1 rank processes each (forked from one server that imports torch once), so
they are marked slow and kept few: tiny models (4 query heads, vocabulary 503 so no rank's share is even),
block size 4, a handful of prompts.
"""

from __future__ import annotations

import json
import os
import signal
from types import SimpleNamespace

import pytest
import torch

from splitserve.common.sampling_params import SamplingParams
from splitserve.engine import LLM
from splitserve.engine.worker.loader import load_model
from splitserve.engine.worker.tensor_parallel import (
    TensorParallelError,
    check_shardable,
    kv_heads_of_rank,
    vocab_rows,
)
from tests.engine.test_engine_exact import make_prompts
from tests.engine.test_gpt_oss_exact import GPT_OSS, random_mxfp4
from tests.engine.test_moe_exact import MOE_MODELS
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


def test_experts_split_their_intermediate_rows_and_the_router_is_whole(tmp_path):
    """What each of 2 ranks loads of a mixture of experts (no processes: the loader reads only rank and size):
    every expert's gate and up rows [r F/2, (r+1) F/2) (gpt-oss: that run of its interleaved rows, with their
    biases), the matching columns of down, the router whole; gpt-oss's down bias on rank 0 only."""
    cases = {"qwen3moe-top2-dense1": MOE_MODELS["qwen3moe-top2-dense1"], "gpt-oss": GPT_OSS}
    for name, cfg in cases.items():
        path = make_tiny_model_dir(tmp_path, name=name, **cfg)
        full, config = load_model(path, dtype="float64", device="cpu")
        rows = config.moe.intermediate_size // 2
        ranks = [load_model(path, dtype="float64", device="cpu", tp=SimpleNamespace(rank=r, size=2))[0] for r in (0, 1)]
        whole, parts = full.model.layers[0].mlp, [net.model.layers[0].mlp for net in ranks]
        router = "router" if name == "gpt-oss" else "gate"
        for r, part in enumerate(parts):
            assert torch.equal(getattr(part, router).weight, getattr(whole, router).weight)
            mine = slice(r * rows, (r + 1) * rows)
            down = whole.experts.down_proj[:, :, mine]  # (E, H, F/2)
            if name == "gpt-oss":  # interleaved: rows g0 u0 g1 u1 ..., so a rank's pairs are one run
                gate_up = whole.experts.gate_up_proj[:, 2 * mine.start : 2 * mine.stop]
                bias = whole.experts.gate_up_proj_bias[:, 2 * mine.start : 2 * mine.stop]
                assert torch.equal(part.experts.gate_up_proj_bias, bias)
                assert (part.experts.down_proj_bias is None) == (r == 1)
            else:
                f = config.moe.intermediate_size
                gate_up = torch.cat(
                    (whole.experts.gate_up_proj[:, mine], whole.experts.gate_up_proj[:, f:][:, mine]), 1
                )
            assert torch.equal(part.experts.gate_up_proj, gate_up) and torch.equal(part.experts.down_proj, down)
        if name == "gpt-oss":
            assert torch.equal(parts[0].experts.down_proj_bias, whole.experts.down_proj_bias)


def test_mxfp4_experts_are_dequantized_then_split(tmp_path):
    """gpt-oss's MXFP4 experts under TP: each rank keeps its rows of the dequantized values (their blocks of 32
    run along the hidden size for gate_up and along the rows for down, so rank 1 takes whole blocks)."""
    from safetensors.torch import load_file, save_file

    path = make_tiny_model_dir(tmp_path, name="gpt-oss", **GPT_OSS)
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4"}
    (path / "config.json").write_text(json.dumps(config))
    tensors = load_file(str(path / "model.safetensors"))
    for i in range(2):
        for name, rows, k in (("gate_up_proj", 64, 64), ("down_proj", 64, 32)):  # output-major (E, rows, K)
            key = f"model.layers.{i}.mlp.experts.{name}"
            del tensors[key]
            tensors[key + "_blocks"], tensors[key + "_scales"] = random_mxfp4((4, rows, k), seed=10 * i + rows)
    save_file(tensors, str(path / "model.safetensors"))
    whole = load_model(path, dtype="float64", device="cpu")[0].model.layers[1].mlp.experts
    part = load_model(path, dtype="float64", device="cpu", tp=SimpleNamespace(rank=1, size=2))[0]
    experts = part.model.layers[1].mlp.experts
    assert torch.equal(experts.gate_up_proj, whole.gate_up_proj[:, 32:])  # interleaved rows of F 16..31
    assert torch.equal(experts.down_proj, whole.down_proj[:, :, 16:])


def test_experts_that_ranks_cannot_split_are_refused_naming_the_size():
    with pytest.raises(ValueError, match="^tensor_parallel_size 4 does not divide the experts' intermediate size 6$"):
        check_shardable(4, 2, 96, 4, 6)


# -- engines against transformers ------------------------------------------------------------------
# (model, tensor_parallel_size; TP 1 of the same models: test_engine_exact.py): GQA 2 sharded and
# replicated, MHA (group 1) sharded 4 ways, MQA on 4 ranks, qkv biases sharded with their rows,
# Qwen3's q/k norm with a tied (vocab-parallel) head
# Mixtures of experts (models of test_moe_exact.py and test_gpt_oss_exact.py): each expert's rows split over the
# ranks, Qwen3-MoE with a dense layer among sparse ones, Mixtral's float32 routing weights, gpt-oss's biased
# clamped-SwiGLU experts (the down bias on rank 0), sinks and sliding window
ALL_MODELS = {**TINY_MODELS, **MOE_MODELS, "gpt-oss": GPT_OSS}
CASES = [
    ("llama-gqa2", 2),
    ("llama-gqa2", 4),
    ("llama-mha-tied-llama3rope", 4),
    ("mistral-gqa4", 4),
    ("qwen2-bias", 2),
    ("qwen3-qknorm", 4),
    ("qwen3moe-top2-dense1", 2),
    ("mixtral-top2", 2),
    ("gpt-oss", 2),
]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp-models")
    names = {name for name, _ in CASES}
    return {name: make_tiny_model_dir(root, name=name, **ALL_MODELS[name]) for name in names}


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
        tensor_parallel_size=size,
        **{"max_num_batched_tokens": 48, **kwargs},
    )


@pytest.mark.slow
@pytest.mark.parametrize(("name", "size"), CASES, ids=[f"{name}-tp{size}" for name, size in CASES])
def test_greedy_tokens_equal_transformers(name, size, model_dirs, prompts, expected):
    with tp_llm(model_dirs[name], size) as llm:
        params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
        assert [o.token_ids for o in outs] == expected[name]
        heads = [tuple(kv_heads_of_rank(ALL_MODELS[name]["num_kv_heads"], size, r)) for r in range(size)]
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


@pytest.mark.slow
def test_fp8_quantized_shards_give_tp1_fp8_tokens(model_dirs, prompts):
    """--quantization fp8 at TP 2 (Qwen3-MoE: sparse layers 0 and 2, dense layer 1): each rank quantizes its
    shard, a row-parallel row (o_proj, down_proj, the experts' down) scaled as the whole row, so every rank holds
    TP 1's e4m3 values and scales. With every step W8A16 (at most 16 rows: activations unquantized) the tokens
    equal TP 1's; a W8A8 step quantizes a row-parallel input per token over the rank's columns, as vLLM does,
    which TP 1 does not match bit for bit."""
    fp8 = dict(quantization="fp8", fp8_w8a16_max_rows=16, max_num_batched_tokens=16)
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    tokens, split_rows = {}, {}
    for size in (1, 2):
        with tp_llm(model_dirs["qwen3moe-top2-dense1"], size, **fp8) as llm:
            tokens[size] = [o.token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=params)]
            assert llm.engine.num_free_blocks == NUM_BLOCKS
            sparse, dense = llm.engine.runner.model.model.layers[:2]  # rank 0's
            o_proj, experts, down = sparse.self_attn.o_proj, sparse.mlp.experts, dense.mlp.down_proj
            split_rows[size] = [
                (o_proj.weight_scale, o_proj.weight),  # (H,), (H, Hq D / size)
                (experts.down_scale, experts.down_proj),  # (E, H), (E, H, F / size)
                (down.weight_scale, down.weight),  # (H,), (H, F / size)
            ]
    assert tokens[2] == tokens[1]
    for (scale, weight), (whole_scale, whole) in zip(split_rows[2], split_rows[1]):
        assert torch.equal(scale, whole_scale)  # the whole rows' scales
        assert torch.equal(weight.float(), whole[..., : weight.shape[-1]].float())  # rank 0's columns of TP 1's
