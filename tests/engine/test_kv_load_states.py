"""Every transition of an asynchronous KV load in a decode core, with exact tokens and exact block and lease
accounting. The request waits in WAITING_FOR_KV from ImportKv until its CommitImport:

    ImportKv ─▶ no room: waits for room (tried again after a free) ─▶ room ─▶ blocks allocated, pinned, pull started
    pull ends ─▶ ImportDone(ok) ─▶ lease released: CommitImport(ok) ─▶ runs          (test_core_loop: "finish")
                               └▶ lease lost:     CommitImport(not ok) ─▶ recompute | error       (here)
    pull fails ─▶ ImportDone(error) ─▶ recompute (test_core_loop) | error                       (here)
    past its deadline ─▶ ImportDone(error) at once, blocks pinned until it ends: recompute (test_core_loop) | error
                                                                                            (here)
    Abort: while the pull runs (test_core_loop), after it ended but before the commit, or while waiting for room
    (here); shutdown with a pull in flight (test_core_loop); drain (a SIGTERMed decode: tests/test_drain.py).
    Preemption: running requests are preempted around a load; its blocks stay its own (here).
    Forks (n > 1) of a load: recomputed with it, ended with it under policy fail, outliving it when it is aborted
    in flight; one aborted while its import waits for room never runs, the others go on (here; the commit:
    test_core_loop; waiting for a grammar: test_structured_output).

The prefill engine stands for the prefill service: a request it holds (`held`) is one under lease; the test
releases it where the decode service's ReleaseKv would. Block counts are the decode pool's free blocks.
"""

# ruff: noqa: F811 -- the fixtures (model, prefill, decode, device) are test_core_loop's, imported by name
import pytest

from splitserve.common.sampling_params import SamplingParams
from splitserve.engine.core_process import messages as m
from splitserve.engine.scheduling import kv_cache_manager
from tests.engine.test_core_loop import (  # noqa: F401 (fixtures)
    ENGINES,
    GREEDY,
    Gate,
    decode,
    device,
    engine_core,
    model,
    num_prompt_blocks,
    prefill,
    prefilled,
)


def counts(d) -> tuple[int, int, int]:
    """(free blocks, requests waiting for KV, running requests) of the decode core."""
    stats = d.stats()
    return stats["num_free_blocks"], stats["num_waiting_for_kv"], stats["num_running"]


def test_a_load_that_ends_holds_its_blocks_until_its_commit_then_runs_and_frees_them(model, prefill, decode, device):
    _, prompts, greedy = model
    gate = Gate()
    d = decode(gate)
    assert counts(d) == (d.baseline, 0, 0)
    x = prefilled(prefill, "x", prompts[0])
    n = num_prompt_blocks(prompts[0], device)
    d.send(x)
    d.until(lambda: gate.entered.is_set(), 10, "the pull never started")
    assert counts(d) == (d.baseline - n, 1, 0) and "x" in prefill[0].held  # pulling, under lease
    gate.gate.set()
    (done,) = d.until(lambda: d.done.get("x"), 10, "no ImportDone")
    assert (done.ok, done.num_blocks_pulled) == (True, n)
    assert counts(d) == (d.baseline - n, 1, 0)  # copied, unpinned, still waiting for the lease's verdict
    assert prefill[0].release_kv("x") and "x" not in prefill[0].held  # ReleaseKv: released
    d.send(m.CommitImport("x", ok=True))
    d.until(lambda: "x" in d.finished, 30, "x never finished")
    assert [x.first_token_id, *d.tokens["x"]] == greedy[0] and d.finished["x"].finish_reason == "length"
    assert counts(d) == (d.baseline, 0, 0)


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_a_lease_lost_after_the_copy_follows_the_policy(model, prefill, decode, device, policy):
    """The copy ended, but ReleaseKv answered not-held (the lease expired meanwhile): the copied blocks cannot be
    trusted. Recompute: the decode prefills the prompt itself, same tokens; fail: the request ends with an error."""
    _, prompts, greedy = model
    d = decode(Gate(opened=True))
    x = prefilled(prefill, "x", prompts[1])
    n = num_prompt_blocks(prompts[1], device)
    prefill[0].release_kv("x")  # the lease expired during the copy: the prefill may reuse the blocks
    d.send(x)
    (done,) = d.until(lambda: d.done.get("x"), 10, "no ImportDone")
    assert done.ok and counts(d) == (d.baseline - n, 1, 0) and "x" not in prefill[0].held
    d.send(m.CommitImport("x", ok=False, recompute=policy == "recompute"))  # what ReleaseKv(not held) leads to
    d.until(lambda: "x" in d.finished, 30, "x never finished")
    if policy == "recompute":
        assert [x.first_token_id, *d.tokens["x"]] == greedy[1] and d.finished["x"].finish_reason == "length"
    else:
        assert d.tokens["x"] == [] and d.finished["x"].finish_reason == "error"
        assert d.finished["x"].error == "KV lease was no longer valid after the copy"
    assert counts(d) == (d.baseline, 0, 0)


