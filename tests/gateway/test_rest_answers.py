"""rest_answers' pre-encoded text chunk: byte for byte the event the general path builds from dicts."""

import json

import pytest

from splitserve.gateway.rest_answers import Shape, event, usage_dict
from splitserve.protos import common_pb2

TEXTS = ["", "plain", 'quote " and back\\slash', "line\nbreak\ttab", "caf\u00e9 \u2603 \U0001f600", "\x00nul", "\u2028"]


class _NoTokenizer:
    def decode(self, ids, **kwargs):  # text chunks never decode tokens
        raise AssertionError("a text chunk decoded a token")


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("index", [0, 3])
@pytest.mark.parametrize("with_usage", [False, True])
def test_text_chunk_equals_the_general_event(chat, index, with_usage):
    shape = Shape(chat, _NoTokenizer(), 'model "q"\x00', 'cmpl-\x00id"', top=None)
    for text in TEXTS:
        choice = {"index": index, "logprobs": None, "finish_reason": None}
        if chat:
            choice["delta"] = {"content": text}
        else:
            choice["text"] = text
        body = shape.envelope([choice], ".chunk" if chat else "")
        usage = common_pb2.Usage(prompt_tokens=7, completion_tokens=len(text), cached_prompt_tokens=4)
        if with_usage:
            body["usage"] = usage_dict(usage)
        want = event(body)
        got = shape.text_chunk(index, text, usage if with_usage else None)
        assert got == want
        assert json.loads(got.removeprefix("data: "))["choices"][0] == choice
