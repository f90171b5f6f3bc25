"""A non-streamed REST answer is written in parts, and its bytes equal what one JSONResponse of the whole answer
gave (the reference below builds that dict as the shim did): completions and chat, logprobs, echo, prompt logprobs
(chat: choice 0's at the top level), n > 1, an error in any choice (a 500)."""

from __future__ import annotations

import asyncio

import pytest
from fastapi.responses import JSONResponse, Response, StreamingResponse

from splitserve.gateway import rest_answer_parts
from splitserve.gateway.rest_answer_parts import complete
from splitserve.gateway.rest_answers import FINISH_NAMES, Shape, _add_usage, server_error
from splitserve.protos import common_pb2, generation_pb2


class Tokenizer:
    def decode(self, ids, **kwargs):
        return "".join(f" w{i}" if i % 3 else "\u00e9" for i in ids)  # some non-ASCII text


def lp(token_id: int, top: int, rank: int = 0) -> common_pb2.TokenLogprobs:
    alternatives = [common_pb2.TopLogprob(token_id=token_id + k, logprob=-0.5 * k - 0.25) for k in range(1, top + 1)]
    return common_pb2.TokenLogprobs(token_id=token_id, logprob=-token_id / 100, top=alternatives, rank=rank)


def messages(index: int, prompt: list[int], out: list[int], top: int, finish=common_pb2.FINISH_REASON_LENGTH):
    """A sequence's messages: two tokens a message; the first with the prompt's ids and logprobs."""
    msgs = []
    for start in range(0, len(out), 2):
        ids = out[start : start + 2]
        msgs.append(
            generation_pb2.GenerateResponse(
                text="".join(f" w{i}" for i in ids), token_ids=ids, logprobs=[lp(i, top) for i in ids], index=index
            )
        )
    msgs[0].prompt_token_ids.extend(prompt)
    msgs[0].prompt_logprobs.extend(lp(t, top, rank=t % 5 + 1) for t in prompt[1:])
    msgs[-1].finish_reason = finish
    msgs[-1].stop_reason = "w\u00e9" if finish == common_pb2.FINISH_REASON_STOP else ""
    msgs[-1].error = "decode-0 failed" if finish == common_pb2.FINISH_REASON_ERROR else ""
    msgs[-1].usage.CopyFrom(common_pb2.Usage(prompt_tokens=len(prompt), completion_tokens=len(out)))
    return msgs


async def stream_of(msgs):
    for msg in msgs:
        yield msg


def reference(shapes: list[Shape], sequences: list[list]) -> JSONResponse:
    """The answer as one dict, as the shim built it before it wrote answers in parts."""
    choices, usage = [], None
    for i, (shape, msgs) in enumerate(zip(shapes, sequences)):
        last = msgs[-1]
        if last.finish_reason == common_pb2.FINISH_REASON_ERROR:
            return JSONResponse(server_error(last.error), status_code=500)
        parts = [shape.logprobs(m) for m in msgs] if shape.top is not None else []
        keys = ("content",) if shape.chat else ("tokens", "token_logprobs", "top_logprobs", "text_offset")
        text = "".join(m.text for m in msgs)
        choice = {
            "index": i,
            "logprobs": {k: [x for p in parts for x in p[k]] for k in keys} if shape.top is not None else None,
            "finish_reason": FINISH_NAMES[last.finish_reason],
            "stop_reason": last.stop_reason or None,
        }
        choice["message" if shape.chat else "text"] = {"role": "assistant", "content": text} if shape.chat else text
        if shape.with_prompt_logprobs:
            choice["prompt_logprobs"] = shape.prompt_logprobs(msgs[0])
        choices.append(choice)
        usage = _add_usage(usage, last.usage, with_prompt=last.index == 0)
    body = shapes[0].envelope(choices)
    if shapes[0].chat and shapes[0].with_prompt_logprobs:
        body["prompt_logprobs"] = choices[0].pop("prompt_logprobs")
    body["usage"] = usage
    return JSONResponse(body)


async def written(response) -> bytes:
    if isinstance(response, StreamingResponse):
        return b"".join([part async for part in response.body_iterator])
    return response.body


@pytest.mark.parametrize("in_chunks", [False, True])
@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize(
    "top, echo, prompt_logprobs, finishes",
    [
        (None, False, False, ["length"]),
        (2, True, False, ["length", "stop"]),
        (3, False, True, ["stop", "length", "length"]),
        (None, False, True, ["length", "error"]),
    ],
)
def test_the_answer_written_in_parts_equals_the_whole_answer_byte_for_byte(
    monkeypatch, in_chunks, chat, top, echo, prompt_logprobs, finishes
):
    """Small answers go whole with their Content-Length; large ones (here: every answer, in_chunks) in chunks of
    a few bytes, encoded as they are written; the same bytes either way."""
    if in_chunks:
        monkeypatch.setattr(rest_answer_parts, "WHOLE_BELOW_BYTES", 0)
        monkeypatch.setattr(rest_answer_parts, "CHUNK_BYTES", 7)
        monkeypatch.setattr(rest_answer_parts, "LIST_SLICE", 2)
    codes = {"length": common_pb2.FINISH_REASON_LENGTH, "stop": common_pb2.FINISH_REASON_STOP}
    codes["error"] = common_pb2.FINISH_REASON_ERROR
    sequences = [
        messages(i, [4, 5, 6 + i], [10 + i, 11, 12, 13, 14][: 5 - i], top or 0, codes[f])
        for i, f in enumerate(finishes)
    ]

    def shapes():
        made = [Shape(chat, Tokenizer(), "m", "cmpl-1", top, echo and not chat, prompt_logprobs) for _ in sequences]
        for shape in made:
            shape.created = 1_800_000_000
        return made

    async def both():
        expected = reference(shapes(), sequences)
        firsts = [msgs[0] for msgs in sequences]
        got = await complete(shapes(), firsts, [stream_of(msgs[1:]) for msgs in sequences])
        assert firsts == [None] * len(sequences)  # each first message let go of once read
        return expected, got, await written(got)

    expected, got, body = asyncio.run(both())
    assert (got.status_code, body) == (expected.status_code, expected.body)
    if got.status_code == 200 and in_chunks:  # chunked transfer encoding: no length known before the first byte
        assert isinstance(got, StreamingResponse) and "content-length" not in got.headers
    elif got.status_code == 200:
        assert type(got) is Response and got.headers["content-length"] == str(len(body))
    assert got.headers["content-type"] == expected.headers["content-type"]
