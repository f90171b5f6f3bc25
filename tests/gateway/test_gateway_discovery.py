"""Pools discovered from DNS (gateway/discovery.py, members.py): a resolver the test controls answers the
gateway's dns:/// names with fake services' addresses. Members added serve from the next lookup, members
removed finish their running streams and get nothing new, a flapping member keeps its stream, a failing
lookup keeps the last answer; every stream ends with the exact tokens and every request is counted where it
ran."""

import asyncio
import logging
import socket

import grpc
import httpx
import pytest

from splitserve.common.config_fields import ConfigError
from splitserve.gateway.config import GatewayConfig
from splitserve.gateway.discovery import DnsName, Member, PoolSpec, SystemResolver, parse_pool
from splitserve.gateway.members import Members
from splitserve.protos import common_pb2, generation_pb2, generation_pb2_grpc
from tests.gateway_fakes import FakeDecode, FakePrefill, FakeResolver, Stack, make_tokenizer_dir, parse_metrics

PREFILL_NAME, DECODE_NAME = "prefill.pool.test", "decode.pool.test"
POOLS = {"prefill": f"dns:///{PREFILL_NAME}:50061", "decode": f"dns:///{DECODE_NAME}:50071"}
# lookups every 0.05 s; health rounds never (an hour): what a test sees of a member comes from discovery
FAST = {"discovery_interval_s": 0.05, "health_interval_s": 3600.0}


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    return make_tokenizer_dir(str(tmp_path_factory.mktemp("tokenizer")))


def start(tokenizer_dir, prefills, decodes, answers, **overrides) -> tuple[Stack, FakeResolver]:
    resolver = FakeResolver(answers)
    stack = Stack(tokenizer_dir, prefills, decodes, {**POOLS, **FAST, **overrides}, rest=True, resolver=resolver)
    return stack.start(), resolver


def stub(stack: Stack) -> generation_pb2_grpc.GenerationStub:
    return generation_pb2_grpc.GenerationStub(grpc.insecure_channel(stack.grpc_target))


def generate(stack: Stack, text: str = "w20", max_tokens: int = 3):
    """A Generate stream (an iterator of messages)."""
    request = generation_pb2.GenerateRequest(text=text, sampling=common_pb2.SamplingParams(max_tokens=max_tokens))
    return stub(stack).Generate(request, timeout=30)


def tokens(messages) -> list[int]:
    return [t for m in messages for t in m.token_ids]


def after_next_lookups(stack: Stack, resolver: FakeResolver, host: str) -> None:
    """Return once a discovery round that began after now has ended: the second lookup from now began (a round
    resolves, applies, Describes the new members and only then sleeps before the next)."""
    seen = resolver.lookups[host]
    stack.wait_for(lambda: resolver.lookups[host] >= seen + 2, 10.0, f"two more lookups of {host}")


def addresses(instances) -> list[str]:
    return [i.address for i in instances]


def members_gauge(stack: Stack) -> dict[tuple[str, str], float]:
    text = httpx.get(stack.base_url + "/metrics", timeout=10).text
    return {
        (dict(labels)["pool"], dict(labels)["state"]): value
        for (name, labels), value in parse_metrics(text).items()
        if name == "splitserve:gateway_pool_members"
    }


def test_pool_entries_parse_and_malformed_names_are_refused_naming_the_flag():
    assert parse_pool("decode", ("10.0.0.1:50071", "dns:///decode.ns.svc:50071", "dns:///[::1]:7")) == PoolSpec(
        "decode", ("10.0.0.1:50071",), (DnsName("decode.ns.svc", 50071), DnsName("::1", 7))
    )
    with pytest.raises(ConfigError) as authority:
        GatewayConfig(prefill="dns://10.0.0.53/prefill.ns.svc:50061")
    assert str(authority.value) == (
        "--prefill entry 'dns://10.0.0.53/prefill.ns.svc:50061': only dns:///host:port is supported "
        "(no DNS server in the authority)"
    )
    for entry in ("dns:///decode.ns.svc", "dns:///decode.ns.svc:0", "dns:///:50071"):
        with pytest.raises(ConfigError) as no_port:
            GatewayConfig(decode=entry)
        assert str(no_port.value) == (f"--decode entry {entry!r}: expected dns:///host:port with a port in [1, 65535]")


