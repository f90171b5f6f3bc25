"""One choice's tool calls, read from its text: the whole text (non-streamed), or piece by piece.

Streamed, the deltas are OpenAI's: a call's first delta carries index, id, type and name (arguments ""),
later ones argument fragments. The fragments are the canonical JSON of the arguments as they settle
(tool_parsers/json_stream.py), so they add up to the non-streamed arguments exactly. While a call's
arguments are being written, each piece is fed to that call's `CanonicalStream` alone (time linear in the
answer); the parser re-reads the text only around calls' beginnings. The last piece reads the whole text
as the non-streamed answer does and sends what is still missing; a call already sent stays sent.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from splitserve.gateway.rest_tools import ToolPlan
from splitserve.gateway.tool_parsers import TOOL_PARSERS
from splitserve.gateway.tool_parsers.base import ToolParser
from splitserve.gateway.tool_parsers.json_stream import CanonicalStream
from splitserve.gateway.tool_parsers.required import RequiredParser


@dataclass
class _SentCall:
    """A streamed call: its id, the arguments text sent, and the stream reading them from `fed` on."""

    call_id: str
    stream: CanonicalStream
    sent: str = ""
    fed: int = -1  # index in the answer's text up to which the stream has read (-1: not started)
    entries: list = field(default_factory=list)


class ToolAnswer:
    """One choice's tool calls: from the whole text, or from its pieces as they stream."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.parser: ToolParser | None = None
        if plan.choice == "auto":
            self.parser = TOOL_PARSERS[plan.parser_name]()
        elif plan.choice == "required":
            self.parser = RequiredParser()
        self._text = ""
        self._content_sent = 0
        self._calls: list[_SentCall] = []
        self._open: int | None = None  # the call whose arguments are being written (read without a scan)

    def finish_reason(self, finish: str, called: bool) -> str:
        """OpenAI's: "tool_calls" when auto or required called a tool (and ended by itself), else `finish`."""
        if called and (self.plan.choice == "auto" or (self.plan.choice == "required" and finish == "stop")):
            return "tool_calls"
        return finish

    def message(self, text: str, finish: str) -> tuple[dict, str]:
        """The non-streamed message (role, content, tool_calls) and the finish reason."""
        if self.plan.choice == "named":
            call = _call_dict(ToolParser().new_call_id(), self.plan.function, text)
            return {"role": "assistant", "content": "", "tool_calls": [call]}, finish
        extracted = self.parser.extract(text)
        calls = extracted.calls if self.plan.parallel else extracted.calls[:1]
        if not calls:  # no call read: no tool_calls field at all, as vLLM's message drops an empty list
            content = extracted.content if extracted.content else text
            return {"role": "assistant", "content": content}, finish
        tool_calls = [_call_dict(self.parser.new_call_id(), c.name, c.arguments) for c in calls]
        message = {"role": "assistant", "content": extracted.content, "tool_calls": tool_calls}
        return message, self.finish_reason(finish, True)

    def delta(self, piece: str, finish: str | None) -> tuple[dict, str | None]:
        """The streamed delta for the next piece of text (finish set on the last) and the finish reason."""
        self._text += piece
        if self.plan.choice == "named":
            return self._named_delta(piece), finish
        if finish is None:
            return self._scan_delta(), None
        return self._final_delta(), self.finish_reason(finish, bool(self._calls))

    def _named_delta(self, piece: str) -> dict:
        entries = []
        if not self._calls:
            self._calls.append(_SentCall(ToolParser().new_call_id(), CanonicalStream()))
            entries.append(_first_entry(0, self._calls[0].call_id, self.plan.function))
        if piece:
            entries.append({"index": 0, "function": {"arguments": piece}})
        return {"tool_calls": entries} if entries else {}

    def _scan_delta(self) -> dict:
        entries: list[dict] = []
        if self._open is not None:
            entries.extend(self._feed(self._open))
            call = self._calls[self._open]
            if not (call.stream.done or call.stream.broken):
                return {"tool_calls": entries} if entries else {}
            self._open = None  # that call's arguments are whole: the parser reads what follows
        try:
            scan = self.parser.scan(self._text)
        except ValueError:  # text no call can grow from (a bad escape): the last piece decides what it is
            return {"tool_calls": entries} if entries else {}
        delta: dict[str, Any] = {}
        if len(scan.content) > self._content_sent:
            delta["content"] = scan.content[self._content_sent :]
            self._content_sent = len(scan.content)
        for i, call in enumerate(scan.calls if self.plan.parallel else scan.calls[:1]):
            if i == len(self._calls):
                if call.name is None:
                    break
                self._calls.append(_SentCall(self.parser.new_call_id(), CanonicalStream(self.parser.ensure_ascii)))
                entries.append(_first_entry(i, self._calls[i].call_id, call.name))
            sent = self._calls[i]
            if call.arguments_at >= 0 and sent.fed < 0:
                sent.fed = call.arguments_at
            if sent.fed >= 0 and not (sent.stream.done or sent.stream.broken):
                entries.extend(self._feed(i))
                if not (sent.stream.done or sent.stream.broken):
                    self._open = i
                    break
        if entries:
            delta["tool_calls"] = entries
        return delta

    def _feed(self, index: int) -> list[dict]:
        """Call `index`'s arguments entry for the text it has not read yet (none when nothing settled)."""
        call = self._calls[index]
        fragment = call.stream.feed(self._text[call.fed :])
        call.fed = len(self._text)
        if not fragment:
            return []
        call.sent += fragment
        return [{"index": index, "function": {"arguments": fragment}}]

    def _final_delta(self) -> dict:
        """The last piece: the whole text read as a non-streamed answer is; what was not sent yet goes now."""
        extracted = self.parser.extract(self._text)
        calls = extracted.calls if self.plan.parallel else extracted.calls[:1]
        delta: dict[str, Any] = {}
        if calls or self._calls:  # a streamed call stays sent, even when the whole text reads as none
            content = (extracted.content or "") if calls else ""
        else:
            content = extracted.content or self._text
        if len(content) > self._content_sent and content.startswith(self._text[: self._content_sent]):
            delta["content"] = content[self._content_sent :]
        entries = []
        for i, call in enumerate(calls):
            if i == len(self._calls):
                self._calls.append(_SentCall(self.parser.new_call_id(), CanonicalStream()))
                entries.append(_first_entry(i, self._calls[i].call_id, call.name))
            sent = self._calls[i].sent
            if len(call.arguments) > len(sent) and call.arguments.startswith(sent):
                self._calls[i].sent = call.arguments
                entries.append({"index": i, "function": {"arguments": call.arguments[len(sent) :]}})
        if entries:
            delta["tool_calls"] = entries
        return delta


def _call_dict(call_id: str, name: str, arguments: str) -> dict:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def _first_entry(index: int, call_id: str, name: str) -> dict:
    return {"index": index, "id": call_id, "type": "function", "function": {"name": name, "arguments": ""}}
