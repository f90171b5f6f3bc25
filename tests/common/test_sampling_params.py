"""SamplingParams: defaults, normalization, validation messages, dict round trip."""

import json
import pickle

import pytest

from splitserve.common.sampling_params import MAX_LOGPROBS, MAX_STOP_STRINGS, SamplingParams


def test_defaults():
    p = SamplingParams()
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.seed) == (1.0, 1.0, 0, 0.0, None)
    assert (p.repetition_penalty, p.presence_penalty, p.frequency_penalty) == (1.0, 0.0, 0.0)
    assert (p.max_tokens, p.min_tokens, p.stop_token_ids, p.ignore_eos) == (16, 0, (), False)
    assert (p.logprobs, p.stop, p.include_stop_str_in_output) == (None, (), False)
    assert p.skip_special_tokens is True
    assert not p.is_greedy and not p.has_penalties
    assert (MAX_LOGPROBS, MAX_STOP_STRINGS) == (20, 16)


def test_lists_become_tuples_and_ints_become_floats():
    p = SamplingParams(stop_token_ids=[3, 5], stop=["a", "bc"], temperature=0, top_p=1)
    assert p.stop_token_ids == (3, 5) and p.stop == ("a", "bc")
    assert p.temperature == 0.0 and isinstance(p.temperature, float)
    assert p.is_greedy
    assert SamplingParams(stop="x").stop == ("x",)
    assert hash(p) == hash(SamplingParams(stop_token_ids=(3, 5), stop=("a", "bc"), temperature=0))


def test_frozen():
    with pytest.raises(AttributeError):
        SamplingParams().temperature = 0.5


def test_greedy_and_penalty_flags():
    assert SamplingParams(temperature=1e-6).is_greedy
    assert not SamplingParams(temperature=1e-5).is_greedy
    assert SamplingParams(repetition_penalty=1.2).has_penalties
    assert SamplingParams(presence_penalty=-0.5).has_penalties
    assert SamplingParams(frequency_penalty=0.1).has_penalties


