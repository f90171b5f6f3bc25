"""Registry pairing/readiness and Router choices, on hand-built instances (no RPCs), plus
the layout-mismatch refusal end to end against fake services."""

import asyncio
import logging
import time

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from splitserve.common.kv_layout import KvLayout
from splitserve.gateway.registry import Instance, Registry, describe_layout, layout_mismatch
from splitserve.gateway.router import Router
from splitserve.protos import common_pb2, generation_pb2, generation_pb2_grpc
from tests.gateway_fakes import (
    LAYOUT,
    FakeDecode,
    FakePrefill,
    FakeServer,
    LoopThread,
    Stack,
    fake_describe,
    make_tokenizer_dir,
)
from tests.tcp_proxy import TcpProxy

LAYOUT_TEXT = (
    "num_layers=2, num_kv_heads=2, head_dim=8, block_size={}, dtype=float32, model_id=tiny-fake, layout=block_major_v1"
)


def layout(**changes):
    out = common_pb2.KvLayout()
    out.CopyFrom(LAYOUT)
    for name, value in changes.items():
        setattr(out, name, value)
    return out


class _Link:
    alive = True


def instance(address, pool, role=None, *, lay=LAYOUT, free=1000, running=0, waiting=0, queued=0, start=1):
    role = role or pool
    load = common_pb2.Load(
        num_free_blocks=free, num_total_blocks=free, num_running=running, num_waiting=waiting, num_queued_tokens=queued
    )
    describe = fake_describe(f"{pool}@{address}", role, lay, 64, load, start)
    inst = Instance(address, pool, channel=None, describe=describe, reachable=True, error="")
    if pool == "decode":
        inst.link = _Link()
    return inst


def registry_of(*instances):
    registry = Registry([], [])
    registry.instances = list(instances)
    registry.update_pairs()
    return registry


def test_layout_text_matches_engine_kv_layout():
    a, b = layout(), layout(block_size=8)
    engine = [
        KvLayout(l.num_layers, l.num_kv_heads, l.head_dim, l.block_size, l.dtype, l.model_id, l.layout) for l in (a, b)
    ]
    assert describe_layout(a) == engine[0].describe() == LAYOUT_TEXT.format(4)
    assert layout_mismatch(a, b) == engine[0].mismatch(engine[1])
    assert layout_mismatch(a, layout()) is None


def test_mismatched_pair_is_refused_and_not_ready():
    p, d = instance("p:1", "prefill"), instance("d:1", "decode", lay=layout(block_size=8))
    registry = registry_of(p, d)
    assert registry.describe_mismatches() == [
        f"refusing to pair prefill prefill@p:1 (p:1) with decode decode@d:1 (d:1): KV layouts differ: "
        f"[{LAYOUT_TEXT.format(4)}] vs [{LAYOUT_TEXT.format(8)}]"
    ]
    assert not registry.ready() and Router(registry).pick_prefill() is None
    assert Router(registry).decode_candidates(p) == []


def test_a_colocated_worker_is_a_full_path():
    registry = registry_of(instance("w:1", "decode", "both"))
    assert registry.ready()
    assert registry_of(instance("d:1", "decode")).ready() is False


def test_role_must_fit_the_flag_that_lists_the_instance():
    d = instance("d:1", "decode", "prefill")
    assert not d.up and not registry_of(instance("p:1", "prefill"), d).ready()


def test_no_common_transport_is_refused():
    p, d = instance("p:1", "prefill"), instance("d:1", "decode")
    d.describe.transports[:] = ["nccl"]
    registry = registry_of(p, d)
    assert registry.pair_problem(p, d) == "no common KV transport: prefill serves ['shm'], decode pulls with ['nccl']"
    assert not registry.ready()


def tp_layout(size: int, *rank_heads: tuple[int, ...]):
    out = layout(num_kv_heads=len(rank_heads[0]) if rank_heads else 2, tensor_parallel_size=size)
    out.rank_kv_heads.extend(common_pb2.RankKvHeads(heads=heads) for heads in rank_heads)
    return out


