"""The OpenAI response shapes of the REST shim: one non-streamed answer, or server-sent chunks, for one
prompt or a batch of them (choice i = prompt i; chunks of a batch interleave as tokens come, each naming
its choice; usage is the batch's sum)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any

from splitserve.gateway.errors import GatewayError
from splitserve.gateway.rest_params import RestRequest
from splitserve.gateway.rest_tool_answers import ToolAnswer
from splitserve.gateway.rest_tools import ToolPlan
from splitserve.protos import common_pb2, generation_pb2

FINISH_NAMES = {
    common_pb2.FINISH_REASON_STOP: "stop",
    common_pb2.FINISH_REASON_LENGTH: "length",
    common_pb2.FINISH_REASON_ABORT: "abort",
    common_pb2.FINISH_REASON_ERROR: "error",
}


LOWEST_LOGPROB = -9999.0  # what -inf is answered as (JSON has no infinity; OpenAI and vLLM do the same)


class Shape:
    """OpenAI response shapes of one endpoint (completions or chat). `echo`: completions' logprobs start with
    the prompt's tokens (the first with None, as vLLM and OpenAI); `prompt_logprobs`: the answer carries
    vLLM's prompt_logprobs (non-streamed: in the choice for completions, at the top level for chat)."""

    def __init__(
        self,
        chat: bool,
        tokenizer: Any,
        model: str,
        request_id: str,
        top: int | None,
        echo: bool = False,
        prompt_logprobs: bool = False,
        tools: ToolPlan | None = None,
    ) -> None:
        self.chat, self.tokenizer, self.model, self.id, self.top = chat, tokenizer, model, request_id, top
        self.echo, self.with_prompt_logprobs = echo, prompt_logprobs
        self.tools = ToolAnswer(tools) if tools is not None else None  # this choice's tool calls
        self.created = int(time.time())
        self.object = "chat.completion" if chat else "text_completion"
        self._text_offset = 0
        self._text_chunk_parts: dict[int, tuple[str, str]] = {}  # choice index -> text_chunk's frame

    def text_chunk(self, index: int, text: str, usage: common_pb2.Usage | None = None) -> str:
        """The SSE event of a chunk that carries only `text` (no logprobs, no finish) and, with `usage`, the
        counts so far: the chunk event() makes of envelope([choice]) (+ "usage"), byte for byte, with only the
        text and the counts encoded per token."""
        parts = self._text_chunk_parts.get(index)
        if parts is None:
            marker = "\x00"  # encodes as "\u0000"; the text is the envelope's last string (id and model come first)
            choice: dict[str, Any] = {"index": index, "logprobs": None, "finish_reason": None}
            if self.chat:
                choice["delta"] = {"content": marker}
            else:
                choice["text"] = marker
            head, tail = event(self.envelope([choice], ".chunk" if self.chat else "")).rsplit(json.dumps(marker), 1)
            parts = self._text_chunk_parts[index] = (head, tail)
        if usage is None:
            return parts[0] + json.dumps(text) + parts[1]
        usage_json = json.dumps(usage_dict(usage), separators=(",", ":"))
        return f'{parts[0]}{json.dumps(text)}{parts[1][:-3]},"usage":{usage_json}}}\n\n'

    def envelope(self, choices: list, object_suffix: str = "") -> dict:
        return {
            "id": self.id,
            "object": self.object + object_suffix,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def logprobs(self, message: generation_pb2.GenerateResponse) -> dict | None:
        if self.top is None:
            return None
        entries = [(self._token(lp.token_id), lp) for lp in message.logprobs]
        if self.chat:
            return {
                "content": [
                    {
                        "token": tok,
                        "logprob": lp.logprob,
                        "bytes": list(tok.encode()),
                        "top_logprobs": [
                            {
                                "token": self._token(t.token_id),
                                "logprob": t.logprob,
                                "bytes": list(self._token(t.token_id).encode()),
                            }
                            for t in lp.top
                        ],
                    }
                    for tok, lp in entries
                ]
            }
        if self.echo and message.prompt_token_ids:  # the first message: the prompt's tokens first
            first = self._token(message.prompt_token_ids[0])
            entries = [(first, None), *((self._token(lp.token_id), lp) for lp in message.prompt_logprobs), *entries]
        # offsets into the output text: tokens of one message share its text span
        start, end = self._text_offset, self._text_offset + len(message.text)
        offsets, position = [], start
        for tok, _ in entries:
            offsets.append(min(position, end))
            position += len(tok)
        self._text_offset = end
        return {
            "tokens": [tok for tok, _ in entries],
            "token_logprobs": [None if lp is None else max(lp.logprob, LOWEST_LOGPROB) for _, lp in entries],
            "top_logprobs": [None if lp is None else self._top_dict(tok, lp) for tok, lp in entries],
            "text_offset": offsets,
        }

    def _top_dict(self, token: str, lp: common_pb2.TokenLogprobs) -> dict[str, float]:
        """The token itself, then its top alternatives (vLLM's completions: up to logprobs + 1 entries)."""
        top = {token: max(lp.logprob, LOWEST_LOGPROB)}
        for t in lp.top:
            top.setdefault(self._token(t.token_id), max(t.logprob, LOWEST_LOGPROB))
        return top

    def prompt_logprobs(self, message: generation_pb2.GenerateResponse) -> list | None:
        """vLLM's prompt_logprobs: None for the first prompt token, then {token id: {logprob, rank,
        decoded_token}} with the prompt token first and its top alternatives (ranks 1..n)."""
        if not message.prompt_token_ids:
            return None
        out: list = [None]
        for lp in message.prompt_logprobs:
            entry = {lp.token_id: self._logprob_entry(lp.token_id, lp.logprob, lp.rank)}
            for rank, t in enumerate(lp.top, start=1):
                entry.setdefault(t.token_id, self._logprob_entry(t.token_id, t.logprob, rank))
            out.append({str(k): v for k, v in entry.items()})
        return out

    def _logprob_entry(self, token_id: int, logprob: float, rank: int) -> dict:
        return {"logprob": max(logprob, LOWEST_LOGPROB), "rank": rank, "decoded_token": self._token(token_id)}

    def _token(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False, clean_up_tokenization_spaces=False)


def usage_dict(usage: common_pb2.Usage) -> dict:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_prompt_tokens},
    }


