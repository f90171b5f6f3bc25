"""Asynchronous scheduling: step N+1 is launched before step N is read, and the outputs are exactly the
synchronous loop's (greedy, seeded, logprobs, stop tokens, max_tokens, min_tokens, penalties, aborts in
flight, preemption, chunked prefill, the prefill role), with exact block accounting. CPU, float64 (ties
cannot flip); on CUDA the same comparison runs in tests/test_gpu_engine.py."""

from __future__ import annotations

import pytest
import torch

from splitserve.common.prefix_hash import extra_keys_for
from splitserve.common.sampling_params import SamplingParams
from splitserve.engine import LLM
from splitserve.engine.scheduling.block_pool import BlockPool
from splitserve.engine.scheduling.kv_cache_manager import KvCacheManager
from splitserve.engine.scheduling.request import Request, RequestStatus
from splitserve.engine.scheduling.scheduler import Scheduler
from tests.engine.test_engine_exact import make_prompts
from tests.model_factory import make_tiny_model_dir

NUM_BLOCKS = 96


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("async"), arch="qwen3", num_kv_heads=2, tie=True)


def make_llm(model_dir, async_scheduling: bool, **kwargs) -> LLM:
    options = dict(dtype="float64", device="cpu", block_size=4, num_kv_blocks=NUM_BLOCKS, max_num_seqs=8)
    options.update(kwargs)
    return LLM(model=str(model_dir), async_scheduling=async_scheduling, **options)


class LaunchLog:
    """Counts, per request, the tokens sampled by launched steps (read or discarded)."""

    def __init__(self, llm: LLM) -> None:
        self.sampled: dict[str, int] = {}
        runner = llm.engine.runner
        launch = runner.launch

        def counted(out, tables):
            for s in out.scheduled:
                if s.samples:
                    self.sampled[s.request.request_id] = self.sampled.get(s.request.request_id, 0) + 1
            return launch(out, tables)

        runner.launch = counted


def run_both(model_dir, prompts, params, **kwargs):
    """(sync outputs, async outputs, async launch log); both engines end with every block free."""
    results = []
    for lagged in (False, True):
        llm = make_llm(model_dir, lagged, **kwargs)
        log = LaunchLog(llm)
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
        assert llm.engine.async_scheduling is lagged
        assert llm.engine.num_free_blocks == llm.engine.pool.num_blocks and not llm.engine.has_unfinished()
        results.append((outs, log, llm))
    return results


def summary(outs, expected: bool = False):
    """Exact tokens, finish and stop reasons, and the logprobs' token ids; on the `expected` side the logprob
    values to 1e-9: a step's batch differs by the requests still in flight, and a matmul's sums follow the
    batch's shape."""

    def value(v):
        return pytest.approx(v, abs=1e-9) if expected else v

    return [
        (
            o.token_ids,
            o.finish_reason,
            o.stop_reason,
            None
            if o.logprobs is None
            else [(lp.token_id, value(lp.logprob), [(t, value(v)) for t, v in lp.top]) for lp in o.logprobs],
        )
        for o in outs
    ]


def test_greedy_seeded_logprobs_and_min_tokens_equal_the_sync_loop_under_chunked_prefill(model_dir):
    prompts = make_prompts(n=12)
    params = [
        SamplingParams(temperature=0, max_tokens=3 + i, ignore_eos=True)
        if i % 3 == 0
        else SamplingParams(temperature=0.9, top_k=40, top_p=0.95, seed=i, max_tokens=9, ignore_eos=True)
        if i % 3 == 1
        else SamplingParams(temperature=0.7, max_tokens=7, min_tokens=4, logprobs=2, ignore_eos=True)
        for i in range(12)
    ]
    (sync, _, _), (lagged, log, llm) = run_both(model_dir, prompts, params, max_num_batched_tokens=16)
    assert summary(lagged) == summary(sync, expected=True)
    assert [len(o.token_ids) for o in lagged] == [p.max_tokens for p in params]
    # ends by length are known ahead: no step computed a token past max_tokens
    assert [log.sampled[o.request_id] for o in lagged] == [p.max_tokens for p in params]
    assert llm.engine.scheduler.num_preemptions == 0


def test_a_stop_token_ends_the_request_and_the_token_computed_past_it_is_discarded(model_dir):
    prompts = make_prompts(n=6)[:6]
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    free_run = make_llm(model_dir, False).generate(prompt_token_ids=prompts, sampling_params=greedy)
    stops = [o.token_ids[3] for o in free_run]  # the 4th token of each greedy run becomes its stop token
    params = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop_token_ids=[t]) for t in stops]
    (sync, _, _), (lagged, log, _) = run_both(model_dir, prompts, params)
    assert summary(lagged) == summary(sync, expected=True)
    for o, free, stop in zip(lagged, free_run, stops):
        end = free.token_ids.index(stop) + 1
        assert o.token_ids == free.token_ids[:end] and o.finish_reason == "stop" and o.stop_reason == stop
        assert log.sampled[o.request_id] == end + 1  # one token past the stop was computed, never shown


