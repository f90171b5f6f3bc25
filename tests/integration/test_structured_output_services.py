"""Structured output through the real services: REST and gRPC, disaggregated (prefill -> shm -> decode) and
colocated (one worker), on the default model in float64.

Every constrained answer equals the in-process engine's (token for token: the prefill's first token obeyed the
grammar, and the decode, which started the request's matcher over from the spec and the first token, went on
exactly as the colocated engine does), ends with finish_reason stop (the grammar completed), and matches its
constraint: JSON parsed and validated with jsonschema, regex and choice exact. Specs xgrammar refuses get a
400 / INVALID_ARGUMENT naming the request field and carrying xgrammar's message, from either path.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

import grpc
import httpx
import jsonschema
import pytest

from splitserve.common.sampling_params import SamplingParams
from splitserve.common.structured_output import StructuredOutput
from splitserve.protos import common_pb2, generation_pb2, generation_pb2_grpc
from tests.service_harness import ENGINE, Proc, Stack, free_port, gateway_args, start_service, wait_until

pytestmark = pytest.mark.slow

CODE = "def f(x):\n    return "
CHAT_TEXT = "<|user|>\nGive me JSON<|endoftext|>\n<|assistant|>\n"
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}
FLAGS = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}},
    "required": ["ok", "tags"],
}
INTS = {"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 4}
COLOR = {"type": "object", "properties": {"x": {"type": "number"}, "kind": {"enum": ["red", "green"]}}}
COLOR["required"] = ["x", "kind"]
REGEX = r"\d{3}-[a-z]{2,5}"
CHOICES = ["yes", "no", 'maybe "so"\n']
GRAMMAR = 'root ::= "x" [0-9]+ ";"'
MAX_TOKENS = 48

# (name, prompt, REST fields, the engine's spec, how to check the text)
CASES = [
    (
        "response_format schema",
        CODE,
        {"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}}},
        StructuredOutput(json=json.dumps(PERSON)),
        ("json", PERSON),
    ),
    (
        "structured_outputs json",
        CHAT_TEXT,
        {"structured_outputs": {"json": FLAGS, "disable_any_whitespace": True}},
        StructuredOutput(json=json.dumps(FLAGS), disable_any_whitespace=True),
        ("json", FLAGS),
    ),
    (
        "guided_json",
        CHAT_TEXT,
        {"guided_json": json.dumps(INTS)},
        StructuredOutput(json=json.dumps(INTS)),
        ("json", INTS),
    ),
    (
        "structured_outputs json color",
        CHAT_TEXT,
        {"structured_outputs": {"json": COLOR, "disable_any_whitespace": True}},
        StructuredOutput(json=json.dumps(COLOR), disable_any_whitespace=True),
        ("json", COLOR),
    ),
    (
        "json_object",
        CODE,
        {"response_format": {"type": "json_object"}},
        StructuredOutput(json_object=True),
        ("json", {"type": ["object", "array"]}),
    ),
    ("guided_regex", CODE, {"guided_regex": REGEX}, StructuredOutput(regex=REGEX), ("regex", REGEX)),
    (
        "structured_outputs regex",
        CHAT_TEXT,
        {"structured_outputs": {"regex": REGEX}},
        StructuredOutput(regex=REGEX),
        ("regex", REGEX),
    ),
    ("guided_choice", CODE, {"guided_choice": CHOICES}, StructuredOutput(choice=tuple(CHOICES)), ("choice", CHOICES)),
    (
        "structured_outputs choice",
        CHAT_TEXT,
        {"structured_outputs": {"choice": CHOICES}},
        StructuredOutput(choice=tuple(CHOICES)),
        ("choice", CHOICES),
    ),
    ("guided_grammar", CODE, {"guided_grammar": GRAMMAR}, StructuredOutput(grammar=GRAMMAR), ("regex", r"x[0-9]+;")),
]
# (REST fields, status 400 message, param): refused by the prefill (disaggregated) or the worker (colocated)
BAD = [
    (
        {"guided_regex": "(ab"},
        "guided_regex: invalid regex: Regex parsing error at position 4: The parenthesis is not closed.",
        "guided_regex",
    ),
    (
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}},
        'response_format.json_schema.schema: invalid JSON schema: Unsupported type "objectx"',
        "response_format",
    ),
    (
        {"structured_outputs": {"grammar": "root ::= foo"}},
        "structured_outputs.grammar: invalid grammar: EBNF parser "
        'error at line 1, column 10: Rule "foo" is not defined',
        "structured_outputs",
    ),
    (
        {"guided_choice": ["a", "b"], "min_tokens": 2},
        "min_tokens (2) cannot be combined with structured output: the "
        "grammar decides where the output ends; remove min_tokens",
        "min_tokens",
    ),
]


def check_constraint(text: str, check: tuple) -> None:
    kind, rule = check
    if kind == "json":
        jsonschema.validate(json.loads(text), rule)
    elif kind == "regex":
        assert re.fullmatch(rule, text), (text, rule)
    else:
        assert text in rule, (text, rule)


@pytest.fixture(scope="module")
def reference():
    """The in-process engine's answer to every case (float64, as the services run)."""
    from splitserve.engine import LLM

    llm = LLM(dtype="float64", device="cpu", block_size=4, num_kv_blocks=512, num_threads=1)
    params = [SamplingParams(temperature=0, max_tokens=MAX_TOKENS, structured_output=c[3]) for c in CASES]
    outs = llm.generate([c[1] for c in CASES], params)
    for case, out in zip(CASES, outs):
        assert out.finish_reason == "stop", (case[0], out.text)  # every case completes its grammar
        check_constraint(out.text, case[4])
    return {case[0]: out for case, out in zip(CASES, outs)}


