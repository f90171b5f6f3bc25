"""Gateway request paths over gRPC against fake prefill/decode services (tests/gateway_fakes.py).

Prompt "hello world w20" is ids [6, 7, 20]; the fakes then generate 21, 22, 23, ... whose
text (after the prompt) is " w21 w22 w23 ...".
"""

import asyncio
import json

import grpc
import pytest

from splitserve.protos import common_pb2, generation_pb2, generation_pb2_grpc
from tests.gateway_fakes import FakeDecode, FakePrefill, Stack, fake_logprobs, make_tokenizer_dir
from tests.service_harness import wait_until

FR = common_pb2.FinishReason
PROMPT = "hello world w20"
PROMPT_IDS = [6, 7, 20]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    return make_tokenizer_dir(str(tmp_path_factory.mktemp("tokenizer")))


@pytest.fixture
def make_stack(tokenizer_dir):
    stacks = []

    def make(prefills=(), decodes=(), **overrides):
        stack = Stack(tokenizer_dir, list(prefills), list(decodes), overrides).start()
        stacks.append(stack)
        return stack

    yield make
    for stack in stacks:
        stack.stop()


def metrics_lines(stack) -> list[str]:
    import httpx

    return [line for line in httpx.get(stack.base_url + "/metrics").text.splitlines() if "status=" in line]


def stub(stack):
    return generation_pb2_grpc.GenerationStub(grpc.insecure_channel(stack.grpc_target))


def request(text=PROMPT, **sampling):
    stop = sampling.pop("stop", ())
    include = sampling.pop("include_stop_str_in_output", False)
    return generation_pb2.GenerateRequest(
        text=text, sampling=common_pb2.SamplingParams(**sampling), stop=stop, include_stop_str_in_output=include
    )


def generate(stack, req):
    return list(stub(stack).Generate(req, timeout=10))


def summary(messages):
    """(token ids, text, finish reason, stop_reason, error) of a whole stream."""
    last = messages[-1]
    assert all(not m.finish_reason for m in messages[:-1])
    return (
        [t for m in messages for t in m.token_ids],
        "".join(m.text for m in messages),
        last.finish_reason,
        last.stop_reason,
        last.error,
    )


def test_disaggregated_path_streams_prefill_token_then_decode_tokens(make_stack):
    prefill, decode = FakePrefill(cached_prompt_tokens=2), FakeDecode()
    stack = make_stack([prefill], [decode])
    messages = generate(stack, request(max_tokens=5, temperature=0.0))
    assert [list(m.token_ids) for m in messages] == [[21], [22], [23], [24], [25]]
    assert [m.text for m in messages] == [" w21", " w22", " w23", " w24", " w25"]
    assert messages[-1].finish_reason == FR.FINISH_REASON_LENGTH
    assert messages[-1].usage == common_pb2.Usage(prompt_tokens=3, completion_tokens=5, cached_prompt_tokens=2)
    first_t, last_t = messages[0].timings, messages[-1].timings
    assert (first_t.queue_ns, first_t.prefill_ns, first_t.total_ns > 0) == (1000, 2000, True)
    assert (last_t.queue_ns, last_t.prefill_ns, last_t.transfer_ns, last_t.decode_ns) == (1010, 2000, 300, 5000)
    # one PrefillRequest, then one DecodeRequest carrying the first token and the handle
    (pre,), (dec,) = prefill.requests, decode.requests
    assert list(pre.prompt_token_ids) == list(dec.prompt_token_ids) == PROMPT_IDS
    assert dec.first_token_id == 21 and dec.kv.lease.lease_id == f"lease-{pre.request_id}"
    assert list(dec.kv.block_ids) == [0] and dec.request_id == pre.request_id == stack.internal_id(
        messages[0].request_id
    )
    # no seed given: the gateway drew one 63-bit seed for both hops
    assert pre.seed == dec.seed == pre.sampling.seed == dec.sampling.seed and 0 <= pre.seed < 2**63
    assert prefill.released == []  # the decode owns the lease


def test_stream_interval_sends_the_first_output_alone_then_that_many_tokens_a_message(make_stack):
    """--stream-interval 3: the prefill's first token at once, then the decode's one-token steps in threes, the
    last message holding what is left when the request ends; colocated, the decode's first token at once."""
    stack = make_stack([FakePrefill()], [FakeDecode()], stream_interval=3)
    messages = generate(stack, request(max_tokens=8, temperature=0.0))
    assert [list(m.token_ids) for m in messages] == [[21], [22, 23, 24], [25, 26, 27], [28]]
    assert [m.text for m in messages] == [" w21", " w22 w23 w24", " w25 w26 w27", " w28"]
    assert [m.usage.completion_tokens for m in messages] == [1, 4, 7, 8]
    assert messages[-1].finish_reason == FR.FINISH_REASON_LENGTH
    worker = make_stack([], [FakeDecode("worker-0", role="both")], stream_interval=3)
    messages = generate(worker, request(max_tokens=5))
    assert [list(m.token_ids) for m in messages] == [[21], [22, 23, 24], [25]]