def test_a_failed_pull_under_policy_fail_ends_the_request_and_frees_its_blocks(model, prefill, decode, device):
    _, prompts, _ = model
    gate = Gate()
    d = decode(gate, fail=RuntimeError("injected: prefill gone"))
    x = prefilled(prefill, "x", prompts[2])
    n = num_prompt_blocks(prompts[2], device)
    d.send(x)
    d.until(lambda: gate.entered.is_set(), 10, "the pull never started")
    assert counts(d) == (d.baseline - n, 1, 0)
    gate.gate.set()
    (done,) = d.until(lambda: d.done.get("x"), 10, "no ImportDone")
    assert (done.ok, done.error) == (False, "KV pull from p0 failed: injected: prefill gone")
    assert counts(d) == (d.baseline - n, 1, 0)  # the copy ended (unpinned); the request waits for the verdict
    assert prefill[0].release_kv("x")  # the decode service releases the lease of a failed pull too
    d.send(m.CommitImport("x", ok=False, recompute=False))
    d.until(lambda: "x" in d.finished, 10, "x never ended")
    assert d.tokens["x"] == [] and d.finished["x"].finish_reason == "error"
    assert counts(d) == (d.baseline, 0, 0) and len(d.done["x"]) == 1


def test_an_abort_after_the_copy_before_the_commit_frees_the_blocks_and_the_late_commit_is_ignored(
    model, prefill, decode, device
):
    _, prompts, _ = model
    d = decode(Gate(opened=True))
    x = prefilled(prefill, "x", prompts[3])
    n = num_prompt_blocks(prompts[3], device)
    d.send(x)
    d.until(lambda: d.done.get("x"), 10, "no ImportDone")
    assert counts(d) == (d.baseline - n, 1, 0)
    d.send(m.Abort(["x"]))
    d.until(lambda: "x" in d.finished, 10, "no abort output")
    assert d.finished["x"].finish_reason == "abort" and counts(d) == (d.baseline, 0, 0)
    assert prefill[0].release_kv("x")  # the service releases the lease of a cancelled pull
    d.send(m.CommitImport("x", ok=True))  # crossed the abort: nothing happens
    assert counts(d) == (d.baseline, 0, 0) and d.tokens["x"] == [] and len(d.done["x"]) == 1


