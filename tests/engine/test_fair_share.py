"""Fair share in the scheduler: lower shares admitted, ordered and kept first; the largest share preempted first;
at most max_num_seqs requests a step; an import waiting for blocks holds them against larger shares — exact."""

from types import SimpleNamespace

from splitserve.engine.core_process import messages as m
from splitserve.engine.core_process.kv_scheduler import KvScheduler
from tests.engine.test_scheduler import req, run_step, setup


def shared(rid, n_prompt, share, **kwargs):
    request = req(rid, n_prompt, **kwargs)
    request.share = share
    return request


def imported(sched, rid, n_prompt, share, first=0):
    """A request whose prompt KV a decode imported: blocks held, prompt computed, first token in."""
    request = shared(rid, n_prompt, share, max_tokens=8, first=first)
    assert sched.kv.allocate_slots(request, n_prompt)
    request.num_computed_tokens = n_prompt
    request.append_output(7)
    sched.add_running(request)
    return request


def test_a_lower_share_is_admitted_before_larger_ones_that_came_first():
    sched = setup(max_seqs=2, budget=64)
    sched.add(shared("big-1", 2, share=32))
    sched.add(shared("big-2", 2, share=32))
    sched.add(shared("small", 2, share=1))
    assert run_step(sched)[0] == [("small", 0, 2), ("big-1", 0, 2)]
    assert [r.request_id for r in sched.waiting] == ["big-2"]


def test_a_share_comes_before_a_priority_the_caller_chose():
    sched = setup(policy="priority", max_seqs=1, budget=64)
    sched.add(shared("big", 2, share=9, priority=-100))
    sched.add(shared("small", 2, share=1, priority=5))
    assert run_step(sched)[0] == [("small", 0, 2)]


def test_a_step_runs_at_most_max_num_seqs_imported_requests_lower_shares_first():
    """Imports join the running batch past the cap (a decode cannot refuse a pulled KV); each step still runs at
    most max_num_seqs of them, lower shares first, arrival order within a share."""
    sched = setup(num_blocks=32, max_seqs=2, budget=64)
    for i, (rid, share) in enumerate((("big-1", 16), ("big-2", 16), ("big-3", 16), ("small", 1))):
        imported(sched, rid, 3, share, first=10 * i)
    assert run_step(sched)[0] == [("small", 3, 1), ("big-1", 3, 1)]
    assert run_step(sched)[0] == [("small", 4, 1), ("big-1", 4, 1)]
    assert len(sched.running) == 4


def test_a_waiting_lower_share_takes_a_seat_from_running_larger_shares():
    """max_num_seqs running requests of a large share fill every step; a request of a lower share arriving then is
    admitted in the next step (in front of them), and the running ones of the largest share give up the seat."""
    sched = setup(num_blocks=32, max_seqs=2, budget=64)
    sched.add(shared("big-1", 2, share=8, max_tokens=8))
    sched.add(shared("big-2", 2, share=9, max_tokens=8))
    assert run_step(sched)[0] == [("big-1", 0, 2), ("big-2", 0, 2)]
    sched.add(shared("small", 2, share=1))
    assert run_step(sched)[0] == [("small", 0, 2), ("big-1", 2, 1)]
    assert run_step(sched)[0] == [("small", 2, 1), ("big-1", 3, 1)]
    assert len(sched.running) == 3 and len(sched.waiting) == 0


def test_the_largest_share_is_preempted_first_whatever_its_age():
    sched = setup(num_blocks=4, budget=64)
    sched.add(shared("old", 7, share=9, max_tokens=8))  # 2 blocks
    sched.add(shared("new", 7, share=1, max_tokens=8, first=100))  # 2 blocks
    assert run_step(sched)[0] == [("new", 0, 7), ("old", 0, 7)]
    assert run_step(sched)[0] == [("new", 7, 1), ("old", 7, 1)]
    steps, out = run_step(sched)  # both need a third block for position 8; the pool has none
    assert [r.request_id for r in out.preempted] == ["old"]
    assert steps == [("new", 8, 1)]
    assert sched.waiting.peek().request_id == "old" and sched.num_preemptions == 1


def test_an_admitted_lower_share_preempts_a_larger_one_short_of_blocks():
    """`big` (share 9) holds every block and is not in this step (the cap of 1 goes to the lower share first):
    `small` (share 1) preempts it to be admitted; `big` waits until the blocks are back."""
    sched = setup(num_blocks=4, max_seqs=1, budget=64)
    sched.add(shared("big", 15, share=9, max_tokens=8))
    assert run_step(sched)[0] == [("big", 0, 15)]
    assert sched.kv.pool.num_free_blocks == 0
    sched.add(shared("small", 3, share=1, max_tokens=1, first=100))
    steps, out = run_step(sched)
    assert steps == [("small", 0, 3)] and [r.request_id for r in out.preempted] == ["big"]
    assert "small" not in sched.requests and sched.kv.pool.num_free_blocks == 4  # small ended (max_tokens 1)
    big = sched.waiting.peek()
    assert (big.request_id, big.num_computed_tokens, big.output_token_ids) == ("big", 0, [7])
    assert run_step(sched)[0] == [("big", 12, 4)]  # recomputed past its prompt's cached blocks, with its token