def test_given_seed_and_request_id_are_passed_to_both_hops(make_stack):
    prefill, decode = FakePrefill(), FakeDecode()
    stack = make_stack([prefill], [decode])
    req = request(max_tokens=2, seed=1234)
    req.request_id = "my-request"
    messages = generate(stack, req)
    assert {m.request_id for m in messages} == {"my-request"}  # the caller's id in its answers
    # on the internal hops the gateway's own suffix keeps ids from two gateways apart
    assert prefill.requests[0].request_id == decode.requests[0].request_id == stack.internal_id("my-request")
    assert stack.internal_id("my-request") == f"my-request@{stack.gateway.service.instance_tag}"
    assert (prefill.requests[0].seed, decode.requests[0].seed) == (1234, 1234)


def test_colocated_worker_takes_requests_without_prefill(make_stack):
    worker = FakeDecode("worker-0", role="both", cached_prompt_tokens=3)
    stack = make_stack([], [worker])
    messages = generate(stack, request(max_tokens=4))
    assert summary(messages) == ([21, 22, 23, 24], " w21 w22 w23 w24", FR.FINISH_REASON_LENGTH, "", "")
    (dec,) = worker.requests
    assert not dec.HasField("first_token_id") and not dec.HasField("kv")
    assert messages[-1].usage.cached_prompt_tokens == 3


def test_a_decode_that_cannot_take_a_request_now_is_503_with_retry_after(make_stack):
    """A decode draining or starting answers `unavailable`: the client gets UNAVAILABLE / 503 and Retry-After (a
    retry helps), never a 500; the prefill's blocks are released at once, not left to their lease."""
    import httpx

    worker = FakeDecode("worker-0", role="both")
    worker.unavailable = "worker-0 is draining"
    stack = make_stack([], [worker])
    with pytest.raises(grpc.RpcError) as info:
        generate(stack, request(max_tokens=4))
    assert (info.value.code(), info.value.details()) == (
        grpc.StatusCode.UNAVAILABLE,
        "decode instance worker-0: worker-0 is draining",
    )
    r = httpx.post(f"{stack.base_url}/v1/completions", json={"prompt": "w20", "max_tokens": 4}, timeout=10)
    assert (r.status_code, r.headers["retry-after"], r.json()["error"]["message"]) == (
        503,
        "1",
        "decode instance worker-0: worker-0 is draining",
    )
    prefill, decode = FakePrefill(), FakeDecode()
    decode.unavailable = "decode-0 is starting"
    stack = make_stack([prefill], [decode])
    with pytest.raises(grpc.RpcError) as info:
        generate(stack, request(max_tokens=4))
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    stack.wait_for(lambda: len(prefill.released) == 1, what="the handed blocks released")
    # over REST the prefill's first token is in hand when the decode refuses: still a 503, as JSON
    r = httpx.post(f"{stack.base_url}/v1/completions", json={"prompt": "w20", "max_tokens": 4}, timeout=10)
    assert (r.status_code, r.headers["retry-after"], r.json()["error"]["message"]) == (
        503,
        "1",
        "decode instance decode-0: decode-0 is starting",
    )
    stack.wait_for(lambda: len(prefill.released) == 2, what="the second request's blocks released")
    # streamed, the first token is out: the refusal is an error event, then [DONE]
    body = {"prompt": "w20", "max_tokens": 4, "stream": True}
    r = httpx.post(f"{stack.base_url}/v1/completions", json=body, timeout=10)
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    assert (r.status_code, r.text.endswith("data: [DONE]\n\n")) == (200, True)
    assert [e["choices"][0]["text"] for e in events[:-1]] == [" w21"]
    assert events[-1] == {
        "error": {
            "message": "decode instance decode-0: decode-0 is starting",
            "type": "service_unavailable_error",
            "param": None,
            "code": None,
        }
    }
    stack.wait_for(lambda: len(prefill.released) == 3, what="the streamed request's blocks released")
    body = {"input": "w20", "max_output_tokens": 4, "stream": True}
    r = httpx.post(f"{stack.base_url}/v1/responses", json=body, timeout=10)
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ")]
    assert (events[-1]["type"], events[-1]["response"]["error"]) == (
        "response.failed",
        {"code": "server_error", "message": "decode instance decode-0: decode-0 is starting"},
    )
    stack.wait_for(lambda: len(prefill.released) == 4, what="the Responses request's blocks released")