def waiting_for_room(model, prefill, decode, device, fork_ids=()):
    """`a` runs in a pool that holds its prompt's blocks and growth, and x's whole length alone (a request that
    cannot fit the pool by itself is refused at once), but not x's prompt beside `a`: x (with `fork_ids`) waits
    for room until `a` ends. Returns (driver, gate, x, a's greedy tokens)."""
    _, prompts, greedy = model
    block_size = ENGINES[device]["block_size"]
    x_blocks = num_prompt_blocks(prompts[0], device)
    x_whole = -(-(len(prompts[0]) + GREEDY.max_tokens) // block_size)
    num_blocks = max(x_whole, num_prompt_blocks(prompts[1], device) + x_blocks - 1)
    max_tokens = min(GREEDY.max_tokens, num_blocks * block_size - len(prompts[1]))  # a fits alone to its end
    params = GREEDY.__class__(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    x = prefilled(prefill, "x", prompts[0])  # before `a` starts: `a` must not end while x is prefilled
    x.fork_ids = list(fork_ids)
    gate = Gate(opened=True)
    d = decode(gate, num_kv_blocks=num_blocks)
    d.send(m.AddRequest("a", prompts[1], params))
    # with large blocks (16 on CUDA) `a` first grows until what is left cannot hold x's prompt
    d.until(lambda: len(d.tokens["a"]) >= 1 and counts(d)[0] < x_blocks, 10, "a never took the room x needs")
    seen = len(d.tokens["a"])
    d.send(x)
    d.until(lambda: len(d.tokens["a"]) >= seen + 2, 10, "a stopped")  # x's ImportKv was handled meanwhile
    assert counts(d)[1:] == (0, 1) and not gate.entered.is_set()  # x waits for room: nothing allocated
    return d, gate, x, greedy[1][:max_tokens]


def test_an_import_waiting_for_room_is_tried_again_only_after_a_block_is_freed(model, prefill, decode, device):
    """x waits for room while `a` runs (a allocates as it grows and frees nothing until it ends): the core tries
    x when it arrives and once more after `a` freed its blocks, not on every loop turn between; then x imports,
    pulls and gives its exact tokens."""
    from splitserve.engine.engine_core import EngineCore

    _, _, greedy = model
    tries = []
    begin_import = EngineCore.begin_import

    def counted(self, request_id, *args, **kwargs):
        started = begin_import(self, request_id, *args, **kwargs)
        tries.append((request_id, started is not None))
        return started

    EngineCore.begin_import = counted
    try:
        d, gate, x, a_tokens = waiting_for_room(model, prefill, decode, device)
        turns = d.stats()["num_steps"]
        d.until(lambda: d.done.get("x"), 30, "x never got room")
        assert d.stats()["num_steps"] - turns >= 3  # turns went by while x waited
        assert tries == [("x", False), ("x", True)]
        assert d.tokens["a"] == a_tokens and prefill[0].release_kv("x")
        d.send(m.CommitImport("x", ok=True))
        d.until(lambda: "x" in d.finished, 30, "x never finished")
        assert [x.first_token_id, *d.tokens["x"]] == greedy[0]
        assert counts(d) == (d.baseline, 0, 0)
    finally:
        EngineCore.begin_import = begin_import


def test_an_import_waiting_for_room_that_is_aborted_never_starts(model, prefill, decode, device):
    """x waits for room; aborted there, it ends (abort), never allocates, never pulls, and the room `a` leaves
    stays free."""
    d, gate, x, a_tokens = waiting_for_room(model, prefill, decode, device)
    d.send(m.Abort(["x"]))
    d.until(lambda: "a" in d.finished, 30, "a never finished")
    assert d.tokens["a"] == a_tokens and counts(d) == (d.baseline, 0, 0)
    assert not gate.entered.is_set() and "x" not in d.done  # never allocated, never pulled
    assert (d.finished["x"].finish_reason, d.tokens["x"]) == ("abort", [])
    assert prefill[0].release_kv("x")  # the service releases the lease of a cancelled pull


def test_running_requests_are_preempted_around_a_load_whose_blocks_stay_its_own(model, prefill, decode, device):
    """x's blocks are allocated and pinned while its pull waits; `a` and `b` run in the rest of the pool, which
    cannot hold both to the end: the scheduler preempts (recompute), never touching x's blocks. Every request's
    tokens are exact, x's too (its KV was neither overwritten nor reused), and every block comes back."""
    _, prompts, greedy = model
    block_size = ENGINES[device]["block_size"]
    final_a = -(-(len(prompts[1]) + GREEDY.max_tokens) // block_size)
    n = num_prompt_blocks(prompts[0], device)
    gate = Gate()
    d = decode(gate, num_kv_blocks=n + final_a + 2)
    x = prefilled(prefill, "x", prompts[0])
    d.send(x, m.AddRequest("a", prompts[1], GREEDY), m.AddRequest("b", prompts[3], GREEDY))  # one turn: x first
    d.until(lambda: {"a", "b"} <= d.finished.keys(), 60, "a and b never finished")
    assert [d.tokens["a"], d.tokens["b"]] == [greedy[1], greedy[3]]
    stats = d.stats()
    assert stats["num_preemptions"] >= 1  # the scenario's premise: the pool left beside x holds a or b, not both
    assert counts(d) == (d.baseline - n, 1, 0) and "x" in prefill[0].held  # x: still pulling, blocks intact
    gate.gate.set()
    d.until(lambda: d.done.get("x"), 10, "no ImportDone")
    assert prefill[0].release_kv("x")
    d.send(m.CommitImport("x", ok=True))
    d.until(lambda: "x" in d.finished, 30, "x never finished")
    assert [x.first_token_id, *d.tokens["x"]] == greedy[0]
    assert counts(d) == (d.baseline, 0, 0)


def test_a_pull_past_its_deadline_under_policy_fail_ends_the_request_and_its_blocks_wait_for_the_copy(
    model, prefill, decode, device
):
    """Timeout: the pull still runs at its deadline. ImportDone(error) comes then; the lease is still held until
    the service releases it; policy fail ends the request with the service's reason; the blocks the copy writes
    stay pinned until it ends, and only then come back, once."""
    _, prompts, _ = model
    gate = Gate()
    d = decode(gate)
    d.loop.connector.deadline_s = 0.3
    x = prefilled(prefill, "x", prompts[2])
    n = num_prompt_blocks(prompts[2], device)
    d.send(x)
    (done,) = d.until(lambda: d.done.get("x"), 10, "no ImportDone")
    assert gate.entered.is_set() and not gate.ended.is_set()
    assert (done.ok, done.error) == (
        False,
        "KV pull from p0 failed: the transfer did not end within 0.3 s (its blocks stay held until it does)",
    )
    assert counts(d) == (d.baseline - n, 1, 0) and "x" in prefill[0].held  # waiting for the verdict; under lease
    assert prefill[0].release_kv("x")  # the service releases the lease of a failed pull
    d.send(m.CommitImport("x", ok=False, recompute=False, error="KV pull from p0 failed: timed out"))
    d.until(lambda: "x" in d.finished, 10, "x never ended")
    assert (d.tokens["x"], d.finished["x"].finish_reason, d.finished["x"].error) == (
        [],
        "error",
        "KV pull from p0 failed: timed out",
    )
    assert counts(d) == (d.baseline - n, 0, 0)  # the request is gone; the copy still writes its blocks
    gate.gate.set()
    d.until(lambda: counts(d) == (d.baseline, 0, 0), 10, "the late copy's blocks were never freed")
    assert len(d.done["x"]) == 1  # its late end reports nothing more
    d.stop()
    assert sorted(d.loop.engine.pool.free_block_ids()) == list(range(ENGINES[device]["num_kv_blocks"]))


# -- forks (n > 1): the sequences of one request share its pulled KV (engine/forks.py) ---------------------------
FORKS = ["x~1", "x~2"]


def test_forks_end_with_a_load_that_fails_under_policy_fail(model, prefill, decode, device):
    """Policy fail: the decode prefills nothing of that prompt, for any sequence: the forks waiting for the KV end
    with the request's error; every block comes back."""
    _, prompts, _ = model
    d = decode(Gate(opened=True), fail=RuntimeError("injected: prefill gone"))
    x = prefilled(prefill, "x", prompts[1])
    x.fork_ids = list(FORKS)
    d.send(x)
    (done,) = d.until(lambda: d.done.get("x"), 10, "no ImportDone")
    assert not done.ok and counts(d) == (d.baseline - num_prompt_blocks(prompts[1], device), 1, 0)
    assert prefill[0].release_kv("x")
    d.send(m.CommitImport("x", ok=False, recompute=False, error=done.error))
    d.until(lambda: {"x", *FORKS} <= d.finished.keys(), 10, "not every sequence ended")
    ends = {rid: (d.tokens[rid], d.finished[rid].finish_reason, d.finished[rid].error) for rid in ("x", *FORKS)}
    assert ends == dict.fromkeys(("x", *FORKS), ([], "error", "KV pull from p0 failed: injected: prefill gone"))
    assert counts(d) == (d.baseline, 0, 0)


def test_forks_of_a_load_recomputed_by_policy_fork_from_the_recompute_with_the_exact_tokens(
    model, prefill, decode, device
):
    _, prompts, greedy = model
    d = decode(Gate(opened=True), fail=RuntimeError("injected: prefill gone"))
    x = prefilled(prefill, "x", prompts[0])
    x.fork_ids = list(FORKS)
    d.send(x)
    d.until(lambda: d.done.get("x"), 10, "no ImportDone")
    assert prefill[0].release_kv("x")
    d.send(m.CommitImport("x", ok=False, recompute=True))
    d.until(lambda: {"x", *FORKS} <= d.finished.keys(), 30, "not every sequence finished")
    assert [x.first_token_id, *d.tokens["x"]] == d.tokens["x~1"] == d.tokens["x~2"] == greedy[0]
    assert counts(d) == (d.baseline, 0, 0)


def test_forks_of_a_load_aborted_in_flight_compute_the_prompt_themselves(model, prefill, decode, device):
    """The request is aborted while its pull runs: its forks outlive it (engine/forks.py), each prefilling the
    prompt itself with the exact tokens; the aborted pull's blocks come back when the copy ends."""
    _, prompts, greedy = model
    gate = Gate()
    d = decode(gate)
    x = prefilled(prefill, "x", prompts[3])
    x.fork_ids = list(FORKS)
    d.send(x)
    d.until(lambda: gate.entered.is_set(), 10, "the pull never started")
    d.send(m.Abort(["x"]))
    d.until(lambda: {"x", *FORKS} <= d.finished.keys(), 30, "not every sequence ended")
    assert (d.finished["x"].finish_reason, d.tokens["x"]) == ("abort", [])
    assert d.tokens["x~1"] == d.tokens["x~2"] == greedy[3]
    assert counts(d) == (d.baseline - num_prompt_blocks(prompts[3], device), 0, 0)  # the copy still holds them
    gate.gate.set()
    d.until(lambda: counts(d) == (d.baseline, 0, 0), 10, "the aborted pull's blocks were never freed")
    assert not d.done and prefill[0].release_kv("x")


def test_a_fork_aborted_while_its_import_waits_for_room_never_runs(model, prefill, decode, device):
    _, prompts, greedy = model
    d, gate, x, a_tokens = waiting_for_room(model, prefill, decode, device, FORKS)
    d.send(m.Abort(["x~1"]))
    d.until(lambda: "x~1" in d.finished, 10, "no abort output for the fork")
    assert (d.finished["x~1"].finish_reason, d.tokens["x~1"]) == ("abort", [])
    d.until(lambda: d.done.get("x"), 30, "x never got room")  # `a` ended; x imported then, pulled once
    assert d.tokens["a"] == a_tokens and prefill[0].release_kv("x")
    d.send(m.CommitImport("x", ok=True))
    d.until(lambda: {"x", "x~2"} <= d.finished.keys(), 30, "x and x~2 never finished")
    assert [x.first_token_id, *d.tokens["x"]] == d.tokens["x~2"] == greedy[0]
    assert d.tokens["x~1"] == [] and [o.request_id for o in outputs(d) if o.request_id == "x~1"] == ["x~1"]
    assert counts(d) == (d.baseline, 0, 0)


def test_an_import_waiting_for_room_aborted_after_one_fork_leaves_the_other_to_run_alone(
    model, prefill, decode, device
):
    """The gateway aborts a request's sequences one by one: x~1 first, then x, while x waits for room. x and x~1
    end (abort) and never run; x~2, not aborted, prefills the prompt itself once `a` leaves room: exact tokens."""
    _, prompts, greedy = model
    d, gate, x, a_tokens = waiting_for_room(model, prefill, decode, device, FORKS)
    d.send(m.Abort(["x~1"]))
    d.send(m.Abort(["x"]))
    d.until(lambda: {"x", "x~1", "x~2", "a"} <= d.finished.keys(), 30, "not every request ended")
    assert {r: (d.finished[r].finish_reason, d.tokens[r]) for r in ("x", "x~1")} == dict.fromkeys(
        ("x", "x~1"), ("abort", [])
    )
    assert d.tokens["x~2"] == greedy[0] and d.tokens["a"] == a_tokens
    assert not gate.entered.is_set() and "x" not in d.done  # x never allocated, never pulled
    assert prefill[0].release_kv("x")  # the service releases the lease of a cancelled pull
    assert counts(d) == (d.baseline, 0, 0)


def outputs(d) -> list:
    return [o for b in d.received if isinstance(b, m.StepBatch) for o in b.outputs]


def test_an_imported_prompt_is_cached_under_the_hashes_its_lookup_computed(model, device, monkeypatch):
    """The core thread hashes an imported prompt once (its prefix lookup in begin_import), not again when the
    import commits; the blocks are cached under those hashes: a second import of the prompt finds every full
    block here and pulls only the partial last one."""
    _, prompts, _ = model
    prompt, block_size = prompts[0], ENGINES[device]["block_size"]
    engine = engine_core(model, device, "decode")
    baseline = engine.num_free_blocks
    calls = []
    real = kv_cache_manager.hash_full_blocks
    monkeypatch.setattr(kv_cache_manager, "hash_full_blocks", lambda *a: calls.append(len(a[0])) or real(*a))
    one = SamplingParams(temperature=0, max_tokens=1)
    blocks, num_local = engine.begin_import("x", prompt, one, 0, 5)
    assert num_local == 0 and len(blocks) == num_prompt_blocks(prompt, device)
    done = engine.finish_import("x")  # max_tokens 1: the first token ends it; its prompt blocks stay cached
    assert (done.finish_reason, calls) == ("length", [])  # nothing hashed again
    blocks_y, num_local_y = engine.begin_import("y", prompt, one, 0, 5)
    assert num_local_y == len(prompt) // block_size and blocks_y[:num_local_y] == blocks[:num_local_y]
    engine.abort("y")
    assert engine.num_free_blocks == baseline