def test_plain_greedy_is_greedy_with_nothing_else_for_the_sampler_and_computed_once():
    assert SamplingParams(temperature=0).plain_greedy
    # min_tokens is checked per output position by the caller; prompt logprobs and stop ids are not the sampler's
    assert SamplingParams(temperature=0, min_tokens=3, prompt_logprobs=2, stop_token_ids=[5]).plain_greedy
    for kwargs in (
        dict(temperature=0.5),
        dict(temperature=0, logprobs=0),
        dict(temperature=0, repetition_penalty=1.1),
        dict(temperature=0, frequency_penalty=0.2),
        dict(temperature=0, logit_bias={3: 1.0}),
    ):
        assert not SamplingParams(**kwargs).plain_greedy, kwargs
    p = SamplingParams(temperature=0)
    assert p.plain_greedy and vars(p)["plain_greedy"] is True  # cached on the instance
    back = pickle.loads(pickle.dumps(p))
    assert back == p and back.plain_greedy and back.to_dict() == p.to_dict()


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"temperature": -1}, "temperature must be >= 0 and <= 100, got -1.0"),
        ({"temperature": 101}, "temperature must be >= 0 and <= 100, got 101.0"),
        ({"temperature": float("nan")}, "temperature must be >= 0 and <= 100, got nan"),
        ({"temperature": "hot"}, "temperature must be a number, got 'hot'"),
        ({"top_p": 0.0}, "top_p must be > 0 and <= 1, got 0.0"),
        ({"top_p": 1.5}, "top_p must be > 0 and <= 1, got 1.5"),
        ({"top_k": -2}, "top_k must be -1 or >= 0 (-1 and 0 mean off), got -2"),
        ({"top_k": 2.5}, "top_k must be an integer, got 2.5"),
        ({"min_p": 1.1}, "min_p must be >= 0 and <= 1, got 1.1"),
        ({"repetition_penalty": 0}, "repetition_penalty must be > 0 and <= 10, got 0.0"),
        ({"repetition_penalty": 11}, "repetition_penalty must be > 0 and <= 10, got 11.0"),
        ({"presence_penalty": -2.5}, "presence_penalty must be >= -2 and <= 2, got -2.5"),
        ({"frequency_penalty": 3}, "frequency_penalty must be >= -2 and <= 2, got 3.0"),
        ({"seed": -1}, "seed must be >= 0 and <= 2**63-1, got -1"),
        ({"seed": 2**63}, f"seed must be >= 0 and <= 2**63-1, got {2**63}"),
        ({"seed": True}, "seed must be an integer, got True"),
        ({"max_tokens": 0}, "max_tokens must be >= 1 or None, got 0"),
        ({"min_tokens": -1}, "min_tokens must be >= 0, got -1"),
        ({"min_tokens": 5, "max_tokens": 4}, "min_tokens must be >= 0 and <= max_tokens (4), got 5"),
        ({"logprobs": 21}, "logprobs must be >= 0 and <= 20, got 21"),
        ({"logprobs": -1}, "logprobs must be >= 0 and <= 20, got -1"),
        ({"stop_token_ids": [1, -3]}, "stop_token_ids must be >= 0, got -3"),
        ({"stop_token_ids": 7}, "stop_token_ids must be a list of integers, got 7"),
        ({"stop": ["a", ""]}, "stop strings must be non-empty strings, got ''"),
        ({"stop": ["x" * 257]}, "stop strings must be at most 256 characters, got one of 257"),
        ({"stop": ["s"] * 17}, "stop must have at most 16 strings, got 17"),
        ({"ignore_eos": 1}, "ignore_eos must be a bool, got 1"),
        ({"logit_bias": {-1: 5}}, "logit_bias token ids must be >= 0, got -1"),
        ({"logit_bias": {"3": 5}}, "logit_bias token ids must be an integer, got '3'"),
        ({"logit_bias": {3: "x"}}, "logit_bias values must be a number, got 'x'"),
        ({"logit_bias": {3: float("inf")}}, "logit_bias values must be finite numbers in [-100, 100], got inf"),
        ({"logit_bias": [(3, 1), (3, 2)]}, "logit_bias has token id 3 twice"),
        ({"logit_bias": 5}, "logit_bias must map token ids to numbers, got 5"),
        ({"logit_bias": {i: 1 for i in range(1025)}}, "logit_bias must have at most 1024 tokens, got 1025"),
    ],
)
def test_validation_messages(kwargs, message):
    with pytest.raises(ValueError) as excinfo:
        SamplingParams(**kwargs)
    assert str(excinfo.value) == message


def test_boundaries_accepted():
    p = SamplingParams(
        temperature=100,
        top_p=1e-9,
        top_k=-1,
        min_p=1.0,
        seed=2**63 - 1,
        repetition_penalty=10,
        presence_penalty=-2,
        frequency_penalty=2,
        max_tokens=None,
        min_tokens=1000,
        logprobs=20,
        stop=["y" * 256] * 16,
    )
    assert p.top_k == -1 and p.max_tokens is None and p.logprobs == 20


def test_logit_bias_becomes_sorted_pairs_clamped_to_plus_minus_100_as_vllm():
    p = SamplingParams(logit_bias={9: 250, 2: -0.5, 5: -1e9, 1024: 7})
    assert p.logit_bias == ((2, -0.5), (5, -100.0), (9, 100.0), (1024, 7.0))


def test_dict_round_trip_through_json():
    p = SamplingParams(
        temperature=0.7,
        top_k=40,
        seed=7,
        stop=["\n\n"],
        stop_token_ids=[2],
        logprobs=3,
        max_tokens=None,
        logit_bias={4: 1.5, 2: -100},
    )
    d = json.loads(json.dumps(p.to_dict()))
    assert d["stop"] == ["\n\n"] and d["stop_token_ids"] == [2]
    assert SamplingParams.from_dict(d) == p


def test_from_dict_rejects_unknown_keys():
    with pytest.raises(ValueError) as excinfo:
        SamplingParams.from_dict({"temperature": 0.5, "top_q": 1, "best_of": 2})
    message = str(excinfo.value)
    assert message.startswith("unknown sampling parameters: best_of, top_q; allowed: ")
    assert "frequency_penalty" in message and "temperature" in message