def test_the_system_resolver_answers_ip_port_pairs():
    assert "127.0.0.1:50071" in SystemResolver().resolve("localhost", 50071)
    with pytest.raises(socket.gaierror):
        SystemResolver().resolve("no-such-host.invalid", 1)


def test_a_decode_the_name_lists_later_serves_from_the_next_lookup(tokenizer_dir):
    """decode-1 (more free KV, so the router prefers it) joins the name: a discovery round Describes it at once,
    so it serves right after that round, with no health round in between; the gauge counts both."""
    p, d0, d1 = FakePrefill(), FakeDecode("decode-0", free_blocks=100), FakeDecode("decode-1")
    stack, resolver = start(tokenizer_dir, [p], [d0, d1], {PREFILL_NAME: [p], DECODE_NAME: [d0]})
    try:
        registry = stack.gateway.registry
        assert stack.loop.call(lambda: addresses(registry.decodes())) == [d0.address]
        for _ in range(2):
            assert tokens(generate(stack)) == [21, 22, 23]
        resolver.answers[DECODE_NAME] = [d0, d1]
        after_next_lookups(stack, resolver, DECODE_NAME)
        assert stack.loop.call(lambda: [(i.address, i.up) for i in registry.decodes()]) == [
            (d0.address, True),
            (d1.address, True),
        ]
        assert members_gauge(stack) == {
            ("prefill", "up"): 1,
            ("prefill", "draining"): 0,
            ("prefill", "down"): 0,
            ("decode", "up"): 2,
            ("decode", "draining"): 0,
            ("decode", "down"): 0,
        }
        for text in ("w30", "w40", "w50"):
            first = int(text[1:]) + 1
            assert tokens(generate(stack, text)) == [first, first + 1, first + 2]
        assert (len(d0.requests), len(d1.requests), len(p.requests)) == (2, 3, 5)
    finally:
        stack.stop()


def test_a_decode_that_leaves_finishes_its_streams_and_gets_nothing_new(tokenizer_dir):
    p, d0, d1 = FakePrefill(), FakeDecode("decode-0"), FakeDecode("decode-1", free_blocks=100)
    stack, resolver = start(tokenizer_dir, [p], [d0, d1], {PREFILL_NAME: [p], DECODE_NAME: [d0, d1]})
    try:
        registry = stack.gateway.registry
        d0.hold = True  # its streams run until the test lets them step
        running = [generate(stack, text, max_tokens=4) for text in ("w20", "w60")]
        assert [list(next(s).token_ids) for s in running] == [[21], [61]]  # the prefill's first tokens
        stack.wait_for(lambda: len(d0.requests) == 2, what="both requests on decode-0")
        (leaving,) = [i for i in stack.loop.call(registry.decodes) if i.address == d0.address]
        resolver.answers[DECODE_NAME] = [d1]
        after_next_lookups(stack, resolver, DECODE_NAME)
        assert stack.loop.call(lambda: (addresses(registry.decodes()), registry.leaving)) == ([d1.address], [leaving])
        assert members_gauge(stack)[("decode", "draining")] == 1
        status = httpx.get(stack.base_url + "/ready", timeout=10).json()
        assert status["leaving"] == [{"address": d0.address, "pool": "decode", "running": 2}]
        for text in ("w30", "w40", "w50"):
            first = int(text[1:]) + 1
            assert tokens(generate(stack, text)) == [first, first + 1, first + 2]
        assert (len(d0.requests), len(d1.requests)) == (2, 3)
        d0.hold = False
        assert [tokens(s) for s in running] == [[22, 23, 24], [62, 63, 64]]
        stack.wait_for(lambda: not registry.leaving and leaving.closed, what="decode-0 drained and closed")
        stack.wait_for(lambda: not d0.running, what="decode-0's stream closed")
        assert d0.aborts == [] and d0.num_streams == 1
        assert stack.loop.call(lambda: stack.gateway.service.num_active) == 0
        gauge = members_gauge(stack)
        assert (gauge[("decode", "up")], gauge[("decode", "draining")]) == (1, 0)
    finally:
        stack.stop()