@dataclass
class Ports:
    grpc_port: int
    http_port: int


# a compile budget well above what the cases here take, and specs up to 1 MiB (a slow one below is 760 KB)
COMPILE_ARGS = ["--structured-output-compile-timeout-s", "3", "--structured-output-max-spec-bytes", str(1 << 20)]


@pytest.fixture(scope="module", params=["disaggregated", "colocated"])
def stack(request, tmp_path_factory):
    """A gateway over prefill + one decode (shm), or over one colocated worker."""
    logs = tmp_path_factory.mktemp(f"logs-{request.param}")
    if request.param == "disaggregated":
        stack = Stack("shm", logs, num_decode=1, prefill_args=COMPILE_ARGS, decode_args=COMPILE_ARGS)
        yield Ports(stack.grpc_port, stack.http_port)
        stack.stop()
        return
    from splitserve.common.default_model_path import default_model_path

    worker, address = start_service(
        "worker", default_model_path(), logs, "worker-0", service_args=COMPILE_ARGS, **ENGINE
    )
    ports = Ports(free_port(), free_port())
    args = gateway_args(ports.grpc_port, ports.http_port, "", address, "--health-interval-s", "0.2")
    gateway = Proc("gateway", args, logs, "gateway")
    try:
        worker.wait_ready()
        wait_until(lambda: _ready(ports.http_port), 60, lambda: gateway.log_path.read_text()[-3000:])
        yield ports
    finally:
        gateway.stop()
        worker.stop()


