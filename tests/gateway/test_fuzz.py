"""Property-based fuzzing of the public surfaces against the fake stack, in-process.

1,000 random REST bodies (random JSON values, random mixes of the OpenAI fields with random
types, plausible requests with random ranges, random bytes), 1,000 random GenerateRequest
messages and 200 random byte strings at the gRPC API. Properties: no 5xx
and no server-side gRPC code (the fake stack never overloads, so 503 is not expected
either), every refusal is a well-formed error naming a field or the body, every accepted
request ends normally (never with an error event), and afterwards the gateway still
serves a good request and holds no request anywhere.

Each test starts its own fake stack and counts its own outcomes, so none depends on another
having run. The context is 16 tokens and the fake decode steps every 1 ms, so accepted requests
are short.
"""

import json
from collections import Counter

import grpc
import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from splitserve.protos import common_pb2, generation_pb2, generation_pb2_grpc
from tests.gateway_fakes import FakeDecode, FakePrefill, Stack, make_tokenizer_dir

MODEL = "tiny-fake"
GENERATE = "/splitserve.v1.Generation/Generate"
FUZZ = settings(
    max_examples=1000,
    deadline=None,
    database=None,
    derandomize=True,  # the same examples on every run: CI passes or fails on the code, not on the draw
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
RAW = settings(FUZZ, max_examples=200)


# gRPC codes that mean the server failed (the 5xx of gRPC); a refusal must be none of them
SERVER_FAILURES = {
    grpc.StatusCode.UNKNOWN,
    grpc.StatusCode.INTERNAL,
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DATA_LOSS,
    grpc.StatusCode.UNIMPLEMENTED,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
}
FIELDS = [
    "model",
    "prompt",
    "messages",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop",
    "stream",
    "stream_options",
    "logprobs",
    "top_logprobs",
    "n",
    "user",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "min_tokens",
    "stop_token_ids",
    "ignore_eos",
    "include_stop_str_in_output",
    "skip_special_tokens",
    "best_of",
    "echo",
    "prompt_logprobs",
    "tools",
    "priority",
    "add_special_tokens",
    "add_generation_prompt",
    "continue_final_message",
    "chat_template_kwargs",
    "logit_bias",
    "response_format",
    "structured_outputs",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "guided_decoding_backend",
    "an_unknown_field",
]
WORDS = ["hello", "world", "user", "w9", "w20", "w150", "w199", "<s>", "</s>", "zzz", " ", "\n", "é", "😀"]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    return make_tokenizer_dir(str(tmp_path_factory.mktemp("tokenizer")))


@pytest.fixture
def stack(tokenizer_dir):
    """A fresh fake stack per test. The gateway Describes its instances once at start; health rounds
    every 5 s (Describe timeout 10 s) rather than 0.1 s (1 s), so a loaded machine cannot time one
    out mid-fuzz, mark the decode down and turn good requests into 503s."""
    stack = Stack(
        tokenizer_dir,
        [FakePrefill(max_model_len=16)],
        [FakeDecode(max_model_len=16, step_s=0.001)],
        {"max_body_bytes": 64 << 10, "health_interval_s": 5.0},
    ).start()
    stack.http = httpx.Client(base_url=stack.base_url, timeout=10)
    stack.channel = grpc.insecure_channel(stack.grpc_target)
    stack.stub = generation_pb2_grpc.GenerationStub(stack.channel)
    yield stack
    stack.http.close()
    stack.stop()


# -- strategies --------------------------------------------------------------------------------

any_text = st.text(st.characters(exclude_categories=()), max_size=20)  # lone surrogates included
json_scalars = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | any_text
)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(any_text, inner, max_size=4),
    max_leaves=12,
)
words = st.lists(st.sampled_from(WORDS), max_size=20).map(" ".join)
# structured output specs: the fake services do not compile them, so the gateway's shape checks are what is fuzzed
schemas = st.fixed_dictionaries({"type": st.sampled_from(["object", "array", "string", "objectx"])}) | st.booleans()
patterns = st.sampled_from([r"w\d+", "(ab", "", "a|b"]) | any_text
small_ints = st.integers(-3, 40)
messages = st.lists(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "system", "assistant", "robot"]), "content": words | st.none() | json_values}
    ),
    max_size=3,
)