def test_tensor_parallel_pairs_are_paired_over_shm_cuda_ipc_or_nccl_when_a_transfer_plan_maps_them():
    tp1, tp2 = tp_layout(1), tp_layout(2, (0,), (1,))
    for p_lay, d_lay in [(tp2, tp1), (tp1, tp2), (tp2, tp2)]:
        p, d = instance("p:1", "prefill", lay=p_lay), instance("d:1", "decode", lay=d_lay)
        assert registry_of(p, d).pair_problem(p, d) is None
        for transport in ("cuda_ipc", "nccl"):
            p.describe.transports[:] = d.describe.transports[:] = [transport]
            assert registry_of(p, d).pair_problem(p, d) is None
    p, d = instance("p:1", "prefill", lay=tp2), instance("d:1", "decode", lay=tp1)
    d.describe.transports[:] = ["nixl"]
    p.describe.transports[:] = ["shm", "nixl"]
    assert registry_of(p, d).pair_problem(p, d) == (
        f"KV of tensor-parallel instances moves over shm, cuda_ipc or nccl only (common transports: ['nixl']): "
        f"[{LAYOUT_TEXT.format(4).replace('num_kv_heads=2', 'num_kv_heads=1')}, tensor_parallel_size=2, "
        f"rank_kv_heads=[0][1]] vs [{LAYOUT_TEXT.format(4)}]"
    )
    other = tp_layout(2, (0,), (1,))
    other.head_dim = 16
    p, d = instance("p:1", "prefill", lay=other), instance("d:1", "decode", lay=tp1)
    assert registry_of(p, d).pair_problem(p, d).startswith("KV layouts cannot map (head_dim differ): prefill [")


def test_prefill_with_fewest_queued_tokens_then_fewest_waiting():
    d = instance("d:1", "decode")
    p1, p2, p3 = (
        instance("p:1", "prefill", queued=50, waiting=1),
        instance("p:2", "prefill", queued=20, waiting=3),
        instance("p:3", "prefill", queued=20, waiting=2),
    )
    router = Router(registry_of(p1, p2, p3, d))
    assert router.pick_prefill() is p3
    router.assign(p3, list(range(40)))  # 40 tokens sent since its last Describe
    assert router.pick_prefill() is p2
    p_other = instance("p:0", "prefill", lay=layout(head_dim=16))  # no compatible decode: never chosen
    assert Router(registry_of(p_other, p1, d)).pick_prefill() is p1


def test_prefill_prefix_affinity_weighs_cached_tokens_against_queued_ones():
    d = instance("d:1", "decode")
    p1, p2 = instance("p:1", "prefill"), instance("p:2", "prefill")
    router = Router(registry_of(p1, p2, d))
    shared = list(range(20, 32))  # 3 full blocks of 4: 12 tokens p2 will have cached
    assert router.pick_prefill(shared + [90]) is p1  # nothing cached anywhere: the tie goes to p1
    router.assign(p2, shared + [90])
    p2.pending_tokens = p2.pending_requests = 0  # as after the next Describe
    assert router.pick_prefill(shared + [91]) is p2  # 0 - 12 < 0
    p2.describe.load.num_queued_tokens = 11
    assert router.pick_prefill(shared + [91]) is p2  # 11 queued - 12 cached < 0 queued
    p2.describe.load.num_queued_tokens = 12
    assert router.pick_prefill(shared + [91]) is p1  # 12 - 12 = 0: the tie goes to p1
    assert router.pick_prefill() is p1  # no prompt given: load alone
    p2.describe.load.num_queued_tokens = 0
    router.assign(d, shared + [91])  # the decode that takes it does not take the prefill's affinity
    assert router.pick_prefill(shared + [92]) is p2
    assert router.pick_prefill(shared[:8] + [5, 5, 5, 5]) is p2  # 2 leading blocks in common: 8 tokens
    assert router.pick_prefill([1, 2, 3, 4] + shared) is p1  # the first block differs: nothing cached
    p2.describe.start_unix_ns = 2  # p2 restarted: its cache is cold
    assert router.pick_prefill(shared + [92]) is p1


def test_decode_with_most_free_blocks_minus_running():
    a, b = instance("a:1", "decode", free=100, running=10), instance("b:1", "decode", free=95, running=2)
    router = Router(registry_of(a, b))
    assert router.pick_decode([a, b], [9] * 3) is b  # 95 - 2 > 100 - 10