def test_a_prompt_prefilled_after_its_only_decode_left_is_503_and_its_blocks_freed(make_stack):
    """The only decode goes down while the prompt is prefilled: the REST client gets 503 with Retry-After (a retry
    helps), never a 500, and the prefill's blocks are released at once, not left to their lease."""
    from concurrent.futures import ThreadPoolExecutor

    import httpx

    prefill, decode = FakePrefill(), FakeDecode()
    prefill.gate = asyncio.Event()  # the prefill answers only once the decode is gone
    stack = make_stack([prefill], [decode])
    body = {"prompt": "w20", "max_tokens": 4}
    with ThreadPoolExecutor(1) as pool:
        answer = pool.submit(httpx.post, f"{stack.base_url}/v1/completions", json=body, timeout=20)
        stack.wait_for(lambda: len(prefill.requests) == 1, what="the prompt at the prefill")
        stack.loop.run(stack.servers["decode-0"].stop())
        (inst,) = stack.gateway.registry.decodes()
        stack.wait_for(lambda: not inst.up, what="the decode seen down")
        stack.loop.call(prefill.gate.set)
        r = answer.result(timeout=20)
    assert (r.status_code, r.headers["retry-after"], r.json()["error"]["message"]) == (
        503,
        "1",
        "no decode instance compatible with prefill prefill-0 is up and not draining; retry later",
    )
    stack.wait_for(lambda: len(prefill.released) == 1, what="the prefilled blocks released")
    assert decode.requests == []


def test_clients_that_leave_before_their_first_token_are_aborted_at_the_prefill(make_stack, caplog):
    """20 REST clients (streamed and not) give up after 0.3 s, and 5 gRPC calls reach their deadline, while their
    prefill is still running: each Prefill call is cancelled, none is handed to a decode, and the next request is
    served at once."""
    import asyncio
    import time

    import httpx

    prefill, decode = FakePrefill(), FakeDecode()
    prefill.gate = asyncio.Event()  # the prefill answers nothing until the test says so
    stack = make_stack([prefill], [decode])
    url = f"{stack.base_url}/v1/completions"
    with caplog.at_level("INFO"):
        for i in range(20):
            body = {"prompt": "w20", "max_tokens": 4, "stream": i % 2 == 1}
            with pytest.raises(httpx.ReadTimeout):
                httpx.post(url, json=body, timeout=httpx.Timeout(5.0, read=0.3))

        def counted_499() -> float:
            lines = [line for line in metrics_lines(stack) if line.startswith("splitserve:gateway_requests_total{")]
            return sum(float(line.split()[-1]) for line in lines if 'status="499"' in line)

        wait_until(lambda: counted_499() == 20, 10, lambda: f"{counted_499()} responses of 499, not 20")
    assert "Exception in ASGI application" not in caplog.text
    for _ in range(5):  # gRPC clients whose deadline passes before their first token
        with pytest.raises(grpc.RpcError) as info:
            list(stub(stack).Generate(request(max_tokens=4), timeout=0.3))
        assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    stack.wait_for(lambda: prefill.cancelled == 25, what="25 cancelled Prefill calls")
    stack.loop.call(prefill.gate.set)
    start = time.monotonic()
    r = httpx.post(url, json={"prompt": "w20", "max_tokens": 2}, timeout=10)
    assert (r.status_code, r.json()["choices"][0]["text"]) == (200, " w21 w22")
    assert time.monotonic() - start < 2.0
    assert len(prefill.requests) == 26 and len(decode.requests) == 1  # none of the 25 reached the decode


def test_a_client_that_leaves_before_its_forks_first_tokens_stops_every_sequence(make_stack):
    """n > 1: the lead's first token comes from the prefill, its forks' only from a decode step. REST clients of 4
    prompts x n=16 (streamed and not) leave while the decode produces nothing: each request's 64 sequences are
    aborted at the decode, none keeps running, and each answer is counted as a 499."""
    import httpx

    prefill, decode = FakePrefill(), FakeDecode()
    decode.hold = True  # the decode takes the sequences but produces no token
    stack = make_stack([prefill], [decode])
    url = f"{stack.base_url}/v1/completions"
    for i, streamed in enumerate((False, True)):
        body = {"prompt": ["w20"] * 4, "max_tokens": 8, "n": 16, "stream": streamed}
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(url, json=body, timeout=httpx.Timeout(5.0, read=0.3))
        stack.wait_for(lambda: len(decode.aborts) == 64 * (i + 1), what=f"{64 * (i + 1)} sequences aborted")
        stack.wait_for(lambda: decode.running == {}, what="no sequence running at the decode")
    assert len(decode.requests) == 8 and len(set(decode.aborts)) == 128
    assert sorted(decode.aborts) == sorted(
        [r.request_id for r in decode.requests] + [f for r in decode.requests for f in r.fork_ids]
    )
    lines = [line for line in metrics_lines(stack) if line.startswith("splitserve:gateway_requests_total{")]
    assert sum(float(line.split()[-1]) for line in lines if 'status="499"' in line) == 2
    stack.wait_for(lambda: stack.gateway.service.num_active == 0, what="request bookkeeping at zero")


