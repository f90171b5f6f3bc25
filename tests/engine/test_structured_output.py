"""Structured output without services: the spec type and its wire form, the REST field parsing, xgrammar's
refusals, the token mask against a per-token reference, and the engine (colocated, and a prefill engine's
first token handed to a decode engine) on the default model."""

from __future__ import annotations

import json
import re

import pytest
import torch

from splitserve.common import wire
from splitserve.common.sampling_params import SamplingParams
from splitserve.common.structured_output import StructuredOutput, refusal_detail
from splitserve.engine.grammar import (
    TokenMask,
    apply_token_mask,
    build_token_mask,
    check_spec,
    choice_grammar,
)
from splitserve.engine.grammar_backend import GrammarBackend
from splitserve.gateway.errors import GatewayError
from splitserve.gateway.rest_structured import structured_output_of
from splitserve.protos import common_pb2

CODE = "def f(x):\n    return "
SCHEMA = {"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 4}


# -- the spec and its wire form ------------------------------------------------------------------


@pytest.mark.parametrize(
    "spec",
    [
        StructuredOutput(json='{"type":"object"}', disable_any_whitespace=True),
        StructuredOutput(json_object=True),
        StructuredOutput(regex=r"\d+"),
        StructuredOutput(choice=("a", 'b"\n')),
        StructuredOutput(grammar='root ::= "x"'),
    ],
)
def test_spec_round_trips_through_dict_and_proto(spec):
    params = SamplingParams(temperature=0, structured_output=spec)
    assert SamplingParams.from_dict(params.to_dict()) == params
    assert wire.sampling_from_proto(wire.sampling_to_proto(params)) == params
    assert json.loads(json.dumps(params.to_dict())) == params.to_dict()


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({}, "structured output must set exactly one of json, json_object, regex, choice, grammar; got none"),
        (
            {"regex": "a", "grammar": "b"},
            "structured output must set exactly one of json, json_object, regex, choice, grammar; got regex, grammar",
        ),
        (
            {"json": "{"},
            "structured output json is not valid JSON: Expecting property name enclosed in double quotes: "
            "line 1 column 2 (char 1)",
        ),
        ({"json": "[1]"}, "structured output json must be a JSON schema (an object), got list"),
        ({"choice": ()}, "structured output choice must be a non-empty list of strings, got ()"),
        ({"choice": ("a", "")}, "structured output choice must hold non-empty strings, got ''"),
        ({"regex": ""}, "structured output regex must be a non-empty string, got ''"),
    ],
)
def test_spec_shape_errors(kwargs, message):
    with pytest.raises(ValueError) as err:
        StructuredOutput(**kwargs)
    assert str(err.value) == message


def test_min_tokens_is_refused_with_a_grammar():
    with pytest.raises(ValueError) as err:
        SamplingParams(min_tokens=1, structured_output=StructuredOutput(regex="a"))
    assert str(err.value) == (
        "min_tokens (1) cannot be combined with structured output: the grammar decides where the output ends; "
        "remove min_tokens"
    )


# -- REST fields ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "body, spec, field",
    [
        ({}, None, ""),
        ({"response_format": {"type": "text"}}, None, ""),
        ({"response_format": {"type": "json_object"}}, StructuredOutput(json_object=True), "response_format"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "object"}}}},
            StructuredOutput(json='{"type":"object"}'),
            "response_format.json_schema.schema",
        ),
        ({"guided_json": '{"type": "string"}'}, StructuredOutput(json='{"type":"string"}'), "guided_json"),
        ({"guided_regex": "a+"}, StructuredOutput(regex="a+"), "guided_regex"),
        ({"guided_choice": ["x", "y"]}, StructuredOutput(choice=("x", "y")), "guided_choice"),
        ({"guided_grammar": 'root ::= "a"'}, StructuredOutput(grammar='root ::= "a"'), "guided_grammar"),
        (
            {"structured_outputs": {"json": {"type": "object"}, "disable_any_whitespace": True}},
            StructuredOutput(json='{"type":"object"}', disable_any_whitespace=True),
            "structured_outputs.json",
        ),
        (
            {"structured_outputs": {"json_object": True}},
            StructuredOutput(json_object=True),
            "structured_outputs.json_object",
        ),
        (
            {"structured_outputs": {"choice": ["a"], "disable_fallback": False}},
            StructuredOutput(choice=("a",)),
            "structured_outputs.choice",
        ),
    ],
)
def test_rest_fields_give_one_spec(body, spec, field):
    assert structured_output_of(body) == (spec, field)