def plausible(field):
    """Values of the right kind, with ranges wide enough to cross every limit."""
    return {
        "model": st.sampled_from(["", MODEL, "other"]),
        "prompt": words | st.lists(st.integers(-1, 210), max_size=20),
        "messages": messages,
        "max_tokens": small_ints,
        "max_completion_tokens": small_ints,
        "temperature": st.floats(-1, 3),
        "top_p": st.floats(-0.1, 1.2),
        "top_k": small_ints,
        "min_p": st.floats(-0.1, 1.1),
        "seed": st.integers(-1, 2**64),
        "stop": st.lists(words, max_size=18) | words,
        "stream": st.booleans(),
        "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
        "logprobs": st.integers(0, 22) | st.booleans(),
        "top_logprobs": st.integers(-1, 22),
        "n": st.integers(0, 3) | st.integers(15, 17),
        "user": words,
        "min_tokens": small_ints,
        "presence_penalty": st.floats(-3, 3),
        "frequency_penalty": st.floats(-3, 3),
        "repetition_penalty": st.floats(-1, 11),
        "stop_token_ids": st.lists(st.integers(-1, 205), max_size=3),
        "ignore_eos": st.booleans(),
        "include_stop_str_in_output": st.booleans(),
        "skip_special_tokens": st.booleans(),
        "best_of": st.integers(0, 4) | st.integers(15, 17),
        "echo": st.booleans(),
        "prompt_logprobs": st.integers(-1, 22) | st.booleans(),
        "tools": st.just([]) | json_values,
        "priority": st.integers(-(2**32), 2**32),
        "add_special_tokens": st.booleans(),
        "add_generation_prompt": st.booleans(),
        "continue_final_message": st.booleans(),
        "chat_template_kwargs": st.dictionaries(st.sampled_from(["greet", "messages", "x"]), json_values, max_size=2),
        "logit_bias": st.dictionaries(
            st.integers(-1, 205).map(str) | st.sampled_from(["x", "1.0", " 1", ""]),
            st.floats(-300, 300) | st.integers(-200, 200) | st.sampled_from(["1", None, float("nan")]),
            max_size=4,
        ),
        "response_format": st.fixed_dictionaries(
            {"type": st.sampled_from(["text", "json_object", "json_schema", "xml"])},
            optional={"json_schema": st.fixed_dictionaries({"name": st.just("n"), "schema": schemas}) | json_values},
        )
        | json_values,
        "structured_outputs": st.dictionaries(
            st.sampled_from(["json", "regex", "choice", "grammar", "json_object", "disable_any_whitespace", "x"]),
            schemas | patterns | st.lists(words, max_size=3) | st.booleans(),
            max_size=3,
        )
        | json_values,
        "guided_json": schemas | schemas.map(json.dumps) | json_values,
        "guided_regex": patterns | json_values,
        "guided_choice": st.lists(words, max_size=4) | json_values,
        "guided_grammar": st.sampled_from(['root ::= "w9"', "root ::= foo", ""]) | json_values,
        "guided_decoding_backend": st.sampled_from(["xgrammar", "auto", "outlines"]) | json_values,
        "an_unknown_field": json_values,  # ignored with a log line, as vLLM does
    }[field]


field_mixes = st.dictionaries(st.sampled_from(FIELDS), json_values, max_size=8)
plausible_bodies = st.sets(st.sampled_from(FIELDS), max_size=10).flatmap(
    lambda keys: st.fixed_dictionaries({k: plausible(k) for k in sorted(keys)})
)
good_completions = st.fixed_dictionaries(
    {"model": st.just(MODEL), "prompt": words.filter(str.strip)},
    optional={
        "max_tokens": st.integers(1, 8),
        "stream": st.booleans(),
        "temperature": st.floats(0, 2),
        "stop": st.lists(st.sampled_from(["w2", "1 w", "x"]), max_size=2),
        "logprobs": st.integers(0, 3),
        "echo": st.booleans(),
    },
)
good_chats = st.fixed_dictionaries(
    {
        "messages": st.lists(
            st.fixed_dictionaries({"role": st.sampled_from(["user", "system"]), "content": words}),
            min_size=1,
            max_size=2,
        )
    },
    optional={
        "model": st.just(MODEL),
        "max_tokens": st.integers(1, 6),
        "stream": st.booleans(),
        "logprobs": st.booleans(),
        "seed": st.integers(0, 99),
        "stop": st.sampled_from(["w", "hello", None]),
    },
)
rest_bodies = st.one_of(
    [
        strategy.map(lambda v: json.dumps(v).encode())
        for strategy in (json_values, field_mixes, plausible_bodies, good_completions, good_chats, good_completions)
    ]
    + [st.binary(max_size=300)]
)