def server_error(message: str) -> dict:
    return {"error": {"message": message, "type": "server_error", "param": None, "code": None}}


def _add_usage(total: dict | None, usage: common_pb2.Usage, with_prompt: bool = True) -> dict:
    """`usage_dict(usage)` added into `total` (the usage of a batch of prompts); `with_prompt` false for a
    prompt's sequences after its first (n > 1: the prompt counts once, as vLLM counts it)."""
    one = usage_dict(usage)
    if not with_prompt:
        one["total_tokens"] -= one["prompt_tokens"]
        one["prompt_tokens"] = one["prompt_tokens_details"]["cached_tokens"] = 0
    if total is None:
        return one
    for key in ("prompt_tokens", "completion_tokens", "total_tokens"):
        total[key] += one[key]
    total["prompt_tokens_details"]["cached_tokens"] += one["prompt_tokens_details"]["cached_tokens"]
    return total


def _chunk(
    shape: Shape, req: RestRequest, message: generation_pb2.GenerateResponse, index: int, finish: str | None
) -> dict | None:
    """The chunk of one message (None when it has nothing to send: a tool call's text held back)."""
    delta = {"content": message.text} if message.text else {}
    if shape.tools is not None:
        delta, finish = shape.tools.delta(message.text, finish)
    if not (delta or finish or (shape.top is not None and message.token_ids)):
        return None
    choice: dict[str, Any] = {"index": index, "logprobs": shape.logprobs(message), "finish_reason": finish}
    if shape.chat:
        choice["delta"] = delta
    else:
        choice["text"] = message.text
    if finish:
        choice["stop_reason"] = message.stop_reason or None
    chunk = shape.envelope([choice], ".chunk" if shape.chat else "")
    if req.continuous_usage:
        chunk["usage"] = usage_dict(message.usage)
    return chunk


async def _choice_events(
    shape: Shape,
    req: RestRequest,
    first: generation_pb2.GenerateResponse,
    stream: AsyncIterator[generation_pb2.GenerateResponse],
    index: int,
    finals: list,
) -> AsyncIterator[str]:
    """One prompt's server-sent chunks (choice `index`); its last message goes to `finals` (none on error)."""
    suffix = ".chunk" if shape.chat else ""
    if shape.chat:
        role = {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
        yield event(shape.envelope([role], suffix))
    message = first
    while True:
        if message.finish_reason == common_pb2.FINISH_REASON_ERROR:
            yield event(server_error(message.error))
            return
        finish = FINISH_NAMES.get(message.finish_reason)
        if shape.tools is None and message.text and not finish and shape.top is None:  # most chunks
            yield shape.text_chunk(index, message.text, message.usage if req.continuous_usage else None)
        else:
            chunk = _chunk(shape, req, message, index, finish)
            if chunk is not None:
                yield event(chunk)
        if finish:
            finals.append(message)
            return
        try:
            message = await stream.__anext__()
        except GatewayError as exc:  # refused after the first token (a decode that took nothing): said in-band
            yield event(exc.openai_body())
            return


async def sse(
    shapes: list[Shape],
    req: RestRequest,
    firsts: list[generation_pb2.GenerateResponse],
    streams: list[AsyncIterator[generation_pb2.GenerateResponse]],
) -> AsyncIterator[str]:
    """Server-sent events of every prompt (interleaved as they come, each chunk naming its choice), then
    the usage (if asked, when every prompt finished) and [DONE]."""
    finals: list = []
    parts = [_choice_events(sh, req, f, s, i, finals) for i, (sh, f, s) in enumerate(zip(shapes, firsts, streams))]
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(part):
        try:
            async for item in part:
                await queue.put(item)
        finally:
            await queue.put(None)

    tasks = [asyncio.ensure_future(pump(part)) for part in parts[1:]]
    try:
        async for item in parts[0]:  # the common case, one prompt: no queue in between
            yield item
        for _ in tasks:
            while (item := await queue.get()) is not None:
                yield item
        if req.include_usage and len(finals) == len(streams):
            usage = None
            for last in finals:
                usage = _add_usage(usage, last.usage, with_prompt=last.index == 0)
            body = shapes[0].envelope([], ".chunk" if shapes[0].chat else "")
            body["usage"] = usage
            yield event(body)
        yield "data: [DONE]\n\n"
    finally:
        # Client gone (or done): abort every prompt's request on every hop. In a task of its own: a client that
        # leaves cancels the response's scope, where every await of this generator would be cancelled again,
        # and a cancelled pump may still be inside its stream's __anext__ until it has run.
        closing = asyncio.get_running_loop().create_task(_close(tasks, streams))
        _CLOSING.add(closing)
        closing.add_done_callback(_CLOSING.discard)


_CLOSING: set[asyncio.Task] = set()  # sse's closing tasks, held until they end


async def _close(pumps: list[asyncio.Task], streams: list[AsyncIterator[generation_pb2.GenerateResponse]]) -> None:
    for task in pumps:
        task.cancel()
    await asyncio.gather(*pumps, return_exceptions=True)
    for stream in streams:
        await stream.aclose()


def event(body: dict) -> str:
    return f"data: {json.dumps(body, separators=(',', ':'))}\n\n"