def test_a_burst_spreads_before_the_next_describe():
    a, b = instance("a:1", "decode"), instance("b:1", "decode")
    router = Router(registry_of(a, b))
    chosen = []
    for i in range(6):
        d = router.pick_decode([a, b], [10 + i] * 5)  # distinct 5-token prompts: 2 blocks each
        router.assign(d, [10 + i] * 5)
        chosen.append(d.address)
    assert chosen == ["a:1", "b:1"] * 3
    assert (a.in_flight, a.pending_blocks, b.in_flight) == (3, 6, 3)
    router.release(a)
    assert a.in_flight == 2


def test_a_request_that_runs_no_longer_counts_as_waiting():
    """Sent since the last Describe counts as waiting only until the request's first output (it runs then)."""
    d = instance("a:1", "decode", waiting=10)
    router = Router(registry_of(d), max_waiting_per_decode=13)
    assigned_at = []
    for i in range(3):
        assigned_at.append(d.num_describes)
        router.assign(d, [i] * 5)
    assert router.num_waiting(d) == 13 and not router.has_room(d)
    router.started(d, assigned_at[0])
    assert router.num_waiting(d) == 12 and router.has_room(d)
    d.pending_requests, d.num_describes = 0, d.num_describes + 1  # what the next Describe answer does
    router.started(d, assigned_at[1])  # counted by that Describe itself (running or waiting): nothing to undo
    assert (d.pending_requests, router.num_waiting(d)) == (0, 10)


def test_a_request_the_decode_runs_frees_its_waiting_place_at_the_gateway(tmp_path):
    """The gateway counts a request it sent to a decode as waiting there until its first decode output, not until
    the next Describe (none comes here: the health interval is an hour)."""
    decode = FakeDecode()
    decode.hold = True  # the request stays unstarted until the test lets the decode step
    stack = Stack(make_tokenizer_dir(str(tmp_path)), [FakePrefill()], [decode], {"health_interval_s": 3600.0})
    stack.start()
    try:
        (inst,) = stack.gateway.registry.decodes()
        stub = generation_pb2_grpc.GenerationStub(grpc.insecure_channel(stack.grpc_target))
        stream = stub.Generate(
            generation_pb2.GenerateRequest(text="w20", sampling=common_pb2.SamplingParams(max_tokens=4)), timeout=30
        )
        assert list(next(stream).token_ids) == [21]  # the prefill's first token
        stack.wait_for(lambda: len(decode.requests) == 1, what="the request at the decode")
        describes = stack.loop.call(lambda: inst.num_describes)
        assert stack.loop.call(lambda: (inst.pending_requests, inst.in_flight)) == (1, 1)
        decode.hold = False
        assert list(next(stream).token_ids) == [22]  # the decode's first output: it runs
        stack.wait_for(lambda: inst.pending_requests == 0, what="no longer counted as waiting")
        assert stack.loop.call(lambda: (inst.num_describes, inst.in_flight)) == (describes, 1)
        assert [t for m in stream for t in m.token_ids] == [23, 24]
    finally:
        stack.stop()


def test_a_prefilled_request_queues_at_a_full_decode_instead_of_failing(tmp_path):
    """Admitted while the decode had room, prefilled after it filled up: the request still goes to the decode
    (its first token is out, its KV held); the next request is refused at admission."""
    prefill, decode = FakePrefill(), FakeDecode()
    prefill.gate = asyncio.Event()
    overrides = {"health_interval_s": 3600.0, "max_waiting_per_decode": 4}
    stack = Stack(make_tokenizer_dir(str(tmp_path)), [prefill], [decode], overrides)
    stack.start()
    try:
        (inst,) = stack.gateway.registry.decodes()
        router = stack.gateway.router
        stub = generation_pb2_grpc.GenerationStub(grpc.insecure_channel(stack.grpc_target))
        sampling = common_pb2.SamplingParams(max_tokens=3)
        stream = stub.Generate(generation_pb2.GenerateRequest(text="w20", sampling=sampling), timeout=30)
        stack.wait_for(lambda: len(prefill.requests) == 1, what="the Prefill call")
        stack.loop.call(lambda: setattr(inst, "pending_requests", 4))  # four others went there meanwhile
        assert not stack.loop.call(lambda: router.has_room(inst))
        stack.loop.call(prefill.gate.set)
        messages = list(stream)
        assert [t for m in messages for t in m.token_ids] == [21, 22, 23] and len(decode.requests) == 1
        assert (messages[-1].finish_reason, messages[-1].error) == (common_pb2.FINISH_REASON_LENGTH, "")
        with pytest.raises(grpc.RpcError) as refused:
            list(stub.Generate(generation_pb2.GenerateRequest(text="w20", sampling=sampling), timeout=30))
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert refused.value.details().startswith("every decode instance is full (decode-0 has 4 waiting")
    finally:
        stack.stop()