# -- properties --------------------------------------------------------------------------------


def check_rest_answer(r: httpx.Response, outcomes: Counter) -> None:
    outcomes[f"rest {r.status_code}"] += 1
    assert r.status_code < 500, (r.status_code, r.text)
    if r.status_code >= 400:
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"], r.text
        assert r.status_code in (400, 404, 413) and (error["param"] or r.status_code == 404), r.text
    elif r.headers["content-type"].startswith("text/event-stream"):
        events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]" and all('"server_error"' not in e for e in events), r.text
        assert json.loads(events[-2])["choices"][0]["finish_reason"] in ("stop", "length"), r.text
    else:
        assert r.json()["choices"][0]["finish_reason"] in ("stop", "length"), r.text


def test_rest_random_bodies(stack):
    outcomes = Counter()

    @FUZZ
    @given(path=st.sampled_from(["/v1/completions", "/v1/chat/completions"]), raw=rest_bodies)
    def post(path, raw):
        check_rest_answer(stack.http.post(path, content=raw, headers={"content-type": "application/json"}), outcomes)

    post()
    print("fuzz outcomes:", dict(sorted(outcomes.items())))
    assert outcomes.total() == FUZZ.max_examples and outcomes["rest 200"] >= 100, outcomes  # generation was reached
    assert_serves_and_holds_nothing(stack)


def _sampling(plausible: bool):
    if plausible:  # mostly valid: every field in range, except the odd max_tokens 0 or past the context
        floats, big = st.floats(0.05, 1.0), st.integers(1, 12)
    else:
        floats, big = st.floats(width=32, allow_nan=True, allow_infinity=True), st.integers(0, 2**32 - 1)
    return st.fixed_dictionaries(
        {},
        optional={
            "temperature": floats,
            "top_p": floats,
            "top_k": st.integers(-2, 50) | st.integers(-(2**31), 2**31 - 1),
            "min_p": floats,
            "seed": st.integers(0, 2**64 - 1),
            "repetition_penalty": floats,
            "presence_penalty": floats,
            "frequency_penalty": floats,
            "max_tokens": st.integers(0, 12) | big,
            "min_tokens": st.integers(0, 1) | big,
            "logprobs": st.integers(0, 20 if plausible else 25),
            "prompt_logprobs": st.integers(0, 20 if plausible else 25),
            "stop_token_ids": st.lists(big | st.integers(0, 210), max_size=3),
            "ignore_eos": st.booleans(),
            "logit_bias": st.dictionaries(
                st.integers(0, 205) | big, floats if plausible else st.floats(-300, 300, width=32), max_size=3
            ),
            "structured_output": structured_specs,
        },
    ).map(lambda kw: common_pb2.SamplingParams(**kw))


structured_specs = st.one_of(
    st.builds(common_pb2.StructuredOutput),  # no kind set: refused
    st.builds(common_pb2.StructuredOutput, json_schema=st.sampled_from(['{"type": "object"}', "{", "[1]", ""])),
    st.builds(common_pb2.StructuredOutput, json_object=st.booleans(), disable_any_whitespace=st.booleans()),
    st.builds(common_pb2.StructuredOutput, regex=st.sampled_from([r"w\d+", "(ab", "", "a|b"])),
    st.builds(
        common_pb2.StructuredOutput, choice=st.lists(words, max_size=3).map(lambda v: common_pb2.Choices(values=v))
    ),
    st.builds(common_pb2.StructuredOutput, grammar=st.sampled_from(['root ::= "w9"', ""])),
)