def test_a_prefill_that_leaves_during_a_prefill_call_answers_it(tokenizer_dir):
    """prefill-0 leaves while a Prefill call waits there: the call ends, the request decodes; the next one goes
    to prefill-1."""
    p0, p1, d = FakePrefill("prefill-0"), FakePrefill("prefill-1"), FakeDecode()
    p0.gate = asyncio.Event()
    p1.queued_tokens = 100  # more work queued there: the router picks prefill-0 while both are members
    stack, resolver = start(tokenizer_dir, [p0, p1], [d], {PREFILL_NAME: [p0, p1], DECODE_NAME: [d]})
    try:
        waiting = generate(stack, "w20")
        stack.wait_for(lambda: len(p0.requests) == 1, what="the Prefill call at prefill-0")
        resolver.answers[PREFILL_NAME] = [p1]
        after_next_lookups(stack, resolver, PREFILL_NAME)
        registry = stack.gateway.registry
        assert stack.loop.call(lambda: (addresses(registry.prefills()), addresses(registry.leaving))) == (
            [p1.address],
            [p0.address],
        )
        assert tokens(generate(stack, "w40")) == [41, 42, 43]
        stack.loop.call(p0.gate.set)
        assert tokens(waiting) == [21, 22, 23]
        assert (len(p0.requests), len(p1.requests), len(d.requests)) == (1, 1, 2)
        stack.wait_for(lambda: not registry.leaving, what="prefill-0 closed")
    finally:
        stack.stop()


def test_a_flapping_decode_keeps_its_stream_and_is_never_doubled(tokenizer_dir):
    """present, absent (a request meanwhile finds no decode), present: the same instance rejoins with its
    stream; the request it runs ends once, exactly. Absent long enough to drain, it rejoins as a new one."""
    p, d0 = FakePrefill(), FakeDecode("decode-0")
    stack, resolver = start(tokenizer_dir, [p], [d0], {PREFILL_NAME: [p], DECODE_NAME: [d0]})
    try:
        registry = stack.gateway.registry
        (first,) = stack.loop.call(registry.decodes)
        d0.hold = True
        running = generate(stack, "w20", max_tokens=4)
        assert list(next(running).token_ids) == [21]
        stack.wait_for(lambda: len(d0.requests) == 1, what="the request on decode-0")
        resolver.answers[DECODE_NAME] = []
        after_next_lookups(stack, resolver, DECODE_NAME)
        assert stack.loop.call(lambda: (registry.decodes(), registry.leaving)) == ([], [first])
        with pytest.raises(grpc.RpcError) as refused:
            list(generate(stack, "w30"))
        assert (refused.value.code(), refused.value.details()) == (
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            "no decode instance is up; retry later",
        )
        resolver.answers[DECODE_NAME] = [d0]
        after_next_lookups(stack, resolver, DECODE_NAME)
        assert stack.loop.call(lambda: (registry.decodes(), registry.leaving)) == ([first], [])
        assert stack.loop.call(lambda: first.up) and not first.closed
        d0.hold = False
        assert tokens(running) == [22, 23, 24]
        assert (len(d0.requests), d0.num_streams, d0.aborts) == (1, 1, [])
        # gone long enough to drain (nothing runs there): closed; listed again: a new instance, a new stream
        resolver.answers[DECODE_NAME] = []
        stack.wait_for(lambda: first.closed, what="decode-0 closed once drained")
        resolver.answers[DECODE_NAME] = [d0]
        after_next_lookups(stack, resolver, DECODE_NAME)
        (again,) = stack.loop.call(registry.decodes)
        assert again is not first and stack.loop.call(lambda: again.up)
        assert tokens(generate(stack, "w40")) == [41, 42, 43]
        assert (len(d0.requests), d0.num_streams) == (2, 2)
    finally:
        stack.stop()