def _ready(http_port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{http_port}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def post(stack, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"http://127.0.0.1:{stack.http_port}{path}", json=body, timeout=120)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_rest_completion_matches_the_engine_and_the_constraint(stack, reference, case):
    name, prompt, fields, _, check = case
    r = post(stack, "/v1/completions", {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, **fields})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert (choice["text"], choice["finish_reason"]) == (reference[name].text, "stop")
    check_constraint(choice["text"], check)


def test_rest_chat_and_stream(stack, reference):
    """Chat renders the template (the prompt CHAT_TEXT was written from); streamed chunks add up to the same text."""
    name, _, fields, _, check = CASES[1]
    body = {"messages": [{"role": "user", "content": "Give me JSON"}], "max_tokens": MAX_TOKENS, "temperature": 0}
    r = post(stack, "/v1/chat/completions", {**body, **fields})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert (choice["message"]["content"], choice["finish_reason"]) == (reference[name].text, "stop")
    with httpx.stream(
        "POST",
        f"http://127.0.0.1:{stack.http_port}/v1/chat/completions",
        json={**body, **fields, "stream": True},
        timeout=120,
    ) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"])
    assert (text, events[-1]["choices"][0]["finish_reason"]) == (reference[name].text, "stop")
    check_constraint(text, check)


def test_grpc_structured_output(stack, reference):
    stub = generation_pb2_grpc.GenerationStub(grpc.insecure_channel(f"127.0.0.1:{stack.grpc_port}"))
    cases = {  # name -> the proto spec
        "guided_regex": common_pb2.StructuredOutput(regex=REGEX),
        "guided_choice": common_pb2.StructuredOutput(choice=common_pb2.Choices(values=CHOICES)),
        "structured_outputs json": common_pb2.StructuredOutput(
            json_schema=json.dumps(FLAGS), disable_any_whitespace=True
        ),
    }
    for name, spec in cases.items():
        prompt = next(c[1] for c in CASES if c[0] == name)
        sampling = common_pb2.SamplingParams(temperature=0, max_tokens=MAX_TOKENS, structured_output=spec)
        out = list(stub.Generate(generation_pb2.GenerateRequest(text=prompt, sampling=sampling), timeout=120))
        assert "".join(m.text for m in out) == reference[name].text, name
        assert [t for m in out for t in m.token_ids] == reference[name].token_ids, name
        assert out[-1].finish_reason == common_pb2.FINISH_REASON_STOP
    bad = common_pb2.SamplingParams(max_tokens=4, structured_output=common_pb2.StructuredOutput(regex="(?=a)b"))
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Generate(generation_pb2.GenerateRequest(text=CODE, sampling=bad), timeout=120))
    assert (err.value.code(), err.value.details()) == (
        grpc.StatusCode.INVALID_ARGUMENT,
        "sampling.structured_output.regex: invalid regex: Regex parsing error at position 3: Lookahead is not "
        "supported yet.",
    )


@pytest.mark.parametrize("fields, message, param", BAD, ids=[b[2] for b in BAD])
def test_bad_specs_are_400_naming_the_field(stack, fields, message, param):
    r = post(stack, "/v1/completions", {"prompt": CODE, "max_tokens": 4, **fields})
    assert (r.status_code, r.json()["error"]["message"], r.json()["error"]["param"]) == (400, message, param)
    ok = post(stack, "/v1/completions", {"prompt": CODE, "max_tokens": 8, "temperature": 0, "guided_regex": REGEX})
    assert ok.status_code == 200 and re.fullmatch(REGEX, ok.json()["choices"][0]["text"]), ok.text  # still serves


