"""Parallel sampling in the engine (engine/forks.py): n sequences of one prompt whose KV is computed
once, shared by reference count, the partial last block copied. Exact tokens against separate
requests (float64, CPU), exact block accounting while the sequences run and after they end."""

import pytest

from splitserve.engine import LLM, SamplingParams
from tests.model_factory import make_tiny_model_dir

BLOCK = 4
NUM_BLOCKS = 64
PROMPT = [5, 17, 99, 3, 42, 7, 250, 11, 64, 8]  # 10 tokens: 2 full blocks before token 9, token 8 in a partial one
GREEDY = dict(temperature=0, max_tokens=6, ignore_eos=True)
SEEDED = dict(temperature=1.0, top_k=40, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("models"), name="llama-gqa2", arch="llama", num_kv_heads=2)


@pytest.fixture
def engine(model_dir):
    llm = LLM(model=str(model_dir), dtype="float64", device="cpu", block_size=BLOCK, num_kv_blocks=NUM_BLOCKS)
    return llm.engine


def run(engine, ids):
    """Step until every request ends; each id's tokens and finish reason."""
    tokens = {i: [] for i in ids}
    finish = {}
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id].extend(out.new_token_ids)
            if out.finished:
                finish[out.request_id] = out.finish_reason
    return tokens, finish


def separate(engine, params, seeds):
    """Each seed's tokens as a request of its own, one after the other (no sharing)."""
    out = []
    for i, seed in enumerate(seeds):
        engine.add_request(f"alone-{i}", PROMPT, SamplingParams(**params), seed=seed)
        out.append(run(engine, [f"alone-{i}"])[0][f"alone-{i}"])
        engine.pool.reset_prefix_cache()
    return out


def test_greedy_sequences_are_identical_and_equal_one_request(engine):
    (alone,) = separate(engine, GREEDY, [0])
    engine.add_request("r", PROMPT, SamplingParams(**GREEDY), fork_ids=["r~1", "r~2"], seed=0)
    tokens, finish = run(engine, ["r", "r~1", "r~2"])
    assert tokens == {"r": alone, "r~1": alone, "r~2": alone}
    assert finish == {"r": "length", "r~1": "length", "r~2": "length"}


def test_seeded_sequences_equal_separate_requests_with_the_derived_seeds(engine):
    """Sequence i is seeded seed + i (vLLM's derivation)."""
    expected = separate(engine, SEEDED, [100, 101, 102])
    assert len({tuple(t) for t in expected}) == 3  # the seeds do give different sequences
    engine.add_request("r", PROMPT, SamplingParams(**SEEDED), fork_ids=["r~1", "r~2"], seed=100)
    tokens, _ = run(engine, ["r", "r~1", "r~2"])
    assert [tokens["r"], tokens["r~1"], tokens["r~2"]] == expected


def test_blocks_are_the_shared_prompt_blocks_plus_each_sequences_own(engine):
    """After the prefill step: the parent holds 3 blocks (tokens 0-9); each child shares the 2 full
    ones (tokens 0-7) and has a copy of the partial third (token 8, then its own tokens)."""
    pool = engine.pool
    engine.add_request("r", PROMPT, SamplingParams(**GREEDY), fork_ids=["r~1", "r~2"], seed=0)
    engine.step()  # the prompt: the parent samples its first token, the children fork
    parent = engine.kv.blocks_of("r")
    children = [engine.kv.blocks_of("r~1"), engine.kv.blocks_of("r~2")]
    assert len(parent) == 3 and all(c[:2] == parent[:2] for c in children)
    assert len({c[2] for c in children} | {parent[2]}) == 3  # each partial block its own
    assert [pool.ref_counts[b] for b in parent] == [3, 3, 1]
    assert pool.num_blocks - pool.num_free_blocks == 3 + 2  # shared prompt blocks + one per child
    assert [engine.kv.blocks_of(c)[2] for c in ("r~1", "r~2")] == [c[2] for c in children]
    engine.step()  # the children compute token 9 into their copies; the parent its first output
    assert pool.num_blocks - pool.num_free_blocks == 3 + 2
    run(engine, ["r", "r~1", "r~2"])
    assert pool.num_free_blocks == NUM_BLOCKS and pool.ref_counts == [0] * NUM_BLOCKS


def test_abort_frees_every_block_and_children_outlive_an_early_parent(engine):
    pool = engine.pool
    engine.add_request("r", PROMPT, SamplingParams(**GREEDY), fork_ids=["r~1", "r~2"], seed=0)
    engine.step()
    assert engine.abort("r") and engine.abort("r~2")
    tokens, finish = run(engine, ["r~1"])
    assert finish == {"r~1": "length"} and len(tokens["r~1"]) == 6
    assert pool.num_free_blocks == NUM_BLOCKS
    # a parent aborted before its prompt ran: its children compute the prompt themselves
    (alone,) = separate(engine, GREEDY, [0])
    engine.add_request("q", PROMPT, SamplingParams(**GREEDY), fork_ids=["q~1"], seed=0)
    assert engine.abort("q")
    tokens, finish = run(engine, ["q~1"])
    assert tokens == {"q~1": alone} and finish == {"q~1": "length"}
    # a child aborted before it forked never runs
    engine.add_request("p", PROMPT, SamplingParams(**GREEDY), fork_ids=["p~1"], seed=0)
    assert engine.abort("p~1") and not engine.abort("p~1")
    tokens, _ = run(engine, ["p"])
    assert tokens["p"] == alone and pool.num_free_blocks == NUM_BLOCKS


def test_fork_ids_are_checked(engine):
    with pytest.raises(ValueError, match="fork ids must be distinct"):
        engine.add_request("r", PROMPT, SamplingParams(**GREEDY), fork_ids=["x", "x"])
    engine.add_request("r", PROMPT, SamplingParams(**GREEDY), fork_ids=["r~1"])
    with pytest.raises(ValueError, match="request_id 'r~1' is already in use"):
        engine.add_request("r~1", PROMPT, SamplingParams(**GREEDY))


def test_a_child_with_no_block_for_its_copy_computes_the_prompt_itself(model_dir):
    """3 blocks in all: the parent holds them when it forks, so the child waits and, once the parent is done,
    prefills from the prefix cache; its tokens are still the request's."""
    llm = LLM(model=str(model_dir), dtype="float64", device="cpu", block_size=BLOCK, num_kv_blocks=3)
    engine, params = llm.engine, dict(GREEDY, max_tokens=2)
    (alone,) = separate(engine, params, [0])
    engine.add_request("r", PROMPT, SamplingParams(**params), fork_ids=["r~1"], seed=0)
    (first,) = engine.step()  # the parent's first token; no block was free for the child's copy
    assert engine.kv.blocks_of("r~1") == [] and engine.pool.num_free_blocks == 0
    tokens, finish = run(engine, ["r", "r~1"])
    assert [*first.new_token_ids, *tokens["r"]] == tokens["r~1"] == alone
    assert finish == {"r": "length", "r~1": "length"}
    assert engine.pool.num_free_blocks == 3
