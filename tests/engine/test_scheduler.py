"""Scheduler: token budget, chunked prefill, sequence cap, preemption, roles — exact."""

from splitserve.common.prefix_hash import extra_keys_for
from splitserve.common.sampling_params import SamplingParams
from splitserve.engine.scheduling.block_pool import BlockPool
from splitserve.engine.scheduling.kv_cache_manager import KvCacheManager
from splitserve.engine.scheduling.request import Request, RequestStatus
from splitserve.engine.scheduling.scheduler import Scheduler


def setup(num_blocks=16, block_size=4, budget=8, max_seqs=4, role="both", policy="fcfs"):
    kv = KvCacheManager(BlockPool(num_blocks), block_size, extra_keys_for("t"))
    return Scheduler(
        kv, max_num_seqs=max_seqs, max_num_batched_tokens=budget, max_model_len=64, role=role, policy=policy
    )


def req(rid, n_prompt, max_tokens=4, priority=0, first=0):
    return Request(
        request_id=rid,
        prompt_token_ids=list(range(first, first + n_prompt)),
        sampling_params=SamplingParams(max_tokens=max_tokens, ignore_eos=True),
        seed=0,
        max_tokens=max_tokens,
        priority=priority,
    )


def run_step(sched, token=7):
    out = sched.schedule()
    sampled = {s.request.request_id: (token, None) for s in out.scheduled if s.samples}
    sched.update_from_output(out, sampled)
    return [(s.request.request_id, s.num_computed_tokens, s.num_new_tokens) for s in out.scheduled], out


def test_long_prompt_is_chunked_and_decodes_keep_flowing():
    sched = setup(budget=8)
    sched.add(req("a", 3))
    sched.add(req("b", 13))
    assert run_step(sched)[0] == [("a", 0, 3), ("b", 0, 5)]
    assert run_step(sched)[0] == [("a", 3, 1), ("b", 5, 7)]
    # b's last prompt token and a's decode share the step; b samples its first token
    assert run_step(sched)[0] == [("a", 4, 1), ("b", 12, 1)]
    assert sched.requests["b"].output_token_ids == [7]
    assert sched.requests["a"].output_token_ids == [7, 7, 7]


def test_sequence_cap_holds_requests_in_the_queue():
    sched = setup(max_seqs=2, budget=64)
    for rid in "abc":
        sched.add(req(rid, 2))
    steps, _ = run_step(sched)
    assert [s[0] for s in steps] == ["a", "b"]
    assert len(sched.waiting) == 1


def test_finished_requests_free_every_block():
    sched = setup(budget=64)
    sched.add(req("a", 5, max_tokens=2))
    run_step(sched)
    run_step(sched)
    assert "a" not in sched.requests
    assert sched.kv.pool.num_free_blocks == 16


def test_preemption_by_recompute_when_blocks_run_out():
    sched = setup(num_blocks=4, budget=64)
    sched.add(req("old", 7, max_tokens=8))  # 2 blocks
    sched.add(req("new", 7, max_tokens=8, first=100))  # 2 blocks
    run_step(sched)  # both prefill: 7 tokens computed each, 4 blocks used
    assert run_step(sched)[0] == [("old", 7, 1), ("new", 7, 1)]  # position 7 still fits
    assert sched.kv.pool.num_free_blocks == 0
    steps, out = run_step(sched)
    # 'old' needs a third block for position 8: the newest request is preempted by recompute
    assert [r.request_id for r in out.preempted] == ["new"]
    assert steps == [("old", 8, 1)]
    new = sched.waiting.peek()
    assert new.request_id == "new" and new.num_computed_tokens == 0 and new.num_preemptions == 1
    assert new.token_ids == list(range(100, 107)) + [7, 7]  # keeps its output, recomputes it
    assert sched.num_preemptions == 1


def test_priority_policy_orders_waiting_requests():
    sched = setup(policy="priority", max_seqs=1, budget=64)
    sched.add(req("low", 2, priority=5))
    sched.add(req("high", 2, priority=1))
    steps, _ = run_step(sched)
    assert steps == [("high", 0, 2)]


def test_prefill_role_parks_requests_with_blocks_held():
    sched = setup(role="prefill", budget=64)
    sched.add(req("p", 9, max_tokens=4))
    steps, _ = run_step(sched)
    assert steps == [("p", 0, 9)]
    assert "p" not in sched.requests and sched.running == []
    assert sched.kv.blocks_of("p") == [0, 1, 2]
    assert sched.kv.pool.num_free_blocks == 13
    sched.kv.free("p")
    assert sched.kv.pool.num_free_blocks == 16


def test_abort_of_waiting_and_running_requests():
    sched = setup(max_seqs=1, budget=64)
    a, b = req("a", 5), req("b", 5)
    sched.add(a)
    sched.add(b)
    run_step(sched)
    sched.finish(a, RequestStatus.FINISHED_ABORTED)
    sched.finish(b, RequestStatus.FINISHED_ABORTED)
    assert sched.num_unfinished == 0 and sched.schedule().is_empty
    assert sched.kv.pool.num_free_blocks == 16
