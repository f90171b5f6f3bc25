"""The gRPC surface of the gateway: Tokenize, ListModels, health, reflection, refusals with
exact status codes and messages, admission limit, and draining on stop."""

import asyncio
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from splitserve.protos import common_pb2, generation_pb2, generation_pb2_grpc
from tests.gateway_fakes import FakeDecode, FakePrefill, Stack, make_tokenizer_dir
from tests.service_harness import wait_until

FR = common_pb2.FinishReason


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    return make_tokenizer_dir(str(tmp_path_factory.mktemp("tokenizer")))


@pytest.fixture(scope="module")
def stack(tokenizer_dir):
    stack = Stack(tokenizer_dir, [FakePrefill()], [FakeDecode()], {"max_stop_strings": 2}).start()
    yield stack
    stack.stop()


@pytest.fixture(scope="module")
def channel(stack):
    return grpc.insecure_channel(stack.grpc_target)


def generate(channel, **kwargs):
    return list(
        generation_pb2_grpc.GenerationStub(channel).Generate(generation_pb2.GenerateRequest(**kwargs), timeout=5)
    )


def test_the_gateway_reports_every_decode_message_it_read(stack, channel):
    """The decode paces its stream by these reports (decode_service/stream_pacing.py)."""
    decode = stack.decodes[0]
    out = generate(
        channel, token_ids=generation_pb2.TokenIds(ids=[40, 41]), sampling=common_pb2.SamplingParams(max_tokens=5)
    )
    assert [t for m in out for t in m.token_ids] == [42, 43, 44, 45, 46]
    wait_until(
        lambda: decode.num_outputs_read == decode.num_outputs > 0,
        5,
        lambda: f"reads reported: {decode.num_outputs_read} of {decode.num_outputs}",
    )


def test_tokenize_and_list_models(channel):
    stub = generation_pb2_grpc.GenerationStub(channel)
    assert stub.Tokenize(generation_pb2.TokenizeRequest(text="hello world w20")) == generation_pb2.TokenizeResponse(
        token_ids=[6, 7, 20], max_model_len=64
    )
    chat = generation_pb2.ChatMessages(messages=[generation_pb2.ChatMessage(role="user", content="hello w30")])
    assert list(stub.Tokenize(generation_pb2.TokenizeRequest(chat=chat)).token_ids) == [3, 6, 30, 5]
    assert stub.ListModels(generation_pb2.ListModelsRequest()) == generation_pb2.ListModelsResponse(
        models=[generation_pb2.ModelInfo(id="tiny-fake", max_model_len=64)]
    )


def test_chat_and_token_id_prompts(channel):
    chat = generation_pb2.ChatMessages(messages=[generation_pb2.ChatMessage(role="user", content="hello w30")])
    out = generate(channel, chat=chat, sampling=common_pb2.SamplingParams(max_tokens=3))
    assert "".join(m.text for m in out) == " hello world w8" and out[-1].usage.prompt_tokens == 4
    out = generate(
        channel, token_ids=generation_pb2.TokenIds(ids=[40, 41]), sampling=common_pb2.SamplingParams(max_tokens=2)
    )
    assert [t for m in out for t in m.token_ids] == [42, 43]


def test_health_serving_and_reflection(channel):
    health = health_pb2_grpc.HealthStub(channel)
    for service in ("", "splitserve.v1.Generation"):
        assert (
            health.Check(health_pb2.HealthCheckRequest(service=service)).status
            == health_pb2.HealthCheckResponse.SERVING
        )
    reflect = reflection_pb2_grpc.ServerReflectionStub(channel)
    (answer,) = reflect.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
    assert sorted(s.name for s in answer.list_services_response.service) == [
        "grpc.health.v1.Health",
        "grpc.reflection.v1.ServerReflection",
        "grpc.reflection.v1alpha.ServerReflection",
        "splitserve.v1.Generation",
    ]


