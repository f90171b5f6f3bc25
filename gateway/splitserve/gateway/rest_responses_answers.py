"""The Responses API's answers: one response object, or its semantic server-sent events.

Streamed, a text answer is the event sequence OpenAI sends (each with a growing sequence_number):

    response.created, response.in_progress                 the response, status in_progress, no output
    response.output_item.added, response.content_part.added   the message item and its output_text part
    response.output_text.delta ...                         the text as it is generated
    response.output_text.done, response.content_part.done, response.output_item.done
    response.completed (or response.incomplete: max_output_tokens reached)   the whole response, with usage

A function call is its own output item: response.output_item.added (arguments ""), then
response.function_call_arguments.delta fragments, .done and response.output_item.done. An error after
the first token ends the stream with response.failed.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import JSONResponse

from splitserve.gateway.errors import GatewayError
from splitserve.gateway.rest_answers import FINISH_NAMES, server_error
from splitserve.gateway.rest_responses import ResponsesRequest
from splitserve.gateway.rest_tool_answers import ToolAnswer
from splitserve.protos import common_pb2, generation_pb2


def _usage(usage: common_pb2.Usage) -> dict:
    return {
        "input_tokens": usage.prompt_tokens,
        "input_tokens_details": {"cached_tokens": usage.cached_prompt_tokens, "cache_write_tokens": 0},
        "output_tokens": usage.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
    }


def _text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


class ResponsesAnswer:
    """One /v1/responses request's answer (non-streamed `complete`, or `sse`)."""

    def __init__(self, req: ResponsesRequest, model: str) -> None:
        self.req, self.model = req, model
        self.id = "resp_" + req.inp.request_id.rsplit("-", 1)[-1]
        self.created_at = int(time.time())
        self.tools: ToolAnswer | None = ToolAnswer(req.tools) if req.tools is not None else None
        self.output: list[dict] = []
        self._sequence = 0
        self._message_at: int | None = None  # output index of the open message item
        self._calls_at: dict[int, int] = {}  # tool call index -> output index
        self._pieces: dict[int, list[str]] = {}  # output index of an open item -> its text (or arguments) so far

    def response(self, status: str, usage: dict | None = None, error: dict | None = None) -> dict:
        for at, pieces in self._pieces.items():  # items still open (a failed stream): what they hold so far
            item = self.output[at]
            if item["type"] == "message":
                item["content"][0]["text"] = "".join(pieces)
            else:
                item["arguments"] = "".join(pieces)
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "error": error,
            "incomplete_details": incomplete,
            "model": self.model,
            "output": self.output,
            "usage": usage,
            **self.req.echo,
        }

    # -- non-streamed ------------------------------------------------------------------------------

    async def complete(
        self, firsts: list[generation_pb2.GenerateResponse], streams: list[AsyncIterator]
    ) -> JSONResponse:
        message, texts = firsts[0], []
        while True:
            texts.append(message.text)
            if message.finish_reason:
                break
            message = await streams[0].__anext__()
        if message.finish_reason == common_pb2.FINISH_REASON_ERROR:
            return JSONResponse(server_error(message.error), status_code=500)
        text, finish = "".join(texts), FINISH_NAMES[message.finish_reason]
        content, calls = text, []
        if self.tools is not None:
            chat_message, _ = self.tools.message(text, finish)
            content, calls = chat_message["content"], chat_message.get("tool_calls", [])
        status = "incomplete" if finish == "length" else "completed"
        if content or not calls:
            self.output.append(self._message_item(content or "", status))
        for call in calls:
            function = call["function"]
            self.output.append(self._call_item(call["id"], function["name"], function["arguments"], "completed"))
        return JSONResponse(self.response(status, _usage(message.usage)))

    def _message_item(self, text: str | None, status: str) -> dict:
        content = [] if text is None else [_text_part(text)]
        item_id = f"msg_{uuid.uuid4().hex}"
        return {"id": item_id, "type": "message", "role": "assistant", "status": status, "content": content}

    def _call_item(self, call_id: str, name: str, arguments: str, status: str) -> dict:
        return {
            "id": f"fc_{uuid.uuid4().hex}",
            "type": "function_call",
            "call_id": call_id,
            "name": name,
            "arguments": arguments,
            "status": status,
        }

    # -- streamed ----------------------------------------------------------------------------------

    def _event(self, kind: str, **fields: Any) -> str:
        body = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return f"event: {kind}\ndata: {json.dumps(body, separators=(',', ':'))}\n\n"

    async def sse(
        self, firsts: list[generation_pb2.GenerateResponse], streams: list[AsyncIterator]
    ) -> AsyncIterator[str]:
        try:
            yield self._event("response.created", response=self.response("in_progress"))
            yield self._event("response.in_progress", response=self.response("in_progress"))
            message = firsts[0]
            while True:
                if message.finish_reason == common_pb2.FINISH_REASON_ERROR:
                    error = {"code": "server_error", "message": message.error}
                    yield self._event("response.failed", response=self.response("failed", error=error))
                    return
                finish = FINISH_NAMES.get(message.finish_reason)
                delta = {"content": message.text} if message.text else {}
                if self.tools is not None:
                    delta, _ = self.tools.delta(message.text, finish)
                for event in self._delta_events(delta):
                    yield event
                if finish:
                    break
                try:
                    message = await streams[0].__anext__()
                except GatewayError as exc:  # refused after the first token (a decode that took nothing)
                    error = {"code": "server_error", "message": exc.message}
                    yield self._event("response.failed", response=self.response("failed", error=error))
                    return
            status = "incomplete" if finish == "length" else "completed"
            if not self.output:  # no text at all: still one (empty) message, as the non-streamed answer has
                for event in self._open_message():
                    yield event
            for event in self._close_items(status):
                yield event
            yield self._event(f"response.{status}", response=self.response(status, _usage(message.usage)))
        finally:
            for stream in streams:
                await stream.aclose()  # client gone: abort the request on every hop

    def _delta_events(self, delta: dict) -> list[str]:
        events = []
        if delta.get("content"):
            if self._message_at is None:
                events.extend(self._open_message())
            self._pieces[self._message_at].append(delta["content"])  # joined when the item is done
            events.append(
                self._event(
                    "response.output_text.delta",
                    item_id=self.output[self._message_at]["id"],
                    output_index=self._message_at,
                    content_index=0,
                    delta=delta["content"],
                    logprobs=[],
                )
            )
        for entry in delta.get("tool_calls", ()):
            events.extend(self._call_events(entry))
        return events

    def _open_message(self) -> list[str]:
        self._message_at = len(self.output)
        item = self._message_item(None, "in_progress")
        self.output.append(item)
        events = [self._event("response.output_item.added", output_index=self._message_at, item=item)]
        events.append(self._part_event("response.content_part.added", ""))
        item["content"].append(_text_part(""))
        self._pieces[self._message_at] = []
        return events

    def _call_events(self, entry: dict) -> list[str]:
        events = []
        if "id" in entry:  # a new call: the items before it are done
            events.extend(self._close_items("completed"))
            self._calls_at[entry["index"]] = len(self.output)
            item = self._call_item(entry["id"], entry["function"]["name"], "", "in_progress")
            self.output.append(item)
            self._pieces[len(self.output) - 1] = []
            events.append(self._event("response.output_item.added", output_index=len(self.output) - 1, item=item))
        at = self._calls_at[entry["index"]]
        fragment = entry["function"].get("arguments", "")
        if fragment:
            self._pieces[at].append(fragment)
            events.append(
                self._event(
                    "response.function_call_arguments.delta",
                    item_id=self.output[at]["id"],
                    output_index=at,
                    delta=fragment,
                )
            )
        return events

    def _part_event(self, kind: str, text: str) -> str:
        item = self.output[self._message_at]
        return self._event(
            kind, item_id=item["id"], output_index=self._message_at, content_index=0, part=_text_part(text)
        )

    def _close_items(self, status: str) -> list[str]:
        """Events that end the open message item and open call items (each once)."""
        events = []
        if self._message_at is not None:
            item = self.output[self._message_at]
            text = item["content"][0]["text"] = "".join(self._pieces.pop(self._message_at))
            events.append(
                self._event(
                    "response.output_text.done",
                    item_id=item["id"],
                    output_index=self._message_at,
                    content_index=0,
                    text=text,
                    logprobs=[],
                )
            )
            events.append(self._part_event("response.content_part.done", text))
            item["status"] = status
            events.append(self._event("response.output_item.done", output_index=self._message_at, item=item))
            self._message_at = None
        for at in sorted(self._calls_at.values()):
            item = self.output[at]
            if item["status"] != "in_progress":
                continue
            item["arguments"] = "".join(self._pieces.pop(at))
            events.append(
                self._event(
                    "response.function_call_arguments.done",
                    item_id=item["id"],
                    output_index=at,
                    arguments=item["arguments"],
                )
            )
            item["status"] = "completed"
            events.append(self._event("response.output_item.done", output_index=at, item=item))
        return events
