"""The gateway takes a seat on a decode before it prefills a request (decode_service/seats.py), against fakes:
the prompt reaches the prefill only once the decode grants the seat; a request that leaves, times out, or loses
its decode while it waits gives the seat back, and goes to another decode or fails with 503."""

import re
from concurrent.futures import ThreadPoolExecutor

import grpc

from tests.gateway.test_gateway_paths import generate, make_stack, request, stub, summary, tokenizer_dir
from tests.gateway_fakes import FR, FakeDecode, FakePrefill

__all__ = ["make_stack", "tokenizer_dir"]  # fixtures


def test_the_prompt_goes_to_the_prefill_only_once_the_decode_grants_a_seat(make_stack):
    prefill, decode = FakePrefill(), FakeDecode()
    decode.grant_seats = False
    stack = make_stack([prefill], [decode])
    with ThreadPoolExecutor(1) as pool:
        answer = pool.submit(generate, stack, request(max_tokens=3))
        stack.wait_for(lambda: decode.seats_waiting, what="the seat reservation at the decode")
        assert prefill.requests == [] and decode.requests == []
        stack.loop.call(lambda: setattr(decode, "grant_seats", True))
        messages = answer.result(timeout=10)
    assert summary(messages) == ([21, 22, 23], " w21 w22 w23", FR.FINISH_REASON_LENGTH, "", "")
    (seat,), (sent,), (prefilled,) = decode.reserves, decode.requests, prefill.requests
    assert seat.request_id == sent.request_id == prefilled.request_id and seat.num_seqs == 1
    assert seat.share == sent.share == 1  # the caller's sequences in flight, this one
    assert 0 < seat.hold_ms <= 600_000 and sent.HasField("kv")  # the request's remaining time (request_timeout_s)
    assert decode.aborts == [] and decode.seats_waiting == []


def test_n_sequences_reserve_a_seat_each(make_stack):
    prefill, decode = FakePrefill(), FakeDecode()
    stack = make_stack([prefill], [decode])
    req = request(max_tokens=2)
    req.n = 3
    messages = generate(stack, req)
    assert sorted((m.index, tuple(m.token_ids)) for m in messages if m.token_ids) == [
        (0, (21,)),
        (0, (22,)),
        (1, (21,)),
        (1, (22,)),
        (2, (21,)),
        (2, (22,)),
    ]
    (seat,), (sent,) = decode.reserves, decode.requests
    assert (seat.request_id, seat.num_seqs) == (sent.request_id, 3) and len(sent.fork_ids) == 2


def test_a_client_that_leaves_while_waiting_for_a_seat_gives_it_back(make_stack):
    prefill, decode = FakePrefill(), FakeDecode()
    decode.grant_seats = False
    stack = make_stack([prefill], [decode])
    call = stub(stack).Generate(request(max_tokens=3), timeout=10)
    stack.wait_for(lambda: decode.seats_waiting, what="the seat reservation at the decode")
    call.cancel()
    stack.wait_for(lambda: decode.aborts, what="the reservation aborted")
    assert decode.aborts == [decode.reserves[0].request_id] and decode.seats_waiting == []
    (inst,) = stack.gateway.registry.decodes()
    stack.wait_for(lambda: stack.gateway.service.num_active == 0, what="the request to end")
    assert prefill.requests == [] and decode.requests == [] and inst.in_flight == 0


def test_a_request_past_its_deadline_while_waiting_for_a_seat_is_504_and_gives_the_seat_back(make_stack):
    prefill, decode = FakePrefill(), FakeDecode()
    decode.grant_seats = False
    stack = make_stack([prefill], [decode], request_timeout_s=0.5)
    try:
        generate(stack, request(max_tokens=3))
        raise AssertionError("the request did not time out")
    except grpc.RpcError as exc:
        code, details = exc.code(), exc.details()
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert re.fullmatch(r"request \S+ timed out after 0.5 s \(request_timeout_s or the client's deadline\)", details)
    stack.wait_for(lambda: decode.aborts, what="the reservation aborted")
    assert decode.seats_waiting == [] and prefill.requests == []


def test_a_request_waiting_at_a_decode_that_dies_goes_to_another_or_fails_with_503(make_stack):
    prefill, full, other = FakePrefill(), FakeDecode("decode-0"), FakeDecode("decode-1")
    full.grant_seats = other.grant_seats = False
    stack = make_stack([prefill], [full, other])
    with ThreadPoolExecutor(1) as pool:
        answer = pool.submit(generate, stack, request(max_tokens=3))
        stack.wait_for(lambda: full.seats_waiting or other.seats_waiting, what="the seat reservation")
        dying, living = (full, other) if full.seats_waiting else (other, full)
        stack.loop.call(lambda: setattr(living, "grant_seats", True))
        stack.loop.run(stack.servers[dying.name].stop())
        messages = answer.result(timeout=10)
    assert summary(messages) == ([21, 22, 23], " w21 w22 w23", FR.FINISH_REASON_LENGTH, "", "")
    assert [r.request_id for r in living.reserves] == [r.request_id for r in living.requests]
    assert len(prefill.requests) == 1 and dying.requests == []


def test_a_request_waiting_at_the_only_decode_when_it_dies_is_503(make_stack):
    prefill, decode = FakePrefill(), FakeDecode()
    decode.grant_seats = False
    stack = make_stack([prefill], [decode])
    with ThreadPoolExecutor(1) as pool:
        answer = pool.submit(generate, stack, request(max_tokens=3))
        stack.wait_for(lambda: decode.seats_waiting, what="the seat reservation")
        stack.loop.run(stack.servers["decode-0"].stop())
        try:
            answer.result(timeout=10)
            raise AssertionError("the request did not fail")
        except grpc.RpcError as exc:
            code, details = exc.code(), exc.details()
    assert code == grpc.StatusCode.UNAVAILABLE
    assert re.fullmatch(
        r"no decode instance compatible with prefill prefill-0 is up and not draining \(decode instance decode-0 "
        r"failed: .+\); retry later",
        details,
    ), details
    assert prefill.requests == []