def test_an_answer_that_could_outgrow_the_limit_is_refused_before_any_work(make_stack):
    """--max-answer-entries bounds prompts x sequences x (max_tokens + prompt tokens) x (1 + logprobs), summed over
    a batch of prompts, on REST and gRPC: 400 / INVALID_ARGUMENT naming the field and the limit, nothing sent to
    the prefill; a request under it is served."""
    import httpx

    prefill, decode = FakePrefill(), FakeDecode()
    stack = make_stack([prefill], [decode], max_answer_entries=2048)
    url = f"{stack.base_url}/v1/completions"
    body = {"prompt": ["w20"] * 4, "max_tokens": 16, "n": 4, "logprobs": 7}  # 4 x 4 x 16 x 8 = 2,048
    r = httpx.post(url, json=body, timeout=10)
    assert r.status_code == 200, r.text
    r = httpx.post(url, json={**body, "prompt": ["w20"] * 5}, timeout=10)  # 2,560
    assert (r.status_code, r.json()["error"]["param"], r.json()["error"]["message"]) == (
        400,
        "max_tokens",
        "the answer could hold 2,560 token entries (prompts x sequences x (max_tokens + prompt tokens with "
        "prompt_logprobs or echo) x (1 + logprobs)); at most 2,048 (--max-answer-entries): ask for fewer prompts, "
        "sequences, tokens or logprobs",
    )
    text = {"prompt": "w" * 300, "max_tokens": 40, "logprobs": 20, "prompt_logprobs": 20}  # 40 x 21 + 64 x 21
    r = httpx.post(url, json=text, timeout=10)  # the prompt counted as its 300 bytes, capped by the context (64)
    assert (r.status_code, r.json()["error"]["param"]) == (400, "prompt_logprobs")
    assert r.json()["error"]["message"].startswith("the answer could hold 2,184 token entries")
    many = request(max_tokens=40, logprobs=20)
    many.n = 16  # 16 x 40 x 21
    with pytest.raises(grpc.RpcError) as info:
        generate(stack, many)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details().startswith("the answer could hold 13,440 token entries")
    assert len(prefill.requests) == 4  # the one request under the limit: a Prefill per prompt (n forks later)


def test_a_request_that_could_ask_for_too_many_tokens_is_refused_before_any_work(make_stack):
    """--max-request-tokens bounds the sum over a request's prompts of sequences x min(prompt tokens + max_tokens,
    context) (a text prompt as its UTF-8 bytes), on REST and gRPC: 400 / INVALID_ARGUMENT naming the field and the
    limit, nothing sent to the prefill. A limit below the context (64 here) counts as the context."""
    import httpx

    prefill, decode = FakePrefill(), FakeDecode()
    stack = make_stack([prefill], [decode], max_request_tokens=256)
    url = f"{stack.base_url}/v1/completions"
    body = {"prompt": ["w20"] * 4, "max_tokens": 13, "n": 4}  # 4 x 4 x (3 bytes + 13) = 256
    r = httpx.post(url, json=body, timeout=10)
    assert (r.status_code, len(r.json()["choices"])) == (200, 16), r.text
    r = httpx.post(url, json={**body, "prompt": ["w20"] * 5}, timeout=10)
    assert (r.status_code, r.json()["error"]["param"], r.json()["error"]["message"]) == (
        400,
        "max_tokens",
        "the request could ask for 320 tokens (prompts x sequences x (prompt tokens + max_tokens), a sequence at "
        "most the context of 64); at most 256 (--max-request-tokens): ask for fewer prompts, sequences or tokens",
    )
    unset = {"messages": [{"role": "user", "content": "w20"}], "n": 5}  # no max_tokens: up to the context, 5 x 64
    r = httpx.post(f"{stack.base_url}/v1/chat/completions", json=unset, timeout=10)
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("the request could ask for 320 tokens ")
    many = request(max_tokens=61)
    many.n = 5  # 5 x min(15 bytes + 61, 64)
    with pytest.raises(grpc.RpcError) as info:
        generate(stack, many)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details().startswith("the request could ask for 320 tokens")
    assert len(prefill.requests) == 4  # the one request under the limit: a Prefill per prompt (n forks later)
    small = make_stack([FakePrefill()], [FakeDecode()], max_request_tokens=1)
    r = httpx.post(f"{small.base_url}/v1/completions", json={"prompt": "w20", "max_tokens": 61}, timeout=10)  # 64
    assert r.status_code == 200, r.text
    r = httpx.post(f"{small.base_url}/v1/completions", json={"prompt": "w20", "max_tokens": 61, "n": 2}, timeout=10)
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("the request could ask for 128 tokens ")