@pytest.mark.parametrize(
    "body, message, param",
    [
        (
            {"response_format": "json"},
            "response_format must be an object with a \"type\" (text, json_object, json_schema), got 'json'",
            "response_format",
        ),
        (
            {"response_format": {"type": "xml"}},
            "response_format.type must be text, json_object or json_schema, got 'xml'",
            "response_format",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}},
            "response_format.json_schema.name must be a string",
            "response_format",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "n"}}},
            "response_format.json_schema.schema must be set (the JSON schema)",
            "response_format",
        ),
        (
            {"guided_json": "{"},
            "guided_json is not valid JSON: Expecting property name enclosed in double quotes: "
            "line 1 column 2 (char 1)",
            "guided_json",
        ),
        ({"guided_json": [1]}, "guided_json must be a JSON schema (an object), got list", "guided_json"),
        ({"guided_regex": 5}, "guided_regex must be a non-empty string, got 5", "guided_regex"),
        ({"guided_choice": []}, "guided_choice must be a non-empty list of strings, got []", "guided_choice"),
        ({"guided_choice": ["a", 1]}, "guided_choice must hold non-empty strings, got 1", "guided_choice"),
        (
            {"guided_regex": "a", "guided_choice": ["a"]},
            "only one structured output constraint may be set per request; got guided_regex and guided_choice",
            "guided_choice",
        ),
        (
            {"structured_outputs": {"regex": "a", "choice": ["a"]}},
            "structured_outputs must set exactly one of json, regex, choice, grammar, json_object; got regex, choice",
            "structured_outputs",
        ),
        (
            {"structured_outputs": {"regex": "a", "backend": "x"}},
            "structured_outputs has unknown fields backend; it "
            "takes choice, disable_additional_properties, disable_any_whitespace, disable_fallback, grammar, json, "
            "json_object, regex, structural_tag, whitespace_pattern",
            "structured_outputs",
        ),
        (
            {"structured_outputs": {"regex": "a", "whitespace_pattern": " "}},
            "structured_outputs.whitespace_pattern is not supported (got ' '); remove it",
            "structured_outputs",
        ),
        (
            {"structured_outputs": {"json_object": 1}},
            "structured_outputs.json_object must be true or absent, got 1",
            "structured_outputs",
        ),
    ],
)
def test_rest_field_errors_name_the_field(body, message, param):
    with pytest.raises(GatewayError) as err:
        structured_output_of(body)
    assert (err.value.kind, err.value.message, err.value.param) == ("invalid_argument", message, param)


# -- xgrammar's refusals ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "spec, detail",
    [
        (
            StructuredOutput(regex="(ab"),
            "invalid regex: Regex parsing error at position 4: The parenthesis is not closed.",
        ),
        (
            StructuredOutput(regex="(?=a)b"),
            "invalid regex: Regex parsing error at position 3: Lookahead is not supported yet.",
        ),
        (StructuredOutput(json='{"type": "objectx"}'), 'invalid JSON schema: Unsupported type "objectx"'),
        (
            StructuredOutput(grammar="root ::= foo"),
            'invalid grammar: EBNF parser error at line 1, column 10: Rule "foo" is not defined',
        ),
    ],
)
def test_check_spec_refuses_with_xgrammars_message(spec, detail):
    with pytest.raises(ValueError) as err:
        check_spec(spec)
    assert refusal_detail(str(err.value)) == detail


def test_choice_grammar_accepts_exactly_the_choices():
    import xgrammar as xgr

    choices = ("yes", 'say "hi"', "back\\slash", "two\nlines\tand tab")
    assert choice_grammar(("a", 'b"')) == 'root ::= "a" | "b\\""'
    grammar = xgr.Grammar.from_ebnf(choice_grammar(choices))
    for text in [*choices, "ye", "yess", "say hi", "back\\\\slash"]:
        assert xgr.testing._is_grammar_accept_string(grammar, text) == (text in choices), text


# -- the token mask --------------------------------------------------------------------------------