def test_an_import_waiting_for_blocks_holds_them_against_larger_shares():
    """While an import of share 2 waits for blocks: a waiting request of a larger share is not admitted, and
    make_room preempts running ones of larger shares, largest first, until the import fits; equal and lower shares
    keep running."""
    sched = setup(num_blocks=8, max_seqs=4, budget=64)
    for rid, share, first in (("low", 1, 0), ("equal", 2, 10), ("big", 5, 20), ("biggest", 7, 30)):
        imported(sched, rid, 7, share, first=first)  # 2 blocks each: the pool is full
    sched.add(shared("later", 2, share=3, first=40))
    sched.import_share = 2
    preempted = sched.make_room(3, share=2)  # the import needs 3 blocks: two requests' worth
    assert [r.request_id for r in preempted] == ["biggest", "big"]
    assert sched.kv.pool.num_free_blocks == 4
    steps, _ = run_step(sched)
    assert steps == [("low", 7, 1), ("equal", 7, 1)]  # no admission of shares above the import's
    assert sched.make_room(3, share=2) == []  # the blocks are there: nothing more
    sched.import_share = None
    assert [s[0] for s in run_step(sched)[0]] == ["low", "equal", "later"]  # no room left for `big`
    assert sched.kv.pool.num_free_blocks == 1 and [r.request_id for r in sched.waiting] == ["big", "biggest"]


class RoomEngine:
    """A decode engine for the KV scheduler: begin_import gives blocks (all cached here: nothing to pull) only to
    the ids in `fits`; every call is noted, and so is every make_room."""

    layout = "layout-a"
    config = SimpleNamespace(block_size=16)
    runner = SimpleNamespace(kv_cache="kv-cache")
    num_free_blocks = 0

    def __init__(self) -> None:
        self.fits: set[str] = set()
        self.tried: list[str] = []
        self.rooms: list[tuple[int, int]] = []
        self.pool = SimpleNamespace(num_blocks_freed=0)
        self.scheduler = SimpleNamespace(import_share=None, make_room=lambda n, share: self.rooms.append((n, share)))

    def begin_import(self, request_id, *args, share=0):
        self.tried.append(request_id)
        return ([7, 8], 2) if request_id in self.fits else None

    def import_blocks_needed(self, prompt_token_ids):
        return len(prompt_token_ids) // self.config.block_size

    def stats(self):
        return {}


def share_import(rid: str, share: int, num_tokens: int = 32) -> m.ImportKv:
    spec = m.PullSpec("shm", "p0", {}, [3, 4], [], num_tokens, "layout-a", request_id=rid)
    return m.ImportKv(rid, list(range(num_tokens)), None, 0, 5, None, 0, spec, share=share)


def test_imports_waiting_for_room_go_lower_shares_first_and_hold_the_room():
    """An import of a lower share is tried at once and asks the scheduler for room against larger shares; one of a
    larger or equal share queues behind the waiting ones; a freed block retries them lower shares first, up to the
    first that still does not fit (the blocks are held for it)."""
    engine, emitted = RoomEngine(), []
    kv = KvScheduler(engine, connector=None, emit=emitted.append, send_now=emitted.append)
    kv.add_import(share_import("big", 9))
    assert (engine.tried, engine.rooms, engine.scheduler.import_share) == (["big"], [(2, 9)], 9)
    kv.add_import(share_import("small", 1, num_tokens=64))  # lower: tried at once, and it holds the room now
    kv.add_import(share_import("big-2", 9))  # behind `big`: not tried
    kv.add_import(share_import("mid", 4))  # behind `small`: not tried
    assert engine.tried == ["big", "small"] and engine.rooms[-1] == (4, 1) and engine.scheduler.import_share == 1
    kv.retry_imports()
    assert engine.tried == ["big", "small"]  # nothing freed since: no try
    engine.pool.num_blocks_freed += 1
    engine.fits = {"small", "mid"}
    kv.retry_imports()  # small and mid import; big does not fit: big-2 (same share, later) is not tried
    assert engine.tried == ["big", "small", "small", "mid", "big"]
    assert [d.request_id for d in emitted if isinstance(d, m.ImportDone)] == ["small", "mid"]
    assert [w.request_id for w in kv.waiting_for_room] == ["big", "big-2"]
    assert engine.scheduler.import_share == 9 and engine.rooms[-1] == (2, 9)