@pytest.mark.parametrize("with_keys", [False, True])
def test_each_request_carries_its_callers_sequences_in_flight_as_its_share(tokenizer_dir, with_keys):
    """The share on PrefillRequest and DecodeRequest is the caller's sequences in flight at admission, this
    request's included: per connection without API keys, per key with them (two connections of one key count
    together); it falls back as the requests end."""
    prefill, decode = FakePrefill(), FakeDecode()
    prefill.gate = asyncio.Event()
    env = {"SPLITSERVE_API_KEYS": "k1,k2"} if with_keys else {}
    stack = Stack(tokenizer_dir, [prefill], [decode], {}, rest=False, env=env).start()
    try:
        check_shares(stack, prefill, decode, with_keys)
    finally:
        stack.stop()


def check_shares(stack, prefill, decode, with_keys):
    key = lambda k: (("authorization", f"Bearer {k}"),) if with_keys else None  # noqa: E731
    # a connection each (channels to one target share their connection unless told not to)
    channels = [grpc.insecure_channel(stack.grpc_target, [("grpc.use_local_subchannel_pool", 1)]) for _ in range(3)]
    calls = []
    for rid, channel, k, n in (("a1", 0, "k1", 1), ("a2", 0, "k1", 3), ("b1", 1, "k2", 1), ("a3", 2, "k1", 2)):
        req = request(max_tokens=3)
        req.request_id, req.n = rid, n
        calls.append(generation_pb2_grpc.GenerationStub(channels[channel]).Generate(req, timeout=10, metadata=key(k)))
        stack.wait_for(lambda: len(prefill.requests) == len(calls), what=f"{rid}'s Prefill call")
    shares = {r.request_id.split("@")[0]: r.share for r in prefill.requests}
    # a3 comes on its own connection: a caller of its own without keys, k1's third request with them
    assert shares == {"a1": 1, "a2": 4, "b1": 1, "a3": 6 if with_keys else 2}
    stack.loop.call(prefill.gate.set)
    assert [len([m for m in call if m.finish_reason]) for call in calls] == [1, 3, 1, 2]
    assert {r.request_id.split("@")[0]: r.share for r in decode.requests} == shares
    stack.wait_for(lambda: stack.gateway.service.counts.num_callers() == 0, what="no sequence in flight")


def test_stop_string_across_tokens_ends_with_stop_and_aborts_the_decode(make_stack):
    decode = FakeDecode()
    stack = make_stack([FakePrefill()], [decode])
    # " w21 w22 w23": "2 w2" starts in token 22 and is completed by token 23
    messages = generate(stack, request(max_tokens=10, stop=["2 w2", "nope"]))
    assert summary(messages) == ([21, 22, 23], " w21 w2", FR.FINISH_REASON_STOP, "2 w2", "")
    assert messages[-1].usage.completion_tokens == 3
    stack.wait_for(lambda: decode.aborts == [stack.internal_id(messages[0].request_id)], what="AbortRequest")


def test_stop_string_kept_with_include_stop_str_in_output(make_stack):
    stack = make_stack([FakePrefill()], [FakeDecode()])
    messages = generate(stack, request(max_tokens=10, stop=["2 w2"], include_stop_str_in_output=True))
    assert summary(messages) == ([21, 22, 23], " w21 w22 w2", FR.FINISH_REASON_STOP, "2 w2", "")


def test_stop_string_in_the_first_token_releases_the_lease(make_stack):
    prefill, decode = FakePrefill(), FakeDecode()
    stack = make_stack([prefill], [decode])
    messages = generate(stack, request(max_tokens=10, stop=["w21"]))
    assert summary(messages) == ([21], " ", FR.FINISH_REASON_STOP, "w21", "")
    rid = stack.internal_id(messages[0].request_id)
    stack.wait_for(lambda: prefill.released == [(f"lease-{rid}", 7)], what="ReleaseKv")
    assert decode.requests == []


