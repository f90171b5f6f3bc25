"""The gateway-wide counts (gateway/admission.py): what several gateway processes share holds exactly once.

Two `SharedCounts` opened on one file stand for two processes (each opens the file itself, so each holds its own
flock); the in-process gateway then runs the fair-share path over a `SharedCounts` as a process of several does.
"""

import asyncio
import random

import pytest

from splitserve.gateway.admission import LocalCounts, SharedCounts, caller_key, share_slots_for
from splitserve.gateway.errors import GatewayError
from splitserve.gateway.limits import RateLimiter
from tests.gateway.test_gateway_paths import check_shares
from tests.gateway.test_gateway_paths import tokenizer_dir as tokenizer_dir  # noqa: F401 (a fixture)
from tests.gateway_fakes import FakeDecode, FakePrefill, Stack


@pytest.fixture
def two_views(tmp_path):
    """Two views of one counts file (as two gateway processes have), a 16-slot callers table."""
    path = str(tmp_path / "counts")
    ids = ("anonymous", "key-a", "key-b")
    SharedCounts.create(path, 16, ids)
    views = [SharedCounts(path, 16, ids) for _ in range(2)]
    yield views
    for view in views:
        view.close()


def test_requests_in_flight_are_admitted_up_to_the_limit_over_both_views(two_views):
    a, b = two_views
    assert [a.try_admit(3), b.try_admit(3), a.try_admit(3)] == [-1, -1, -1]
    assert (b.try_admit(3), a.try_admit(3)) == (3, 3)  # full: how many run, nothing taken
    b.release()
    assert (a.num_active, b.try_admit(3), a.try_admit(3)) == (2, -1, 3)
    for view in (a, b, a):
        view.release()
    assert (a.num_active, b.num_active) == (0, 0)


def test_callers_sequences_match_one_process_counts_through_collisions_and_deletions(two_views):
    """Random adds and removals of 7 callers in a 16-slot table from both views (many probe runs cross and
    wrap): every count and every waiting_ahead equals a LocalCounts fed the same operations."""
    rng = random.Random(7)
    callers = [f"10.0.0.{i}:{rng.randrange(1 << 16)}" for i in range(7)]
    homes = {caller_key(c) & 15 for c in callers}
    assert len(homes) < len(callers)  # some share a home slot: the probing and backward shift are exercised
    local, held = LocalCounts(), {c: 0 for c in callers}
    for _ in range(600):
        caller = rng.choice(callers)
        n = rng.choice([1, 2, 3]) if held[caller] == 0 or rng.random() < 0.5 else -held[caller]
        held[caller] += n
        view = rng.choice(two_views)
        assert view.add_sequences(caller, n) == local.add_sequences(caller, n) == held[caller]
        share, waiting = rng.randrange(1, 8), rng.randrange(0, 40)
        assert view.waiting_ahead(share, waiting) == local.waiting_ahead(share, waiting)
        assert view.num_callers() == local.num_callers() == sum(1 for c in held.values() if c)
    for caller, count in held.items():
        if count:
            two_views[0].add_sequences(caller, -count)
    assert two_views[1].num_callers() == 0 and two_views[1].waiting_ahead(5, 9) == 9


def test_a_rate_limit_holds_once_for_both_views(two_views):
    """Burst 3 at 1 request/s per key: 3 requests of key-a pass whichever process takes them, the 4th waits 1 s;
    key-b has its own bucket; the refill is shared too."""
    now = [100.0]
    limiters = [RateLimiter(rps=1.0, burst=3, clock=lambda: now[0], counts=view) for view in two_views]
    for limiter in (limiters[0], limiters[1], limiters[0]):
        limiter.take_request("key-a")
    for limiter in limiters:
        with pytest.raises(GatewayError, match="more than 1 requests per second") as exc:
            limiter.take_request("key-a")
        assert exc.value.retry_after_s == 1
    limiters[1].take_request("key-b")
    now[0] += 1.0
    limiters[1].take_request("key-a")  # one refilled, taken by the other process
    with pytest.raises(GatewayError, match="more than 1 requests per second"):
        limiters[0].take_request("key-a")


def test_the_token_bucket_is_shared_and_its_refusal_names_what_is_left(two_views):
    now = [50.0]
    limiters = [RateLimiter(tokens_per_min=120, clock=lambda: now[0], counts=view) for view in two_views]
    limiters[0].take_tokens("anonymous", 50, 30, "max_tokens")
    with pytest.raises(GatewayError, match="needs 60 tokens and this API key has 40 of its 120 tokens per minute left"):
        limiters[1].take_tokens("anonymous", 20, 40, "max_tokens")


def test_share_slots_hold_twice_the_requests_in_flight():
    assert [share_slots_for(n) for n in (1, 8, 9, 1024)] == [16, 16, 32, 2048]


@pytest.mark.parametrize("with_keys", [False, True])
def test_shares_over_the_shared_counts_equal_one_process(tokenizer_dir, tmp_path, with_keys):  # noqa: F811
    """The fair-share path of test_gateway_paths, the gateway's counts in a shared file."""
    path, ids = str(tmp_path / "counts"), ("anonymous", "key-x", "key-y")
    SharedCounts.create(path, share_slots_for(1024), ids)
    prefill, decode = FakePrefill(), FakeDecode()
    prefill.gate = asyncio.Event()
    env = {"SPLITSERVE_API_KEYS": "k1,k2"} if with_keys else {}
    counts = SharedCounts(path, share_slots_for(1024), ids)
    stack = Stack(tokenizer_dir, [prefill], [decode], {}, rest=False, env=env, counts=counts).start()
    try:
        check_shares(stack, prefill, decode, with_keys)
        assert counts.num_active == 0
    finally:
        stack.stop()
        counts.close()
