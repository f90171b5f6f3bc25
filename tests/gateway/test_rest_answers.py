"""rest_answers' pre-encoded text chunk: byte for byte the event the general path builds from dicts."""

import json

import pytest

from splitserve.gateway.rest_answers import Shape, event

TEXTS = ["", "plain", 'quote " and back\\slash', "line\nbreak\ttab", "caf\u00e9 \u2603 \U0001f600", "\x00nul", "\u2028"]


class _NoTokenizer:
    def decode(self, ids, **kwargs):  # text chunks never decode tokens
        raise AssertionError("a text chunk decoded a token")


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("index", [0, 3])
def test_text_chunk_equals_the_general_event(chat, index):
    shape = Shape(chat, _NoTokenizer(), 'model "q"\x00', 'cmpl-\x00id"', top=None)
    for text in TEXTS:
        choice = {"index": index, "logprobs": None, "finish_reason": None}
        if chat:
            choice["delta"] = {"content": text}
        else:
            choice["text"] = text
        want = event(shape.envelope([choice], ".chunk" if chat else ""))
        got = shape.text_chunk(index, text)
        assert got == want
        assert json.loads(got.removeprefix("data: "))["choices"][0] == choice