def test_first_token_that_finishes_never_reaches_a_decode(make_stack):
    prefill, decode = FakePrefill(), FakeDecode()
    stack = make_stack([prefill], [decode])
    messages = generate(stack, request(max_tokens=1))
    assert summary(messages) == ([21], " w21", FR.FINISH_REASON_LENGTH, "", "")
    assert decode.requests == [] and prefill.released == []  # no KV is held when the prefill finishes


def test_stop_token_id_names_the_token_in_stop_reason(make_stack):
    stack = make_stack([FakePrefill()], [FakeDecode()])
    messages = generate(stack, request(max_tokens=10, stop_token_ids=[23]))
    assert summary(messages) == ([21, 22, 23], " w21 w22 w23", FR.FINISH_REASON_STOP, "23", "")


def test_logprobs_flow_from_prefill_and_decode(make_stack):
    stack = make_stack([FakePrefill()], [FakeDecode()])
    messages = generate(stack, request(max_tokens=3, logprobs=2))
    assert [lp for m in messages for lp in m.logprobs] == [fake_logprobs(t, 2) for t in (21, 22, 23)]


def test_client_cancel_sends_abort_to_the_decode(make_stack):
    decode = FakeDecode()
    stack = make_stack([FakePrefill()], [decode])
    call = stub(stack).Generate(request(max_tokens=50), timeout=10)
    first = next(call)
    assert list(first.token_ids) == [21]
    next(call)  # the decode is streaming
    call.cancel()
    stack.wait_for(lambda: decode.aborts == [stack.internal_id(first.request_id)], what="AbortRequest after cancel")
    service, (inst,) = stack.gateway.service, stack.gateway.registry.decodes()
    stack.wait_for(lambda: service.num_active == 0 and inst.in_flight == 0, what="request bookkeeping at zero")


def test_client_cancel_during_prefill_never_reaches_the_decode(make_stack):
    """The request never reaches the decode; the seat it took there before its prefill is given back."""
    prefill, decode = FakePrefill(), FakeDecode()
    prefill.delay_s = 1.0
    stack = make_stack([prefill], [decode])
    call = stub(stack).Generate(request(max_tokens=5), timeout=10)
    stack.wait_for(lambda: len(prefill.requests) == 1, what="the Prefill call")
    call.cancel()
    stack.wait_for(lambda: stack.gateway.service.num_active == 0, what="the request to end")
    stack.wait_for(lambda: decode.aborts, what="the seat reservation aborted")
    assert [r.request_id for r in decode.reserves] == decode.aborts == [prefill.requests[0].request_id]
    assert decode.requests == [] and decode.seats_waiting == []


def test_prefill_failure_falls_back_to_a_local_prefill_on_the_decode(make_stack):
    prefill, decode = FakePrefill(), FakeDecode()
    prefill.fail_code = grpc.StatusCode.UNAVAILABLE
    stack = make_stack([prefill], [decode])
    messages = generate(stack, request(max_tokens=4))
    assert summary(messages) == ([21, 22, 23, 24], " w21 w22 w23 w24", FR.FINISH_REASON_LENGTH, "", "")
    (dec,) = decode.requests
    assert not dec.HasField("kv") and not dec.HasField("first_token_id")
    (inst,) = stack.gateway.registry.prefills()
    assert inst.error == "prefill instance prefill-0 failed: UNAVAILABLE: injected prefill failure"
    prefill.fail_code = None  # Describe still answers: the next health round brings it back
    stack.wait_for(lambda: inst.up, what="the prefill to be up again")
    generate(stack, request(max_tokens=2))
    assert len(prefill.requests) == 2 and decode.requests[-1].HasField("kv")


def test_prefill_refusing_the_request_is_the_clients_error(make_stack):
    prefill = FakePrefill()
    prefill.fail_code = grpc.StatusCode.INVALID_ARGUMENT
    stack = make_stack([prefill], [FakeDecode()])
    with pytest.raises(grpc.RpcError) as info:
        generate(stack, request(max_tokens=4))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details() == "prefill instance prefill-0 refused the request: injected prefill failure"


def test_two_decodes_both_take_traffic(make_stack):
    a, b = FakeDecode("decode-a"), FakeDecode("decode-b")
    a.hold = b.hold = True
    stack = make_stack([FakePrefill()], [a, b])
    calls = [stub(stack).Generate(request(f"w{30 + i}", max_tokens=3), timeout=10) for i in range(8)]
    stack.wait_for(lambda: len(a.requests) + len(b.requests) == 8, what="8 decode requests")
    assert (len(a.requests), len(b.requests)) == (4, 4)
    assert a.max_deltas_per_message == 0
    a.hold = b.hold = False
    results = [summary(list(call)) for call in calls]
    assert [r[0] for r in results] == [[31 + i, 32 + i, 33 + i] for i in range(8)]
    assert a.max_deltas_per_message == 4  # one DecodeOut per step for all requests on the stream