def test_blocks_of_a_request_ended_at_the_lagged_read_are_freed_after_the_step_in_flight(model_dir):
    prompt = make_prompts(n=1)[0]
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    free_run = make_llm(model_dir, False).generate(prompt_token_ids=[prompt], sampling_params=greedy)
    first, stop = free_run[0].token_ids[:2]
    assert first != stop
    llm = make_llm(model_dir, True)
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop_token_ids=[stop])
    engine.add_request("r", prompt, params)
    seen: list[list] = []
    free_after: list[int] = []
    while engine.has_unfinished():
        seen.append([(o.new_token_ids, o.finished) for o in engine.step()])
        free_after.append(engine.num_free_blocks)
    # call 1 launches the prompt; each later call launches one step and reads the one before; the step
    # launched by call 3 computes position len + 1, past the stop that call 3 reads
    assert seen == [[], [([first], False)], [([stop], True)], []]
    n = len(prompt)
    assert free_after == [NUM_BLOCKS - -(-(n + k) // 4) for k in range(3)] + [NUM_BLOCKS]


def test_an_abort_while_its_step_is_in_flight_sends_nothing_more_and_frees_after_the_read(model_dir):
    prompts = make_prompts(n=4)[:4]
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    sync_outs = make_llm(model_dir, False).generate(prompt_token_ids=prompts, sampling_params=greedy)
    expected = [o.token_ids for o in sync_outs]
    engine = make_llm(model_dir, True).engine
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, greedy)
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(4)}
    for _ in range(4):
        for o in engine.step():
            tokens[o.request_id] += o.new_token_ids
    held = len(engine.kv.blocks_of("r1"))
    free = engine.num_free_blocks
    others = ("r0", "r2", "r3")
    before = sum(len(engine.kv.blocks_of(r)) for r in others)
    assert engine.abort("r1") and engine.scheduler.in_flight == {"r0", "r1", "r2", "r3"}
    assert engine.num_free_blocks == free  # the unread step writes r1's blocks: they wait for its read
    outs = engine.step()
    assert sorted(o.request_id for o in outs) == ["r0", "r2", "r3"]
    for o in outs:
        tokens[o.request_id] += o.new_token_ids
    taken = sum(len(engine.kv.blocks_of(r)) for r in others) - before
    assert engine.num_free_blocks == free + held - taken
    while engine.has_unfinished():
        for o in engine.step():
            assert o.request_id != "r1"
            tokens[o.request_id] += o.new_token_ids
    assert tokens["r1"] == expected[1][:3]
    assert [tokens[r] for r in others] == [expected[i] for i in (0, 2, 3)]
    assert engine.num_free_blocks == NUM_BLOCKS


def test_preemption_by_recompute_keeps_the_tokens_of_the_sync_loop(model_dir):
    prompts = make_prompts(n=8)[:8]
    params = [
        SamplingParams(temperature=0.8, seed=100 + i, max_tokens=24, ignore_eos=True)
        if i % 2
        else SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
        for i in range(8)
    ]
    (sync, _, sync_llm), (lagged, _, llm) = run_both(model_dir, prompts, params, num_kv_blocks=40)
    assert sync_llm.engine.scheduler.num_preemptions > 0 and llm.engine.scheduler.num_preemptions > 0
    assert summary(lagged) == summary(sync, expected=True)