def _prompt(plausible: bool):
    text = words.filter(str.strip) if plausible else (words | st.text(max_size=40))
    ids = st.lists(st.integers(0, 210) | st.integers(0, 2**32 - 1), min_size=int(plausible), max_size=20).map(
        lambda v: {"token_ids": generation_pb2.TokenIds(ids=v)}
    )
    chat = st.lists(
        st.builds(generation_pb2.ChatMessage, role=st.sampled_from(["user", "system", "x", ""]), content=text),
        min_size=int(plausible),
        max_size=3,
    ).map(lambda v: {"chat": generation_pb2.ChatMessages(messages=v)})
    return st.one_of(text.map(lambda t: {"text": t}), ids, chat, *([] if plausible else [st.just({})]))


def _grpc_requests(plausible: bool):
    return st.builds(
        lambda prompt, **kw: generation_pb2.GenerateRequest(**prompt, **kw),
        _prompt(plausible),
        request_id=st.just("") | st.text(max_size=300),
        model=st.sampled_from(["", MODEL] + ([] if plausible else ["x"])),
        sampling=_sampling(plausible),
        stop=st.lists(words.filter(bool) if plausible else st.text(max_size=300), max_size=3 if plausible else 18),
        include_stop_str_in_output=st.booleans(),
        skip_special_tokens=st.none() | st.booleans(),
        priority=st.integers(-(2**31), 2**31 - 1),
        echo=st.booleans(),
        n=st.none() | st.integers(0, 3) | (st.just(17) if not plausible else st.integers(1, 2)),
        best_of=st.none() | st.integers(0, 4),
    )


grpc_requests = st.one_of(_grpc_requests(False), _grpc_requests(True), _grpc_requests(True))


def check_grpc_call(call, outcomes: Counter) -> None:
    try:
        out = list(call)
        outcomes["grpc OK"] += 1
    except grpc.RpcError as exc:
        outcomes[f"grpc {exc.code().name}"] += 1
        assert exc.code() not in SERVER_FAILURES and exc.code() != grpc.StatusCode.OK, (exc.code(), exc.details())
        assert exc.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND) and exc.details()
        return
    # every sequence (index; n > 1) ends once, normally, with its last message
    last = {m.index: m for m in out}
    assert out and all(
        m.finish_reason in (common_pb2.FINISH_REASON_STOP, common_pb2.FINISH_REASON_LENGTH) and not m.error
        for m in last.values()
    ), out[-1]
    assert sum(1 for m in out if m.finish_reason) == len(last) and sorted(last) == list(range(len(last)))


def test_grpc_random_messages(stack):
    outcomes = Counter()

    @FUZZ
    @given(request=grpc_requests)
    def call(request):
        if request.request_id:  # ids must be unique among running requests
            request.request_id += f"-{outcomes.total()}"
        check_grpc_call(stack.stub.Generate(request, timeout=10), outcomes)

    call()
    print("fuzz outcomes:", dict(sorted(outcomes.items())))
    assert outcomes.total() == FUZZ.max_examples and outcomes["grpc OK"] >= 100, outcomes  # generation was reached
    assert_serves_and_holds_nothing(stack)


def test_grpc_random_bytes(stack):
    outcomes = Counter()
    generate = stack.channel.unary_stream(
        GENERATE, request_serializer=None, response_deserializer=generation_pb2.GenerateResponse.FromString
    )

    @RAW
    @given(raw=st.binary(max_size=200))
    def call(raw):
        check_grpc_call(generate(raw, timeout=10), outcomes)

    call()
    print("fuzz outcomes:", dict(sorted(outcomes.items())))
    assert outcomes.total() == RAW.max_examples, outcomes
    assert_serves_and_holds_nothing(stack)


def assert_serves_and_holds_nothing(stack) -> None:
    """After a fuzz run: a good request over each API gets its exact tokens, and no request is left."""
    r = stack.http.post("/v1/completions", json={"model": MODEL, "prompt": "hello world w9", "max_tokens": 3})
    assert (r.status_code, r.json()["choices"][0]["text"]) == (200, " w10 w11 w12")
    out = list(
        stack.stub.Generate(
            generation_pb2.GenerateRequest(text="w20", sampling=common_pb2.SamplingParams(max_tokens=2)), timeout=10
        )
    )
    assert [t for m in out for t in m.token_ids] == [21, 22]
    (decode,) = [s.servicer for s in stack.servers.values() if isinstance(s.servicer, FakeDecode)]
    stack.wait_for(
        lambda: stack.gateway.service.num_active == 0 and not decode.running,
        what="no request left at the gateway or the decode",
    )