def test_a_broken_decode_stream_fails_only_its_requests(make_stack):
    a, b = FakeDecode("decode-a"), FakeDecode("decode-b")
    a.hold = b.hold = True
    stack = make_stack([FakePrefill()], [a, b])
    calls = [stub(stack).Generate(request(f"w{30 + i}", max_tokens=3), timeout=10) for i in range(4)]
    stack.wait_for(lambda: (len(a.requests), len(b.requests)) == (2, 2), what="2 requests on each decode")
    on_a = {r.request_id for r in a.requests}
    stack.loop.run(stack.servers["decode-a"].stop())
    b.hold = False
    for call in calls:
        messages = list(call)
        if stack.internal_id(messages[0].request_id) in on_a:
            last = messages[-1]
            assert last.finish_reason == FR.FINISH_REASON_ERROR
            assert last.error.startswith("decode instance decode-a failed: ")
        else:
            assert summary(messages)[2] == FR.FINISH_REASON_LENGTH
    messages = generate(stack, request(max_tokens=2))  # routed to decode-b
    assert summary(messages)[:3] == ([21, 22], " w21 w22", FR.FINISH_REASON_LENGTH)
    assert b.requests[-1].request_id == stack.internal_id(messages[0].request_id)
    # decode-a comes back on the same port: its stream reopens and it takes traffic again
    a.hold = False
    stack.loop.run(stack.servers["decode-a"].start())
    inst_a = stack.gateway.registry.decodes()[0]
    stack.wait_for(lambda: inst_a.up, what="decode-a to be up again")
    # the link opens without a round trip: the server sees the new stream a moment later
    stack.wait_for(lambda: a.num_streams == 2, what="decode-a's second stream")
    generate(stack, request(max_tokens=2))
    assert a.requests[-1].request_id != b.requests[-1].request_id and len(a.requests) == 3


def test_deadline_ends_the_request_and_aborts_it(make_stack):
    decode = FakeDecode()
    decode.hold = True
    stack = make_stack([FakePrefill()], [decode], request_timeout_s=0.3)
    messages = generate(stack, request(max_tokens=5))
    rid = messages[0].request_id
    assert summary(messages) == (
        [21],
        " w21",
        FR.FINISH_REASON_ERROR,
        "",
        f"request {rid} timed out after 0.3 s (request_timeout_s or the client's deadline)",
    )
    stack.wait_for(lambda: decode.aborts == [stack.internal_id(rid)], what="AbortRequest after the deadline")


def test_a_request_id_already_running_is_refused(make_stack):
    decode = FakeDecode()
    decode.hold = True
    stack = make_stack([FakePrefill()], [decode])
    req = request(max_tokens=3)
    req.request_id = "dup"
    held = stub(stack).Generate(req, timeout=10)
    next(held)
    with pytest.raises(grpc.RpcError) as info:
        generate(stack, req)
    assert (info.value.code(), info.value.details()) == (
        grpc.StatusCode.INVALID_ARGUMENT,
        "request_id 'dup' is already running on this gateway; use a unique id",
    )
    held.cancel()


class _RecordingLink:
    def __init__(self):
        self.aborted, self.finished = [], []

    def abort(self, request_id):
        self.aborted.append(request_id)

    def finish(self, request_id):
        self.finished.append(request_id)


def _run_with_queue(tokenizer_dir, items, **params):
    """A RequestRun on the local-prefill path whose decode queue already holds `items`."""
    import asyncio
    import time
    from types import SimpleNamespace

    from splitserve.common.sampling_params import SamplingParams
    from splitserve.common.tokenizer import load_tokenizer
    from splitserve.gateway.request_run import RequestRun, RunDeps

    # this run is past routing: it never asks the router or the registry
    deps = RunDeps(router=None, registry=None, tokenizer=load_tokenizer(tokenizer_dir), spawn=lambda coro: coro.close())
    run = RequestRun(
        deps,
        request_id="r",
        params=SamplingParams(**params),
        prompt_token_ids=[20, 21],
        seed=1,
        priority=0,
        arrival_ns=time.monotonic_ns(),
        deadline=time.monotonic() + 5,
        budget_s=5,
    )
    run._decode, run._link, run._local_prefill = SimpleNamespace(name="decode-x"), _RecordingLink(), True
    run._queue = asyncio.Queue()
    for item in items:
        run._queue.put_nowait(item)
    return run