def test_prefix_affinity_prefers_the_decode_that_served_the_leading_blocks():
    a, b = instance("a:1", "decode"), instance("b:1", "decode")
    router = Router(registry_of(a, b))
    shared = list(range(20, 32))  # 3 full blocks of 4
    router.assign(b, shared + [90])
    b.pending_blocks = b.in_flight = 0  # as after the next Describe
    assert router.pick_decode([a, b], shared + [91, 92]) is b  # 3 cached blocks beat the tie-break
    b.describe.load.num_free_blocks = 998
    assert router.pick_decode([a, b], shared + [91, 92]) is b  # 998 + 3 cached > 1000
    b.describe.load.num_free_blocks = 997
    assert router.pick_decode([a, b], shared + [91, 92]) is a  # 997 + 3 = 1000: the tie goes to a
    b.describe.load.num_free_blocks = 1000
    b.describe.start_unix_ns = 2  # b restarted: its cache is cold
    assert router.pick_decode([a, b], shared + [91, 92]) is a
    assert router.pick_decode([a, b], [7, 7, 7, 7]) is a


def test_layout_mismatch_end_to_end(tmp_path, caplog):
    caplog.set_level(logging.ERROR, logger="splitserve.gateway")
    prefill, decode = FakePrefill(), FakeDecode(layout=layout(block_size=8))
    stack = Stack(make_tokenizer_dir(str(tmp_path)), [prefill], [decode]).start()
    try:
        p, d = stack.servers["prefill-0"].address, stack.servers["decode-0"].address
        message = (
            f"refusing to pair prefill prefill-0 ({p}) with decode decode-0 ({d}): KV layouts differ: "
            f"[{LAYOUT_TEXT.format(4)}] vs [{LAYOUT_TEXT.format(8)}]"
        )
        assert stack.gateway.registry.describe_mismatches() == [message]
        assert [r.getMessage() for r in caplog.records if "refusing" in r.getMessage()] == [message]
        ready = httpx.get(stack.base_url + "/ready")
        assert ready.status_code == 503 and ready.json()["refused_pairs"] == [message]
        assert message in ready.json()["reason"]
        channel = grpc.insecure_channel(stack.grpc_target)
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
        assert health.status == health_pb2.HealthCheckResponse.NOT_SERVING
        # never through the mismatched pair: the decode prefills locally
        stub = generation_pb2_grpc.GenerationStub(channel)
        out = list(
            stub.Generate(
                generation_pb2.GenerateRequest(text="w20", sampling=common_pb2.SamplingParams(max_tokens=2)), timeout=5
            )
        )
        assert [t for m in out for t in m.token_ids] == [21, 22]
        assert prefill.requests == [] and not decode.requests[0].HasField("kv")
    finally:
        stack.stop()