@pytest.mark.parametrize("vocab_size", [5, 32, 70])
def test_apply_token_mask_matches_a_per_token_reference(vocab_size):
    gen = torch.Generator().manual_seed(vocab_size)
    logits = torch.randn(4, vocab_size, generator=gen, dtype=torch.float64)
    words = -(-vocab_size // 32)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (2, words), generator=gen, dtype=torch.int64).to(torch.int32)
    rows = [3, 1]
    expected = logits.clone()
    for i, row in enumerate(rows):
        for t in range(vocab_size):
            if not (int(bitmask[i, t // 32]) >> (t % 32)) & 1:
                expected[row, t] = float("-inf")
    got = apply_token_mask(logits.clone(), TokenMask(torch.tensor(rows), bitmask))
    assert torch.equal(got, expected)


def test_build_token_mask_fills_each_grammar_row():
    class Allows:
        def __init__(self, token_ids):
            self.token_ids = token_ids

        def fill(self, bitmask, row):
            bitmask[row] = 0
            for t in self.token_ids:
                bitmask[row, t // 32] |= 1 << (t % 32) if t % 32 != 31 else -(2**31)

    mask = build_token_mask([(2, Allows([0, 31, 33])), (0, Allows([40]))], 41, torch.device("cpu"), pin=False)
    assert mask.rows.tolist() == [2, 0]
    logits = apply_token_mask(torch.zeros(3, 41), mask)
    assert [torch.isfinite(row).nonzero().flatten().tolist() for row in logits] == [[40], list(range(41)), [0, 31, 33]]
    assert build_token_mask([], 41, torch.device("cpu"), pin=False) is None


# -- the engine -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llm():
    from splitserve.engine import LLM

    return LLM(dtype="float64", device="cpu", block_size=4, num_kv_blocks=256, num_threads=1)


def test_engine_output_follows_the_grammar_and_ends_with_stop(llm):
    specs = [
        StructuredOutput(json=json.dumps(SCHEMA)),
        StructuredOutput(regex=r"\d{3}-[a-z]{2,5}"),
        StructuredOutput(choice=("yes", "no")),
    ]
    outs = llm.generate([CODE] * 3, [SamplingParams(temperature=0, max_tokens=32, structured_output=s) for s in specs])
    assert [o.finish_reason for o in outs] == ["stop"] * 3
    assert isinstance(json.loads(outs[0].text), list) and 1 <= len(json.loads(outs[0].text)) <= 4
    assert re.fullmatch(r"\d{3}-[a-z]{2,5}", outs[1].text) and outs[2].text in ("yes", "no")
    assert [o.token_ids[-1] for o in outs] == [0, 0, 0]  # the grammar ends with the model's EOS
    # seeded sampling under the grammar: still inside it, and the same tokens for the same seed
    sampled = llm.generate(
        [CODE] * 2, SamplingParams(temperature=1.0, seed=7, max_tokens=32, structured_output=specs[1])
    )
    assert sampled[0].token_ids == sampled[1].token_ids and re.fullmatch(r"\d{3}-[a-z]{2,5}", sampled[0].text)


@pytest.mark.parametrize(
    "spec, label",
    [
        (StructuredOutput(json='{"$ref": "#"}'), "JSON schema"),
        (StructuredOutput(json='{"allOf": [{"$ref": "#"}]}'), "JSON schema"),
        (StructuredOutput(json='{"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}'), "JSON schema"),
        (StructuredOutput(grammar="root ::= root"), "grammar"),
    ],
)
def test_a_spec_that_admits_no_output_is_refused_when_it_compiles(llm, spec, label):
    from splitserve.engine.outputs import RequestError

    with pytest.raises(RequestError) as info:
        llm.generate([CODE], SamplingParams(temperature=0, max_tokens=4, structured_output=spec))
    assert str(info.value) == (
        f"structured output: {label} admits no output: no token can start a string it matches "
        "(a rule or schema that only refers to itself?)"
    )
    (out,) = llm.generate([CODE], SamplingParams(temperature=0, max_tokens=4))  # the engine serves on
    assert out.finish_reason == "length"


@pytest.mark.parametrize("sampling", [dict(temperature=0), dict(temperature=0.8, seed=3, top_k=5, logprobs=2)])
def test_a_grammar_dead_end_ends_that_request_alone(llm, sampling):
    """`a[^\\s\\S]` admits `a`, then no token: the sampler picks a masked one, the grammar refuses it, and that
    request ends with finish_reason error and the reason; the request beside it gets its own tokens."""
    (alone,) = llm.generate(["import os"], SamplingParams(temperature=0, max_tokens=8))
    dead_end = SamplingParams(max_tokens=8, structured_output=StructuredOutput(regex="a[^\\s\\S]"), **sampling)
    outs = llm.generate([CODE, "import os"], [dead_end, SamplingParams(temperature=0, max_tokens=8)])
    assert (outs[0].finish_reason, outs[0].text) == ("error", "a")
    assert (
        outs[0].error == "structured output: the grammar allows no token after 1 output tokens (a dead end in the spec)"
    )
    assert (outs[1].finish_reason, outs[1].token_ids) == ("length", alone.token_ids)


def test_a_complete_grammar_ends_the_request_under_ignore_eos_and_max_tokens_cuts_it(llm):
    spec = StructuredOutput(choice=("yes", "no"))
    (out,) = llm.generate([CODE], SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, structured_output=spec))
    assert (out.finish_reason, out.text, out.token_ids[-1]) == ("stop", "yes", 0)
    (cut,) = llm.generate(
        [CODE], SamplingParams(temperature=0, max_tokens=2, structured_output=StructuredOutput(json=json.dumps(SCHEMA)))
    )
    assert cut.finish_reason == "length" and len(cut.token_ids) == 2


def test_prefill_first_token_then_decode_equals_colocated(llm):
    """The prefill role samples the first token under the grammar; a decode engine imports the request with that
    token (its matcher starts over from the spec and accepts it) and continues exactly as the colocated engine."""
    from splitserve.engine.outputs import RequestError

    spec = StructuredOutput(json=json.dumps(SCHEMA))
    params = SamplingParams(temperature=0, max_tokens=32, structured_output=spec)
    (colocated,) = llm.generate([CODE], params)
    prompt = llm.tokenizer.encode(CODE)
    engine = llm.engine
    # the first token as a prefill samples it
    engine.add_request("p", prompt, params, seed=1)
    first = None
    while first is None:
        first = next((o.new_token_ids[0] for o in engine.step() if o.request_id == "p"), None)
    engine.abort("p")
    assert first == colocated.token_ids[0]
    # the decode side: fresh matcher from the spec, advanced over the first token
    request = engine.make_request("d", prompt, params, seed=1)
    request.append_output(first)
    request.num_computed_tokens = 0
    engine.scheduler.add(request)
    tokens = [first]
    while engine.has_unfinished():
        tokens += [t for o in engine.step() if o.request_id == "d" for t in o.new_token_ids]
    assert tokens == colocated.token_ids
    # a first token the grammar forbids is refused by begin_import, its blocks freed
    free = engine.num_free_blocks
    with pytest.raises(RequestError) as err:
        engine.begin_import("x", prompt, params, 1, first_token_id=llm.tokenizer.encode("x")[0])
    assert "does not match the request's grammar" in str(err.value) and engine.num_free_blocks == free


def test_engine_without_tokenizer_refuses_structured_output(tmp_path):
    backend = GrammarBackend(str(tmp_path), 64, (0,))
    with pytest.raises(ValueError) as err:
        backend.matcher(StructuredOutput(regex="a"))
    assert refusal_detail(str(err.value)) == (
        f"this engine serves {str(tmp_path)!r}, which has no tokenizer files; structured output needs the model's "
        "tokenizer"
    )


def test_async_scheduling_reads_a_grammar_request_before_its_next_step():
    """Under asynchronous scheduling a request with a grammar gives up the one-step lag for itself (its matcher
    must have seen every earlier token when its mask is filled): mixed with free-running requests, every output
    equals the synchronous loop's, and every output of the grammar requests stays inside their grammar."""
    from splitserve.engine import LLM

    prompts = [CODE, "import os\n", CODE, "class A:\n"]
    spec = StructuredOutput(regex=r"\d{3}-[a-z]{2,5}")
    params = [
        SamplingParams(temperature=0, max_tokens=24, structured_output=spec),
        SamplingParams(temperature=0, max_tokens=24),
        SamplingParams(
            temperature=1.0, seed=3, max_tokens=24, structured_output=StructuredOutput(json=json.dumps(SCHEMA))
        ),
        SamplingParams(temperature=1.0, seed=4, max_tokens=24),
    ]
    results = []
    for lagged in (False, True):
        llm = LLM(
            dtype="float64", device="cpu", block_size=4, num_kv_blocks=256, num_threads=1, async_scheduling=lagged
        )
        assert llm.engine.async_scheduling is lagged
        results.append([(o.token_ids, o.finish_reason) for o in llm.generate(prompts, params)])
        assert llm.engine.num_free_blocks == llm.engine.pool.num_blocks
    assert results[0] == results[1]
    assert results[0][0][1] == "stop" and results[0][2][1] == "stop"


@pytest.mark.parametrize(
    "spec, message",
    [
        (
            common_pb2.StructuredOutput(),
            "sampling.structured_output must set one of json_schema, json_object, regex, choice, grammar",
        ),
        (
            common_pb2.StructuredOutput(regex=""),
            "sampling.structured_output.regex is invalid: structured output regex must be a non-empty string, got ''",
        ),
        (
            common_pb2.StructuredOutput(json_schema="[1]"),
            "sampling.structured_output.json_schema is invalid: structured "
            "output json must be a JSON schema (an object), got list",
        ),
        (
            common_pb2.StructuredOutput(choice=common_pb2.Choices(values=["a", ""])),
            "sampling.structured_output.choice "
            "is invalid: structured output choice must hold non-empty strings, got ''",
        ),
    ],
)
def test_grpc_spec_errors_name_the_proto_field(spec, message):
    from splitserve.gateway.generation_input import sampling_values_from_proto

    with pytest.raises(GatewayError) as err:
        sampling_values_from_proto(common_pb2.SamplingParams(structured_output=spec))
    assert (err.value.kind, err.value.message, err.value.param) == ("invalid_argument", message, "structured_output")


def test_the_core_loop_steps_on_while_a_grammar_compiles_and_then_admits_the_request():
    """A request with a spec waits in the core loop while a worker compiles its grammar (the engine then finds it
    in its cache); the loop keeps stepping the running batch meanwhile; an abort while compiling ends it and
    cancels its compile (nobody else waits for it)."""
    from concurrent.futures import Future
    from types import SimpleNamespace

    from splitserve.engine.core_process import messages as m
    from tests.engine.test_core_loop import Driver, Engine, FakeConnector, Gate, Pipe

    futures: dict[str, Future] = {}
    cancelled: list[Future] = []
    vetted: dict[str, bool] = {}

    def prepare(spec, vetted_elsewhere=False):
        vetted[spec.regex] = vetted_elsewhere
        return futures.setdefault(spec.regex, Future())

    class GrammarEngine(Engine):
        def __init__(self, pipe):
            super().__init__(pipe)
            self.added: list[tuple[str, int]] = []  # (request id, steps run before it was added)
            self.grammars = SimpleNamespace(
                prepare=lambda spec, vetted=False: prepare(spec, vetted), cancel=cancelled.append
            )

        def add_request(self, request_id, *args, **kwargs):
            self.added.append((request_id, self.steps))

        def abort(self, request_id):
            return False

    pipe = Pipe()
    engine = GrammarEngine(pipe)
    driver = Driver(engine, FakeConnector(Gate(opened=True)), pipe).start()
    try:
        params = SamplingParams(structured_output=StructuredOutput(regex="a+"))
        driver.send(m.AddRequest("g", [1, 2], params), m.AddRequest("free", [1, 2], SamplingParams()))
        other = SamplingParams(structured_output=StructuredOutput(regex="b+"))
        driver.send(m.AddRequest("gone", [1, 2], other))
        driver.until(lambda: [rid for rid, _ in engine.added] == ["free"] and engine.steps >= 5, 10, "no steps")
        assert [rid for rid, _ in engine.added] == ["free"]  # "g" and "gone" wait for their grammars
        driver.send(m.Abort(["gone"]))
        driver.until(lambda: "gone" in driver.finished, 10, "no abort output for the compiling request")
        assert driver.finished["gone"].finish_reason == "abort"
        assert cancelled == [futures["b+"]]
        steps = engine.steps
        futures["a+"].set_result(None)
        driver.until(lambda: len(engine.added) == 2, 10, "the compiled request was never added")
        assert engine.added[1][0] == "g" and engine.added[1][1] >= steps
        futures["b+"].set_result(None)
        driver.until(lambda: engine.steps > steps + 5, 10, "no steps")
        assert [rid for rid, _ in engine.added] == ["free", "g"]  # the aborted one never reaches the engine
        # an imported request's spec compiled within the budget on its prefill: no trial here
        params_c = SamplingParams(structured_output=StructuredOutput(regex="c+"))
        imported = m.ImportKv("i", [1, 2], params_c, 0, 5, None, 0, None)  # (never pulled: it waits for c+)
        driver.send(imported)
        driver.until(lambda: "c+" in vetted, 10, "the imported request's spec was not prepared")
        assert vetted == {"a+": False, "b+": False, "c+": True}
    finally:
        engine.has_work = False
        driver.stop()


def test_forks_of_a_request_waiting_for_its_grammar_are_aborted_one_by_one_as_the_gateway_sends_them():
    """n > 1 with a spec: the gateway aborts a request's sequences one message each. A fork aborted while its
    request compiles ends at once and never reaches the engine (the engine drops it when the request arrives);
    the request aborted before its last fork leaves that fork to wait for the grammar alone, seeded as it would
    have been forked (seed + its index). The compile goes on while any of them waits for it."""
    from concurrent.futures import Future
    from types import SimpleNamespace

    from splitserve.engine.core_process import messages as m
    from tests.engine.test_core_loop import Driver, Engine, FakeConnector, Gate, Pipe

    futures: dict[str, Future] = {}
    cancelled: list[Future] = []

    class GrammarEngine(Engine):
        def __init__(self, pipe):
            super().__init__(pipe, has_work=False)
            self.calls: list[tuple] = []  # ("add", id, fork ids, seed) | ("abort", id)
            self.grammars = SimpleNamespace(
                prepare=lambda spec, vetted=False: futures.setdefault(spec.regex, Future()), cancel=cancelled.append
            )

        def add_request(self, request_id, prompt, params, fork_ids=(), priority=0, seed=None, share=0):
            self.calls.append(("add", request_id, list(fork_ids), seed))

        def abort(self, request_id):
            self.calls.append(("abort", request_id))
            return False

    pipe = Pipe()
    engine = GrammarEngine(pipe)
    driver = Driver(engine, FakeConnector(Gate(opened=True)), pipe).start()
    try:
        forks = ["g~1", "g~2", "g~3"]
        params = SamplingParams(structured_output=StructuredOutput(regex="a+"))
        driver.send(m.AddRequest("g", [1, 2], params, seed=40, fork_ids=forks))
        driver.send(
            m.AddRequest(
                "h", [1, 2], SamplingParams(structured_output=StructuredOutput(regex="b+")), 0, 7, ["h~1", "h~2"]
            )
        )
        driver.send(m.Abort(["g~1"]), m.Abort(["h~2"]))
        driver.until(lambda: {"g~1", "h~2"} <= driver.finished.keys(), 10, "no abort output for the forks")
        driver.send(m.Abort(["g", "g~3"]))  # g and one more fork at once; g~2 is left
        driver.until(lambda: {"g", "g~3"} <= driver.finished.keys(), 10, "no abort output for g")
        assert {r: driver.finished[r].finish_reason for r in ("g", "g~1", "g~3", "h~2")} == dict.fromkeys(
            ("g", "g~1", "g~3", "h~2"), "abort"
        )
        assert [c for c in engine.calls if c[0] == "add"] == []  # nothing reached the engine yet
        assert cancelled == []  # g~2 and h wait for them
        futures["a+"].set_result(None)
        futures["b+"].set_result(None)
        driver.until(lambda: len([c for c in engine.calls if c[0] == "add"]) == 2, 10, "nothing was admitted")
        adds = [c for c in engine.calls if c[0] == "add"]
        # g~2 alone with g's seed + 2; h with both forks (their seeds stay seed + index), then h~2 dropped
        assert sorted(adds) == [("add", "g~2", [], 42), ("add", "h", ["h~1", "h~2"], 7)]
        assert engine.calls[engine.calls.index(("add", "h", ["h~1", "h~2"], 7)) + 1] == ("abort", "h~2")
        assert driver.loop.kv.aborted_forks == {}
    finally:
        driver.stop()


def test_parallel_sequences_each_follow_the_grammar(llm):
    """n > 1 (engine/forks.py): every forked sequence has a matcher of its own (made from the spec like the
    parent's) and its own seed; each output is inside the grammar and ends with stop."""
    engine = llm.engine
    spec = StructuredOutput(regex=r"[a-z]{1,6}-\d{2}")
    params = SamplingParams(temperature=1.0, seed=11, max_tokens=24, structured_output=spec)
    engine.add_request("n0", llm.tokenizer.encode(CODE), params, fork_ids=["n1", "n2", "n3"])
    tokens: dict[str, list[int]] = {}
    finish: dict[str, str] = {}
    while engine.has_unfinished():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finished:
                finish[out.request_id] = out.finish_reason
    texts = {rid: llm.tokenizer.decode(ids, skip_special_tokens=True) for rid, ids in tokens.items()}
    assert finish == dict.fromkeys(["n0", "n1", "n2", "n3"], "stop")
    assert all(re.fullmatch(r"[a-z]{1,6}-\d{2}", text) for text in texts.values()), texts
    assert len(set(texts.values())) > 1, texts  # their own seeds: not one answer four times
    assert engine.num_free_blocks == engine.pool.num_blocks
