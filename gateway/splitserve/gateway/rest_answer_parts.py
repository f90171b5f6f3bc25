"""The non-streamed REST answer, held compactly while its choices run and encoded as it is written.

    choices run ──▶ each holds its head and tail (JSON text) and its messages serialized (protobuf wire bytes)
    every choice ended (an error in any: a 500, before any byte) ──▶ written choice by choice, message by message

A parsed message with 20 top logprobs a token is ~3 KB of Python objects; serialized it is ~250 bytes, where its
JSON is ~600 bytes (completions) or ~1.5 KB (chat). So a running choice keeps the wire bytes, and the JSON text of
an entry exists only from its encoding until it is written: the whole answer's text is never held. The most held
at once is one choice's completions logprobs (their four lists are written one after another), or a
part of CHUNK_BYTES. A small answer goes out as one body with its Content-Length (what JSONResponse sent); a large
one in chunks (the same bytes, chunked transfer encoding), and the heap it freed goes back to the system after.
"""

from __future__ import annotations

import asyncio
import json
from collections import deque
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any

from fastapi.responses import JSONResponse, Response, StreamingResponse

from splitserve.gateway.heap import trim_heap
from splitserve.gateway.rest_answers import FINISH_NAMES, Shape, _add_usage, server_error
from splitserve.protos import common_pb2, generation_pb2

WHOLE_BELOW_BYTES = 1 << 20  # held bytes under which the answer is encoded at once and sent with its Content-Length
CHUNK_BYTES = 64 << 10  # text gathered into one written part; the event loop gets a turn between parts
TRIM_AFTER_BYTES = 8 << 20  # after an answer this large, freed heap pages go back to the system
TEXT_JOIN_PIECES = 256  # a running choice's text pieces are joined into one this often
LIST_SLICE = 256  # a long JSON list (prompt logprobs) is encoded this many entries at a time

_LOGPROB_KEYS = {True: ("content",), False: ("tokens", "token_logprobs", "top_logprobs", "text_offset")}
_SLOT = "\x00logprobs\x00"  # where a choice's logprobs go: its first string value (stop_reason comes later)


def dumps(value: Any) -> str:
    """`value` as JSONResponse renders it (compact, UTF-8 text, no NaN or infinity)."""
    return json.dumps(value, ensure_ascii=False, allow_nan=False, indent=None, separators=(",", ":"))


class _Messages:
    """A choice's messages in wire bytes, one buffer of length-prefixed records: one large allocation rather than a
    small object per message (small objects fill the interpreter's arenas, and a few survivors among them keep
    the arenas, and so the memory, after the answer is gone)."""

    def __init__(self) -> None:
        self.buffer = bytearray()

    def append(self, message: generation_pb2.GenerateResponse) -> None:
        data = message.SerializeToString()
        self.buffer += len(data).to_bytes(4, "little")
        self.buffer += data

    def first(self) -> generation_pb2.GenerateResponse:
        size = int.from_bytes(self.buffer[:4], "little")
        return generation_pb2.GenerateResponse.FromString(self.buffer[4 : 4 + size])

    def drain(self) -> Iterator[generation_pb2.GenerateResponse]:
        """Every message in order; the buffer is let go of at the end."""
        view, at = memoryview(self.buffer), 0
        while at < len(view):
            size = int.from_bytes(view[at : at + 4], "little")
            yield generation_pb2.GenerateResponse.FromString(view[at + 4 : at + 4 + size])
            at += 4 + size
        view.release()
        self.buffer = bytearray()


@dataclass
class _Held:
    """One ended choice: its JSON before and after the logprobs, its messages (those the answer still encodes: all
    with logprobs, else the first with prompt logprobs) and its last message."""

    head: str
    tail: str
    last: generation_pb2.GenerateResponse
    messages: _Messages = field(default_factory=_Messages)
    num_bytes: int = 0


async def _hold(
    shape: Shape,
    firsts: list[generation_pb2.GenerateResponse | None],
    stream: AsyncIterator[generation_pb2.GenerateResponse],
    index: int,
) -> _Held | str:
    """Choice `index` read to its end, or its error. Its first message (with the prompt logprobs, the largest) is
    let go of as soon as it is read; its text is joined every TEXT_JOIN_PIECES messages (few small objects)."""
    message, firsts[index] = firsts[index], None
    texts, messages, num_messages = [], _Messages(), 0
    while True:
        texts.append(message.text)
        if len(texts) >= TEXT_JOIN_PIECES:
            texts = ["".join(texts)]
        if shape.top is not None or (shape.with_prompt_logprobs and not num_messages):
            messages.append(message)
            num_messages += 1
        if message.finish_reason:
            break
        message = await stream.__anext__()
    if message.finish_reason == common_pb2.FINISH_REASON_ERROR:
        return message.error
    text = "".join(texts)
    choice: dict[str, Any] = {
        "index": index,
        "logprobs": _SLOT,
        "finish_reason": FINISH_NAMES[message.finish_reason],
        "stop_reason": message.stop_reason or None,
    }
    if shape.tools is not None:
        choice["message"], choice["finish_reason"] = shape.tools.message(text, choice["finish_reason"])
    elif shape.chat:
        choice["message"] = {"role": "assistant", "content": text}
    if not shape.chat:
        choice["text"] = text
    head, tail = dumps(choice).split(dumps(_SLOT), 1)
    return _Held(head, tail, message, messages, len(head) + len(tail) + len(messages.buffer))


