"""Per-key rate limits (requests/s and tokens/min token buckets) and overload answers:
exact 429 / RESOURCE_EXHAUSTED bodies with Retry-After, exact served/refused counts, keys
independent, and 503 + Retry-After when every decode is full."""

from concurrent.futures import ThreadPoolExecutor

import grpc
import httpx
import pytest

from splitserve.gateway.errors import GatewayError
from splitserve.gateway.limits import RateLimiter, TokenBucket
from splitserve.protos import common_pb2, generation_pb2, generation_pb2_grpc
from tests.gateway_fakes import FakeDecode, FakePrefill, Stack, make_tokenizer_dir, parse_metrics

MODEL = "tiny-fake"
KEY_A, KEY_B = "sk-team-a", "sk-team-b"
BODY = {"model": MODEL, "prompt": "hello world w20", "max_tokens": 2}  # 3 prompt tokens


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    return make_tokenizer_dir(str(tmp_path_factory.mktemp("tokenizer")))


def post(stack, key, body=BODY):
    return httpx.post(
        stack.base_url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=10
    )


def test_token_bucket_refills_continuously():
    clock = Clock()
    bucket = TokenBucket(capacity=3, rate_per_s=0.5, clock=clock)
    assert [bucket.take(1) for _ in range(4)] == [0, 0, 0, 2]  # empty: 1 unit at 0.5/s takes 2 s
    clock.now += 1.0
    assert (bucket.take(1), bucket.level()) == (1, 0.5)  # half a unit back: 1 s more
    clock.now += 1.0
    assert (bucket.take(1), bucket.level()) == (0, 0.0)
    clock.now += 100.0
    assert bucket.level() == 3  # never above capacity
    assert bucket.take(2.5) == 0 and bucket.take(3) == 5  # (3 - 0.5) / 0.5 = 5 s


def test_rate_limiter_requests_and_tokens_exact_refusals():
    clock = Clock()
    limiter = RateLimiter(rps=0.5, burst=2, tokens_per_min=120, clock=clock)
    limiter.take_request("a")
    limiter.take_request("a")
    with pytest.raises(GatewayError) as info:
        limiter.take_request("a")
    assert (info.value.kind, info.value.retry_after_s, info.value.http_status, info.value.message) == (
        "rate_limited",
        2,
        429,
        "rate limit exceeded: more than 0.5 requests per second (burst 2) for this API key; retry after 2 s",
    )
    limiter.take_request("b")  # keys are independent
    clock.now += 2.0
    limiter.take_request("a")
    limiter.take_tokens("a", 90, 10, "max_tokens")  # 100 of 120
    with pytest.raises(GatewayError) as info:
        limiter.take_tokens("a", 20, 10, "max_tokens")  # needs 30, has 20: 10 more at 2/s
    assert (info.value.retry_after_s, info.value.message) == (
        5,
        "rate limit exceeded: the request needs 30 tokens and this API key has 20 of its 120 tokens per "
        "minute left; retry after 5 s",
    )
    with pytest.raises(GatewayError) as info:
        limiter.take_tokens("a", 20, 101, "max_completion_tokens")
    assert (info.value.kind, info.value.param, info.value.message) == (
        "invalid_argument",
        "max_completion_tokens",
        "the request needs 121 tokens (20 prompt + 101 max_completion_tokens), more than this API key may use "
        "in a minute (rate_limit_tokens_per_min=120); lower max_completion_tokens or shorten the prompt",
    )
    RateLimiter().take_request("a")  # no limits configured: nothing is refused
    assert RateLimiter(rps=2.5).burst == 3


RPS_LIMIT = {"rate_limit_rps": 0.01, "rate_limit_burst": 3}  # 3 at once, then 1 per 100 s


@pytest.fixture
def limited(tokenizer_dir):
    stack = Stack(
        tokenizer_dir, [FakePrefill()], [FakeDecode()], RPS_LIMIT, env={"SPLITSERVE_API_KEYS": f"{KEY_A},{KEY_B}"}
    ).start()
    yield stack
    stack.stop()


def test_burst_over_the_limit_gets_429_and_the_rest_are_served(limited):
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda _: post(limited, KEY_A), range(8)))
    statuses = sorted(r.status_code for r in answers)
    assert statuses == [200] * 3 + [429] * 5
    for r in answers:
        if r.status_code == 200:
            assert r.json()["choices"][0]["text"] == " w21 w22"
        else:  # the bucket refills 0.01 per second: a whole request takes 100 s (less what already refilled)
            assert r.headers["retry-after"] in ("100", "99")
            assert r.json() == {
                "error": {
                    "message": f"rate limit exceeded: more than 0.01 requests per second (burst 3) for this API key; "
                    f"retry after {r.headers['retry-after']} s",
                    "type": "rate_limit_error",
                    "param": None,
                    "code": "rate_limit_exceeded",
                }
            }
    assert [post(limited, KEY_B).status_code for _ in range(4)] == [200, 200, 200, 429]  # B has its own bucket
    metrics = parse_metrics(httpx.get(limited.base_url + "/metrics").text)
    assert metrics[("splitserve:gateway_requests_total", (("route", "/v1/completions"), ("status", "200")))] == 6
    assert metrics[("splitserve:gateway_requests_total", (("route", "/v1/completions"), ("status", "429")))] == 6