def test_queued_deltas_merge_into_one_message_and_a_stop_string_cuts_the_tokens(tokenizer_dir):
    import asyncio

    from splitserve.gateway.decode_link import LinkFailure
    from splitserve.protos import decode_pb2

    deltas = [
        decode_pb2.TokenDelta(request_id="r", token_ids=[t], cached_prompt_tokens=4 if t == 22 else 0)
        for t in (22, 23, 24, 25)
    ]
    failure = LinkFailure("decode instance decode-x failed: gone")

    async def scenario():
        run = _run_with_queue(tokenizer_dir, deltas[:2] + [failure], stop=("3 w2",))
        merged = await run._next_item()
        assert (list(merged.token_ids), merged.cached_prompt_tokens) == ([22, 23], 4)
        assert await run._next_item() is failure  # kept for after the tokens queued before it
        run = _run_with_queue(tokenizer_dir, deltas, stop=("3 w2",))
        message = run._delta_message(await run._next_item())
        # " w22 w23 w24": "3 w2" is completed by token 24; token 25 is dropped
        assert (list(message.token_ids), message.text, message.stop_reason) == ([22, 23, 24], " w22 w2", "3 w2")
        assert (message.usage.completion_tokens, message.usage.cached_prompt_tokens) == (3, 4)
        assert run._link.aborted == ["r"]

    asyncio.run(scenario())


def test_a_follow_up_turn_goes_to_the_prefill_that_holds_its_prefix(make_stack):
    p0, p1 = FakePrefill("prefill-0"), FakePrefill("prefill-1")
    stack = make_stack([p0, p1], [FakeDecode()])
    turn = "hello world " + " ".join(f"w{i}" for i in range(20, 30))  # 12 tokens: 3 full blocks of 4
    generate(stack, request(turn, max_tokens=2, temperature=0.0))
    first, other = (p0, p1) if p0.requests else (p1, p0)
    assert len(first.requests) == 1 and not other.requests
    first.queued_tokens = 11  # 11 tokens busier than the other, but it holds the 12 leading ones
    inst = next(i for i in stack.gateway.registry.prefills() if i.describe.instance_id.startswith(first.name))
    stack.wait_for(
        lambda: inst.describe.load.num_queued_tokens == 11 and inst.pending_tokens == 0,
        what="a Describe after the first turn",
    )
    generate(stack, request(turn + " w40 w41", max_tokens=2, temperature=0.0))
    assert len(first.requests) == 2 and not other.requests
    assert list(first.requests[1].prompt_token_ids)[:12] == list(first.requests[0].prompt_token_ids)
    stack.wait_for(lambda: inst.pending_tokens == 0, what="the next Describe")
    generate(stack, request("hello world w50 w51 w52 w53 w54", max_tokens=2, temperature=0.0))  # a new conversation
    assert len(other.requests) == 1  # goes by load: the other has nothing queued


def test_two_gateways_running_the_same_caller_id_on_shared_services_do_not_collide(make_stack, tokenizer_dir):
    """The same request_id sent to two gateways in front of the same prefill and decode at
    once: both clients get all their tokens, and each lease is released by its own request."""
    import threading

    from splitserve.gateway.config import GatewayConfig
    from splitserve.gateway.server import GatewayServer

    prefill, decode = FakePrefill(), FakeDecode(step_s=0.02)
    first = make_stack([prefill], [decode])
    config = GatewayConfig(
        grpc_port=0,
        model=tokenizer_dir,
        health_interval_s=0.1,
        prefill=first.servers[prefill.name].address,
        decode=first.servers[decode.name].address,
    )
    second = GatewayServer(config, http_socket=None)
    first.loop.run(second.start())
    try:
        first.wait_for(lambda: second.registry.status()["ready"], what="the second gateway ready")
        targets = [first.grpc_target, f"127.0.0.1:{second.grpc_port}"]
        results: dict[str, list] = {}

        def run(target):
            req = request(max_tokens=6)
            req.request_id = "same-id"
            channel = grpc.insecure_channel(target)
            results[target] = list(generation_pb2_grpc.GenerationStub(channel).Generate(req, timeout=10))

        threads = [threading.Thread(target=run, args=(t,)) for t in targets]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for target in targets:
            assert summary(results[target])[:3] == (
                [21, 22, 23, 24, 25, 26],
                " w21 w22 w23 w24 w25 w26",
                FR.FINISH_REASON_LENGTH,
            )
            assert {m.request_id for m in results[target]} == {"same-id"}
        hop_ids = sorted(r.request_id for r in decode.requests)
        assert len(set(hop_ids)) == 2 and all(h.startswith("same-id@") for h in hop_ids)
        assert sorted(r.request_id for r in prefill.requests) == hop_ids
    finally:
        first.loop.run(second.stop(0.5))