def test_a_failing_lookup_keeps_the_last_members_and_is_logged_once(tokenizer_dir, caplog):
    caplog.set_level(logging.INFO, logger="splitserve.gateway")
    p, d0 = FakePrefill(), FakeDecode("decode-0")
    stack, resolver = start(tokenizer_dir, [p], [d0], {PREFILL_NAME: [p], DECODE_NAME: [d0]})
    try:
        registry = stack.gateway.registry
        resolver.answers[DECODE_NAME] = socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")
        for _ in range(3):
            after_next_lookups(stack, resolver, DECODE_NAME)
        assert stack.loop.call(lambda: (addresses(registry.decodes()), registry.leaving)) == ([d0.address], [])
        assert tokens(generate(stack)) == [21, 22, 23] and len(d0.requests) == 1
        resolver.answers[DECODE_NAME] = [d0]
        after_next_lookups(stack, resolver, DECODE_NAME)
        lines = [r.getMessage() for r in caplog.records if f"dns:///{DECODE_NAME}" in r.getMessage()]
        assert lines == [
            f"dns:///{DECODE_NAME}:50071 resolves to {d0.address}",
            f"DNS lookup of dns:///{DECODE_NAME}:50071 failed ([Errno -3] Temporary failure in name resolution); "
            "keeping its last 1 address(es) until it answers",
            f"DNS lookup of dns:///{DECODE_NAME}:50071 answers again: 1 address(es)",
        ]
    finally:
        stack.stop()


def test_a_name_that_never_resolved_is_named_in_the_readiness_answer(tokenizer_dir):
    p, d0 = FakePrefill(), FakeDecode("decode-0")
    stack, resolver = start(tokenizer_dir, [p], [d0], {PREFILL_NAME: [p]})
    try:
        r = httpx.get(stack.base_url + "/ready", timeout=10)
        assert r.status_code == 503
        assert f"decode dns:///{DECODE_NAME}:50071 lists no address (yet)" in r.text
        resolver.answers[DECODE_NAME] = [d0]
        stack.wait_for(lambda: stack.gateway.registry.ready(), 10.0, "ready once the name answers")
        assert tokens(generate(stack)) == [21, 22, 23]
    finally:
        stack.stop()


def test_a_leaving_decode_that_dies_fails_its_stream_with_an_error_and_is_closed(tokenizer_dir):
    p, d0, d1 = FakePrefill(), FakeDecode("decode-0"), FakeDecode("decode-1", free_blocks=100)
    stack, resolver = start(tokenizer_dir, [p], [d0, d1], {PREFILL_NAME: [p], DECODE_NAME: [d0, d1]})
    try:
        registry = stack.gateway.registry
        d0.hold = True
        running = generate(stack, "w20", max_tokens=4)
        assert list(next(running).token_ids) == [21]
        stack.wait_for(lambda: len(d0.requests) == 1, what="the request on decode-0")
        resolver.answers[DECODE_NAME] = [d1]
        after_next_lookups(stack, resolver, DECODE_NAME)
        stack.loop.run(stack.servers["decode-0"].stop())
        (last,) = list(running)
        assert (last.finish_reason, last.error.startswith("decode instance decode-0 failed: ")) == (
            common_pb2.FINISH_REASON_ERROR,
            True,
        )
        stack.wait_for(lambda: not registry.leaving, what="decode-0 closed")
        assert tokens(generate(stack, "w40")) == [41, 42, 43] and len(d1.requests) == 1
        assert stack.loop.call(lambda: stack.gateway.service.num_active) == 0
    finally:
        stack.stop()


def test_members_join_leave_rejoin_and_retire_only_when_idle():
    made = []
    members = Members(lambda address, options, server_name: made.append((address, server_name)) or object(), ())
    a, b = Member("10.0.0.1:50071", DECODE_NAME), Member("10.0.0.2:50071", DECODE_NAME)
    (first,) = members.apply("decode", [a])
    (second,) = members.apply("decode", [a, b])
    assert members.instances == [first, second] and addresses(members.instances) == [a.address, b.address]
    assert made == [(a.address, DECODE_NAME)] * 2 + [(b.address, DECODE_NAME)] * 2  # a request and a health channel
    first.in_flight = 1
    assert members.apply("decode", [b]) == [] and (members.leaving, first.leaving) == ([first], True)
    assert members.retire_idle() == []  # a request still runs there
    assert members.apply("decode", [a, b]) == [first] and (members.leaving, first.leaving) == ([], False)
    assert addresses(members.instances) == [b.address, a.address] and len(made) == 4  # the same instance rejoined
    members.apply("decode", [b])
    first.in_flight = 0
    assert members.retire_idle() == [first] and first.closed and members.leaving == []
    assert members.counts()[("decode", "down")] == 1  # b: never Described