def test_grpc_over_the_limit_is_resource_exhausted_with_retry_after(limited):
    stub = generation_pb2_grpc.GenerationStub(grpc.insecure_channel(limited.grpc_target))
    request = generation_pb2.GenerateRequest(text="w20", sampling=common_pb2.SamplingParams(max_tokens=2))
    metadata = (("authorization", f"Bearer {KEY_A}"),)
    for _ in range(3):
        assert [t for m in stub.Generate(request, metadata=metadata, timeout=5) for t in m.token_ids] == [21, 22]
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Generate(request, metadata=metadata, timeout=5))
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    retry = dict(info.value.trailing_metadata())["retry-after"]
    assert retry in ("100", "99") and info.value.details() == (
        f"rate limit exceeded: more than 0.01 requests per second (burst 3) for this API key; retry after {retry} s"
    )


def test_wrong_or_missing_key_is_refused_before_the_limit(limited):
    for headers, code in (({}, "missing_api_key"), ({"Authorization": "Bearer sk-other"}, "invalid_api_key")):
        r = httpx.post(limited.base_url + "/v1/completions", json=BODY, headers=headers, timeout=5)
        assert (r.status_code, r.json()["error"]["code"]) == (401, code)
    assert [post(limited, KEY_A).status_code for _ in range(4)] == [200, 200, 200, 429]  # A's bucket untouched


def test_tokens_per_minute(tokenizer_dir):
    stack = Stack(tokenizer_dir, [FakePrefill()], [FakeDecode()], {"rate_limit_tokens_per_min": 30}).start()
    try:
        body = {**BODY, "max_tokens": 10}  # 3 + 10 = 13 tokens each
        assert [post(stack, "none", body).status_code for _ in range(2)] == [200, 200]  # no keys: one shared bucket
        r = post(stack, "none", body)
        assert r.status_code == 429
        retry = int(r.headers["retry-after"])  # 4 of 30 left; 9 more at 0.5 per second
        assert retry in (18, 17) and r.json()["error"]["message"] == (
            f"rate limit exceeded: the request needs 13 tokens and this API key has 4 of its 30 tokens per minute "
            f"left; retry after {retry} s"
        )
        r = post(stack, "none", {**BODY, "max_tokens": 40})
        assert (r.status_code, r.json()["error"]) == (
            400,
            {
                "message": "the request needs 43 tokens (3 prompt + 40 max_tokens), more than this API key may use in "
                "a minute (rate_limit_tokens_per_min=30); lower max_tokens or shorten the prompt",
                "type": "invalid_request_error",
                "param": "max_tokens",
                "code": None,
            },
        )
    finally:
        stack.stop()


def test_every_decode_full_is_503_with_retry_after(tokenizer_dir):
    decode = FakeDecode()
    decode.waiting = 4
    stack = Stack(tokenizer_dir, [FakePrefill()], [decode], {"max_waiting_per_decode": 4}).start()
    try:
        message = "every decode instance is full (decode-0 has 4 waiting; max_waiting_per_decode=4); retry later"
        r = post(stack, "none")
        assert (r.status_code, r.headers["retry-after"]) == (503, "1")
        assert r.json()["error"] == {
            "message": message,
            "type": "service_unavailable_error",
            "param": None,
            "code": None,
        }
        stub = generation_pb2_grpc.GenerationStub(grpc.insecure_channel(stack.grpc_target))
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Generate(generation_pb2.GenerateRequest(text="w20"), timeout=5))
        assert (info.value.code(), info.value.details()) == (grpc.StatusCode.RESOURCE_EXHAUSTED, message)
        assert dict(info.value.trailing_metadata())["retry-after"] == "1"
        assert decode.requests == []
        stack.loop.call(lambda: setattr(decode, "waiting", 3))
        stack.wait_for(
            lambda: stack.gateway.router.has_room(stack.gateway.registry.decodes()[0]),
            what="the decode's next Describe",
        )
        r = post(stack, "none")
        assert (r.status_code, r.json()["choices"][0]["text"]) == (200, " w21 w22")
    finally:
        stack.stop()


def test_a_decode_full_of_one_callers_sequences_still_takes_another_callers_request(tokenizer_dir):
    """The decode runs lower shares first, so a request waits there only behind each caller's sequences up to its
    own share (and behind every waiting request this gateway does not account for): caller A's 8 sequences fill
    the queue (max_waiting_per_decode=4), caller B's request (share 1: 2 ahead) is served, and A's next one
    (share 9: the 6 waiting are all ahead) is refused."""
    decode = FakeDecode(step_s=0.05)
    stack = Stack(tokenizer_dir, [FakePrefill()], [decode], {"max_waiting_per_decode": 4}).start()
    options = [("grpc.use_local_subchannel_pool", 1)]  # a connection (a caller) each
    a, b = (generation_pb2_grpc.GenerationStub(grpc.insecure_channel(stack.grpc_target, options)) for _ in "ab")
    try:
        many = generation_pb2.GenerateRequest(text="w20", n=8, sampling=common_pb2.SamplingParams(max_tokens=40))
        running = a.Generate(many, timeout=30)
        stack.wait_for(lambda: len(decode.running) == 8, what="caller A's 8 sequences at the decode")
        stack.loop.call(lambda: setattr(decode, "waiting", 6))
        (inst,) = stack.gateway.registry.decodes()
        stack.wait_for(lambda: inst.describe.load.num_waiting == 6, what="the decode's next Describe")
        small = generation_pb2.GenerateRequest(text="w20", sampling=common_pb2.SamplingParams(max_tokens=2))
        assert [t for m in b.Generate(small, timeout=10) for t in m.token_ids] == [21, 22]
        with pytest.raises(grpc.RpcError) as refused:
            list(a.Generate(small, timeout=10))
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert refused.value.details().startswith("every decode instance is full (decode-0 has 6 waiting")
        assert len([m for m in running if m.finish_reason]) == 8
    finally:
        stack.stop()