def test_only_transport_failures_mark_an_instance_down(tmp_path):
    """The decode is reached through a TCP proxy that injects transport faults, on a loop of its
    own, and serves from a loop of its own. Its loop blocked 10 s (an instance swamped by a burst): Describe
    answers late again and again, past the old limit of 10 in a row, yet the decode stays up and the stream
    on it finishes. (Describe's deadline is 0.5 s: at 0.3 s the first stream once found the decode down on a
    loaded 2-core machine, likely a Describe late before any connection was up; the failure now names why.)
    Its connections held (a stopped process: pings unanswered): down within the ping timeout. Released: up.
    Its connections reset and refused (a dead process): down at once."""
    decode = FakeDecode(step_s=0.05)
    decode_loop = LoopThread()
    decode_server = FakeServer(decode)
    decode_loop.run(decode_server.start())
    proxy = TcpProxy(decode_server.address)
    overrides = {"decode": proxy.address, "health_interval_s": 0.1, "health_timeout_s": 0.5}
    stack = Stack(make_tokenizer_dir(str(tmp_path)), [FakePrefill()], [], {**overrides, "health_ping_timeout_s": 2.0})
    stack.start()
    try:
        registry = stack.gateway.registry
        (inst,) = registry.decodes()
        stack.wait_for(lambda: inst.up, what="decode up")
        stub = generation_pb2_grpc.GenerationStub(grpc.insecure_channel(stack.grpc_target))
        stream = stub.Generate(
            generation_pb2.GenerateRequest(text="w20", sampling=common_pb2.SamplingParams(max_tokens=6)), timeout=30
        )
        try:
            first = next(stream)
        except grpc.RpcError as exc:
            raise AssertionError(f"{exc.details()}; the decode's state: up {inst.up}, error {inst.error!r}") from exc
        assert list(first.token_ids) == [21]  # the prefill's first token, then the decode's
        decode_loop.loop.call_soon_threadsafe(time.sleep, 10.0)  # the decode's loop blocked: busy, not down
        ups = []
        stack.wait_for(
            lambda: ups.append((inst.up, inst.num_slow_describes)) or inst.num_slow_describes >= 11,
            timeout_s=15,
            what="11 late Describes in a row",
        )
        assert all(up for up, _ in ups) and registry.ready() and inst.link.alive, ups
        rest = list(stream)
        assert [t for m in rest for t in m.token_ids] == [22, 23, 24, 25, 26]
        assert rest[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
        stack.wait_for(lambda: inst.num_slow_describes == 0, timeout_s=10, what="a timely Describe again")

        proxy.hold()  # stopped: nothing moves, the connections stay open
        held = time.monotonic()
        stack.wait_for(lambda: not inst.up, timeout_s=10, what="marked down after an unanswered ping")
        assert time.monotonic() - held < 2.0 + 3.0, "later than the 2 s ping timeout allows"
        # how the transport failure shows depends on when it came: an unanswered ping ends the connection
        # under a Describe ("Stream removed (ping timeout)"), or the next connection gets no SETTINGS frame
        # ("failed to connect") or is not up within the Describe's deadline ("no live connection")
        assert inst.error.startswith("Describe failed: UNAVAILABLE") or "no live connection" in inst.error, inst.error
        proxy.release()
        stack.wait_for(lambda: inst.up, timeout_s=10, what="up again once bytes move")

        proxy.close()  # dead: connections reset, new ones refused
        closed = time.monotonic()
        stack.wait_for(lambda: not inst.up, timeout_s=5, what="marked down on the reset connection")
        assert time.monotonic() - closed < 1.0
        assert inst.error.startswith(("Describe failed: UNAVAILABLE", "decode stream broke")), inst.error
    finally:
        stack.stop()
        proxy.stop()
        decode_loop.run(decode_server.stop())
        decode_loop.close()


def test_health_checks_go_to_the_health_server_an_instance_advertises(tmp_path):
    """A service answers Describe on a server of its own too (never behind its queued request
    calls) and says where; the gateway asks there, and back at the main address once that one is gone."""
    prefill, health = FakePrefill(), FakePrefill()  # `health`: the same instance's Describe-only server
    stack = Stack(make_tokenizer_dir(str(tmp_path)), [prefill], [FakeDecode()], {"health_interval_s": 0.1}).start()
    try:
        (inst,) = stack.gateway.registry.prefills()
        health_server = FakeServer(health)
        stack.loop.run(health_server.start())
        prefill.health_address = health.health_address = health_server.address
        stack.wait_for(lambda: health.describes >= 1, what="a Describe at the health server")
        at_main = prefill.describes
        stack.wait_for(lambda: health.describes >= 5, what="more Describes at the health server")
        assert prefill.describes == at_main and inst.up and inst.health_address == health_server.address
        stack.loop.run(health_server.stop())  # gone (a restart moves it): refused, then the main address again
        prefill.health_address = ""
        stack.wait_for(lambda: prefill.describes > at_main and inst.up, timeout_s=5, what="up via the main address")
        assert inst.health_address == ""
    finally:
        stack.stop()