REFUSALS = [
    (
        dict(text="hi", sampling=common_pb2.SamplingParams(temperature=-1)),
        grpc.StatusCode.INVALID_ARGUMENT,
        "temperature must be >= 0 and <= 100, got -1.0",
    ),
    (
        dict(text="hi", sampling=common_pb2.SamplingParams(max_tokens=0)),
        grpc.StatusCode.INVALID_ARGUMENT,
        "max_tokens must be >= 1 or None, got 0",
    ),
    (
        dict(text="hi", sampling=common_pb2.SamplingParams(max_tokens=2, min_tokens=3)),
        grpc.StatusCode.INVALID_ARGUMENT,
        "min_tokens must be >= 0 and <= max_tokens (2), got 3",
    ),
    (
        dict(text="hi", stop=["a", "b", "c"]),
        grpc.StatusCode.INVALID_ARGUMENT,
        "stop must have at most 2 strings, got 3",
    ),
    (
        dict(text="hi", sampling=common_pb2.SamplingParams(logit_bias={200: 1.0})),
        grpc.StatusCode.INVALID_ARGUMENT,
        "logit_bias keys must be token ids below the vocabulary size 200, got 200",
    ),
    (
        dict(text="hi", sampling=common_pb2.SamplingParams(logit_bias={3: float("nan")})),
        grpc.StatusCode.INVALID_ARGUMENT,
        "logit_bias values must be finite numbers in [-100, 100], got nan",
    ),
    (dict(text="hi", n=17), grpc.StatusCode.INVALID_ARGUMENT, "n must be >= 1 and <= 16, got 17"),
    (dict(text="hi", n=2, best_of=1), grpc.StatusCode.INVALID_ARGUMENT, "best_of must be >= n (2), got 1"),
    (
        dict(
            chat=generation_pb2.ChatMessages(messages=[generation_pb2.ChatMessage(role="user", content="hi")]),
            echo=True,
        ),
        grpc.StatusCode.INVALID_ARGUMENT,
        "echo applies to text and token_ids prompts (completions), not to chat",
    ),
    (
        dict(text="hi", sampling=common_pb2.SamplingParams(prompt_logprobs=21)),
        grpc.StatusCode.INVALID_ARGUMENT,
        "prompt_logprobs must be >= 0 and <= 20, got 21",
    ),
    (
        dict(text="hi", sampling=common_pb2.SamplingParams(max_tokens=0)),
        grpc.StatusCode.INVALID_ARGUMENT,
        "max_tokens must be >= 1 or None, got 0",
    ),
    (dict(), grpc.StatusCode.INVALID_ARGUMENT, "prompt must be set (text, token_ids or chat)"),
    (dict(text=""), grpc.StatusCode.INVALID_ARGUMENT, "prompt must not be empty"),
    (dict(chat=generation_pb2.ChatMessages()), grpc.StatusCode.INVALID_ARGUMENT, "messages must not be empty"),
    (
        dict(token_ids=generation_pb2.TokenIds(ids=[5, 200])),
        grpc.StatusCode.INVALID_ARGUMENT,
        "prompt token id 200 is out of range; the vocabulary has 200 tokens (ids 0..199)",
    ),
    (
        dict(text="hi", model="other"),
        grpc.StatusCode.NOT_FOUND,
        "model 'other' is not served here; this gateway serves 'tiny-fake'",
    ),
]


@pytest.mark.parametrize(
    "kwargs,code,message", REFUSALS, ids=[r[2].split(" ")[0] + str(i) for i, r in enumerate(REFUSALS)]
)
def test_refusals_have_exact_codes_and_messages(channel, kwargs, code, message):
    with pytest.raises(grpc.RpcError) as info:
        generate(channel, **kwargs)
    assert (info.value.code(), info.value.details()) == (code, message)


def test_over_max_concurrent_requests_is_resource_exhausted(tokenizer_dir):
    decode = FakeDecode()
    decode.hold = True
    stack = Stack(tokenizer_dir, [FakePrefill()], [decode], {"max_concurrent_requests": 1}).start()
    try:
        stub = generation_pb2_grpc.GenerationStub(grpc.insecure_channel(stack.grpc_target))
        held = stub.Generate(generation_pb2.GenerateRequest(text="w20"), timeout=5)
        next(held)
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Generate(generation_pb2.GenerateRequest(text="w20"), timeout=5))
        assert (info.value.code(), info.value.details()) == (
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            "the gateway already runs 1 requests (max_concurrent_requests=1); retry later",
        )
        assert ("retry-after", "1") in tuple(info.value.trailing_metadata())
        held.cancel()
    finally:
        stack.stop()


def test_stop_drains_in_flight_requests_and_refuses_new_ones(tokenizer_dir):
    decode = FakeDecode(step_s=0.05)
    stack = Stack(tokenizer_dir, [FakePrefill()], [decode]).start()
    try:
        stub = generation_pb2_grpc.GenerationStub(grpc.insecure_channel(stack.grpc_target))
        running = stub.Generate(
            generation_pb2.GenerateRequest(text="w20", sampling=common_pb2.SamplingParams(max_tokens=8)), timeout=10
        )
        first = next(running)
        stopping = asyncio.run_coroutine_threadsafe(stack.gateway.stop(5.0), stack.loop.loop)
        stack.wait_for(lambda: stack.gateway.service.draining, what="draining")
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Generate(generation_pb2.GenerateRequest(text="w20"), timeout=5))
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        rest = list(running)
        assert [t for m in [first] + rest for t in m.token_ids] == list(range(21, 29))
        assert rest[-1].finish_reason == FR.FINISH_REASON_LENGTH
        start = time.monotonic()
        stopping.result(10)
        assert time.monotonic() - start < 2.0  # nothing left to wait for
    finally:
        stack.stop()


def test_n_sequences_stream_with_their_index_and_best_of_comes_last(channel):
    """n=2: both sequences' messages, each naming its index (the fake decode runs both greedily); best_of=3
    with n=1: one message, at the end, holding the best sequence whole."""
    sampling = common_pb2.SamplingParams(max_tokens=3)
    out = generate(channel, text="hello world w20", sampling=sampling, n=2)
    by_index = {0: [], 1: []}
    for message in out:
        by_index[message.index].extend(message.token_ids)
    assert by_index == {0: [21, 22, 23], 1: [21, 22, 23]}
    assert sorted(m.index for m in out if m.finish_reason) == [0, 1]
    (best,) = generate(channel, text="hello world w20", sampling=sampling, best_of=3)
    assert (best.index, list(best.token_ids), best.text, best.finish_reason) == (
        0,
        [21, 22, 23],
        " w21 w22 w23",
        FR.FINISH_REASON_LENGTH,
    )
    assert not best.logprobs and best.usage.completion_tokens == 3