def test_penalties_read_the_pending_tokens_first_and_equal_the_sync_loop(model_dir):
    prompts = make_prompts(n=4)[:4]
    params = [
        SamplingParams(temperature=0, repetition_penalty=1.3, frequency_penalty=0.4, max_tokens=10, ignore_eos=True),
        SamplingParams(temperature=0.8, seed=3, presence_penalty=0.7, max_tokens=10, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
        SamplingParams(temperature=0.5, seed=4, max_tokens=10, ignore_eos=True),
    ]
    (sync, _, _), (lagged, _, _) = run_both(model_dir, prompts, params)
    assert summary(lagged) == summary(sync, expected=True)


def test_the_prefill_role_hands_off_after_the_first_token_is_read(model_dir):
    prompts = make_prompts(n=5)[:5]
    params = SamplingParams(temperature=0.9, seed=11, max_tokens=8)
    first = {}
    for lagged in (False, True):
        engine = make_llm(model_dir, lagged, role="prefill", max_num_batched_tokens=24).engine
        for i, p in enumerate(prompts):
            engine.add_request(f"r{i}", p, params)
        outs = []
        while engine.has_unfinished():
            outs += engine.step()
        assert all(o.finish_reason == "prefilled" and len(o.new_token_ids) == 1 for o in outs)
        first[lagged] = {o.request_id: o.new_token_ids for o in outs}
        held = [engine.held_kv(f"r{i}")[0] for i in range(5)]
        assert [len(b) for b in held] == [-(-len(p) // 4) for p in prompts]  # the prompt's blocks, no more
        assert engine.num_free_blocks == NUM_BLOCKS - len({b for blocks in held for b in blocks})  # prefix shared
        for i in range(5):
            engine.release_kv(f"r{i}")
        assert engine.num_free_blocks == NUM_BLOCKS
    assert first[True] == first[False]


# -- the scheduler alone: exact block ids -------------------------------------------------------
def test_scheduler_frees_a_lagged_finish_only_when_the_step_in_flight_is_read():
    kv = KvCacheManager(BlockPool(16), 4, extra_keys_for("t"))
    sched = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64)
    params = SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[9])
    sched.add(Request("a", [1, 2, 3, 4, 5, 6, 7], params, seed=0, max_tokens=8))
    prefill = sched.schedule()
    sched.step_launched(prefill)
    decode = sched.schedule()  # launched before the prefill is read: its token is pending
    assert [(s.num_computed_tokens, s.num_new_tokens, s.samples) for s in decode.scheduled] == [(7, 1, True)]
    sched.step_launched(decode)
    assert kv.blocks_of("a") == [0, 1] and sched.requests["a"].num_pending_tokens == 2
    changed = sched.update_from_output(prefill, {"a": (9, None)})  # the stop token
    request = changed[0]
    assert request.status == RequestStatus.FINISHED_STOPPED and request.output_token_ids == [9]
    assert kv.pool.ref_counts[0] == kv.pool.ref_counts[1] == 1  # the decode step in flight still writes them
    assert kv.pool.num_free_blocks == 14
    assert sched.update_from_output(decode, {"a": (5, None)}) == []  # past the stop: discarded
    assert request.output_token_ids == [9] and request.num_pending_tokens == 0
    # tail first: block 1 to the empty list, block 0 (full, hashed) to the cached ones
    assert kv.pool.free_block_ids() == [*range(2, 16), 1, 0]
    assert sched.in_flight == set() and sched.num_unfinished == 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU default")
def test_async_scheduling_is_off_by_default_on_cpu_and_the_flag_turns_it_on(model_dir):
    assert make_llm(model_dir, None).engine.async_scheduling is False
    assert make_llm(model_dir, True).engine.async_scheduling is True


def test_decode_rows_longest_first_keep_every_output(model_dir, monkeypatch):
    """ModelRunner.LONGEST_FIRST (the default): a decode-only step's rows go to the device longest context first
    (the decode attention starts its programs in row order); every output is the scheduled order's, sync and
    async."""
    from splitserve.engine.worker.model_runner import ModelRunner

    assert ModelRunner.LONGEST_FIRST

    prompts = make_prompts(n=12)
    params = [
        SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2)
        if i % 2
        else SamplingParams(temperature=0.8, top_k=40, seed=i, max_tokens=5 + i % 4, ignore_eos=True)
        for i in range(12)
    ]
    monkeypatch.setattr(ModelRunner, "LONGEST_FIRST", False)
    base = make_llm(model_dir, False).generate(prompt_token_ids=prompts, sampling_params=params)
    monkeypatch.setattr(ModelRunner, "LONGEST_FIRST", True)
    steps = []  # per decode-only step of several rows: (scheduled order's lengths, the rows' lengths)
    for lagged in (False, True):
        llm = make_llm(model_dir, lagged)
        prepare = llm.engine.runner.prepare_inputs

        def recorded(out, tables, prepare=prepare):
            inputs = prepare(out, tables)
            if len(out.scheduled) > 1 and all(s.num_new_tokens == 1 for s in out.scheduled):
                steps.append(([s.num_computed_tokens + 1 for s in out.scheduled], inputs.meta.seq_lens_cpu))
            return inputs

        llm.engine.runner.prepare_inputs = recorded
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
        assert summary(outs) == summary(base, expected=True), f"async {lagged}"
        assert llm.engine.num_free_blocks == llm.engine.pool.num_blocks
    assert steps and all(rows == sorted(scheduled, reverse=True) for scheduled, rows in steps)
    assert any(scheduled != rows for scheduled, rows in steps), "no step was out of order: the test shows nothing"