def _json_list(items: list) -> Iterator[str]:
    """dumps(items), LIST_SLICE entries at a time."""
    yield "["
    for start in range(0, len(items), LIST_SLICE):
        yield ("," if start else "") + dumps(items[start : start + LIST_SLICE])[1:-1]
    yield "]"


def _prompt_logprobs(shape: Shape, first: generation_pb2.GenerateResponse) -> Iterator[str]:
    entries = shape.prompt_logprobs(first)
    yield from ("null",) if entries is None else _json_list(entries)


def _logprobs(shape: Shape, messages: _Messages) -> Iterator[str]:
    """dumps() of the choice's merged logprobs, its messages let go of as they are read. Chat: entry list by entry
    list. Completions: its four lists one after another (one choice's lists are held until the last is written)."""
    if shape.top is None:
        yield "null"
        return
    keys = _LOGPROB_KEYS[shape.chat]
    items: dict[str, list[str]] = {key: [] for key in keys}
    yield "{" + dumps(keys[0]) + ":["
    written = False
    for message in messages.drain():
        part = shape.logprobs(message)
        if shape.chat:
            if part["content"]:
                yield ("," if written else "") + dumps(part["content"])[1:-1]
                written = True
            continue
        for key in keys:
            if part[key]:
                items[key].append(dumps(part[key])[1:-1])  # the entries, comma-separated
    for i, key in enumerate(keys):
        if i:
            yield f"],{dumps(key)}:["
        yield ",".join(items.pop(key, ()))
    yield "]}"


def _pieces(shapes: list[Shape], held: deque[_Held], usage: dict) -> Iterator[str]:
    """The answer's JSON text in order, each choice dropped once written."""
    top_first = held[0].messages.first() if shapes[0].chat and shapes[0].with_prompt_logprobs else None  # to the end
    envelope = dumps(shapes[0].envelope([]))
    yield envelope[: -len("]}")]  # {..."choices":[
    index = 0
    while held:
        choice, shape = held.popleft(), shapes[index]
        in_choice = shape.with_prompt_logprobs and not (shape.chat and index == 0)
        first = choice.messages.first() if in_choice else None
        yield ("," if index else "") + choice.head
        yield from _logprobs(shape, choice.messages)
        if first is None:
            yield choice.tail
        else:  # each choice carries its prompt's (but chat's choice 0)
            yield choice.tail[:-1] + ',"prompt_logprobs":'
            yield from _prompt_logprobs(shape, first)
            yield "}"
        index += 1
    yield "]"
    if top_first is not None:  # vLLM's chat answer carries choice 0's prompt logprobs at the top level
        yield ',"prompt_logprobs":'
        yield from _prompt_logprobs(shapes[0], top_first)
    yield f',"usage":{dumps(usage)}}}'


async def _chunks(pieces: Iterator[str], trim: bool) -> AsyncIterator[bytes]:
    """The pieces in parts of about CHUNK_BYTES, with a turn for the event loop between parts (writing to a client
    that keeps up never waits, so the loop would otherwise be held for the whole answer)."""
    gathered, size = [], 0
    for piece in pieces:
        gathered.append(piece)
        size += len(piece)
        if size >= CHUNK_BYTES:
            yield "".join(gathered).encode()
            gathered, size = [], 0
            await asyncio.sleep(0)
    yield "".join(gathered).encode()
    if trim:
        await asyncio.to_thread(trim_heap)


async def complete(
    shapes: list[Shape],
    firsts: list[generation_pb2.GenerateResponse | None],
    streams: list[AsyncIterator[generation_pb2.GenerateResponse]],
) -> Response:
    """Non-streaming answer: each prompt's messages merged into its choice (choice i * n + j = prompt i's
    sequence j); the bytes equal JSONResponse's of the whole dict. Every choice is done before the first byte
    goes: an error in any of them makes the answer a 500."""
    results = await asyncio.gather(*(_hold(sh, firsts, s, i) for i, (sh, s) in enumerate(zip(shapes, streams))))
    usage, num_bytes = None, 0
    for result in results:
        if isinstance(result, str):
            return JSONResponse(server_error(result), status_code=500)
        usage = _add_usage(usage, result.last.usage, with_prompt=result.last.index == 0)
        num_bytes += result.num_bytes
    pieces = _pieces(shapes, deque(results), usage)
    del results  # each choice lives on in `pieces` alone, until written
    if num_bytes < WHOLE_BELOW_BYTES:
        body = "".join(pieces).encode()
        return Response(body, media_type="application/json")
    return StreamingResponse(_chunks(pieces, num_bytes >= TRIM_AFTER_BYTES), media_type="application/json")