# Specs that compile but admit no output (refused when the engine compiles them: 400 naming the field), and one
# that reaches a dead end after its first token (the engine ends that request alone, with an error).
NO_OUTPUT = [
    ({"guided_json": {"$ref": "#"}}, "guided_json: JSON schema admits no output", "guided_json"),
    ({"guided_json": {"allOf": [{"$ref": "#"}]}}, "guided_json: JSON schema admits no output", "guided_json"),
    (
        {"guided_json": {"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}},
        "guided_json: JSON schema admits no output",
        "guided_json",
    ),
    ({"guided_grammar": "root ::= root"}, "guided_grammar: grammar admits no output", "guided_grammar"),
]
NO_OUTPUT_TAIL = ": no token can start a string it matches (a rule or schema that only refers to itself?)"
DEAD_END = {"guided_regex": "a[^\\s\\S]"}


def stream_lengths(stack, num_streams: int, max_tokens: int):
    """Start `num_streams` streamed completions of exactly `max_tokens` tokens; a callable that waits for them and
    returns each one's (tokens streamed, finish_reason)."""
    import concurrent.futures

    def one(i: int):
        body = {"prompt": f"import os{i}", "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
        body["stream_options"] = {"include_usage": True}
        with httpx.stream("POST", f"http://127.0.0.1:{stack.http_port}/v1/completions", json=body, timeout=120) as r:
            events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
        reasons = [e["choices"][0]["finish_reason"] for e in events if e["choices"]]
        return events[-1]["usage"]["completion_tokens"], reasons[-1]

    pool = concurrent.futures.ThreadPoolExecutor(num_streams)
    futures = [pool.submit(one, i) for i in range(num_streams)]
    return lambda: [f.result(timeout=180) for f in futures]


@pytest.mark.parametrize("fields, message, param", NO_OUTPUT, ids=[str(f) for f, _, _ in NO_OUTPUT])
def test_a_spec_that_admits_no_output_is_400_and_other_streams_finish(stack, fields, message, param):
    streams = stream_lengths(stack, 4, 40)
    r = post(stack, "/v1/completions", {"prompt": CODE, "max_tokens": 8, **fields})
    assert (r.status_code, r.json()["error"]["message"], r.json()["error"]["param"]) == (
        400,
        message + NO_OUTPUT_TAIL,
        param,
    )
    assert streams() == [(40, "length")] * 4
    ok = post(stack, "/v1/completions", {"prompt": CODE, "max_tokens": 8, "temperature": 0, "guided_regex": REGEX})
    assert ok.status_code == 200 and re.fullmatch(REGEX, ok.json()["choices"][0]["text"]), ok.text


def test_a_grammar_dead_end_ends_that_request_alone(stack):
    """The regex admits `a` and then nothing: the engine running the request (the decode, or the worker) ends it
    with an error naming the dead end; its other streams run to the end and the engine keeps serving."""
    streams = stream_lengths(stack, 4, 40)
    r = post(stack, "/v1/completions", {"prompt": CODE, "max_tokens": 8, "temperature": 0, **DEAD_END})
    assert r.status_code == 500, r.text  # after its first token: an error of the request, not a refusal
    assert re.fullmatch(
        r"decode instance (decode|worker)-0@\d+: structured output: the grammar allows no token after 1 output "
        r"tokens \(a dead end in the spec\)",
        r.json()["error"]["message"],
    ), r.text
    assert streams() == [(40, "length")] * 4
    ok = post(stack, "/v1/completions", {"prompt": CODE, "max_tokens": 8, "temperature": 0, "guided_regex": REGEX})
    assert ok.status_code == 200 and re.fullmatch(REGEX, ok.json()["choices"][0]["text"]), ok.text


def slow_schema(num_properties: int) -> dict:
    """Many required properties, some with patterns: compiling it takes about 2 ms a property on these CPUs."""
    props = {
        f"p{k}": {"type": ("string", "integer", "boolean")[k % 3]}
        | ({"pattern": f"[a-z]{{2,{k % 9 + 3}}}"} if k % 3 == 0 else {})
        for k in range(num_properties)
    }
    return {"type": "object", "properties": props, "required": list(props)}


def test_a_compile_past_its_budget_is_400_naming_the_flag_and_other_streams_finish(stack):
    """A 760 KB schema (about 30 s to compile here) is refused at the 3 s budget, its compile worker killed; the streams
    running meanwhile finish, and a spec sent after compiles and serves."""
    streams = stream_lengths(stack, 4, 40)
    r = post(stack, "/v1/completions", {"prompt": CODE, "max_tokens": 8, "guided_json": slow_schema(16_000)})
    assert (r.status_code, r.json()["error"]["message"], r.json()["error"]["param"]) == (
        400,
        "guided_json: JSON schema did not compile within 3 s (--structured-output-compile-timeout-s)",
        "guided_json",
    )
    assert streams() == [(40, "length")] * 4
    ok = post(stack, "/v1/completions", {"prompt": CODE, "max_tokens": 8, "temperature": 0, "guided_regex": REGEX})
    assert ok.status_code == 200 and re.fullmatch(REGEX, ok.json()["choices"][0]["text"]), ok.text
