"""The GenerateResponse messages of one request run (one sequence): what `RequestRun` streams to the front end.

    PrefillResponse ──first_message──▶ message 1 (prompt parts, first token, timings so far)
    TokenDelta ──accept_delta──▶ ids, logprobs, text ──delta_message──▶ message (the last: finish, usage, timings)

The run decides where messages come from and tells the decode when a stop string ended the output; this module
detokenizes, cuts the output at the token that completed a stop string, counts output tokens and fills usage and
timings.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from splitserve.common.detokenizer import IncrementalDetokenizer
from splitserve.common.sampling_params import SamplingParams
from splitserve.gateway.decode_link import DEADLINE, LinkFailure
from splitserve.protos import common_pb2, decode_pb2, generation_pb2, prefill_pb2

log = logging.getLogger("splitserve.gateway")
FR = common_pb2.FinishReason


@dataclass(frozen=True)
class Accepted:
    """A delta's tokens kept (up to the one completing a stop string), their logprobs and text."""

    token_ids: list[int]
    logprobs: list[common_pb2.TokenLogprobs]
    text: str
    first_output: bool  # the run's first output tokens (none had come before this delta)


class RunMessages:
    """Builds one sequence's messages in order; owns its detokenizer and output counters.

    `prompt_logprobs` come from the prefill (or a decode prefilling locally) and ride on the first message;
    a sequence forked from a lead's prompt (`lead`) takes the lead's, computed once for every choice.
    `finished` is set by the terminal message; `error` is its error, when it failed."""

    def __init__(
        self,
        *,
        request_id: str,
        index: int,
        params: SamplingParams,
        prompt_token_ids: list[int],
        tokenizer: Any,
        arrival_ns: int,
        echo_text: str | None,
        drop_output: bool,
    ) -> None:
        self._request_id = request_id
        self._index = index
        self._params = params
        self._prompt = prompt_token_ids
        self._arrival_ns = arrival_ns
        self._echo_text = echo_text
        self._drop_output = drop_output
        self._detok = IncrementalDetokenizer(
            tokenizer,
            skip_special_tokens=params.skip_special_tokens,
            stop=params.stop,
            include_stop_str_in_output=params.include_stop_str_in_output,
            prompt_token_ids=prompt_token_ids,
        )
        self.num_output_tokens = 0
        self.cached_prompt_tokens = 0
        self.finished = False
        self.error: str | None = None
        self.first_message_ns = 0  # time.time_ns() of the first message with output tokens
        self.prefill_timings: common_pb2.Timings | None = None
        self.prompt_logprobs: Sequence[common_pb2.TokenLogprobs] = ()
        self.lead: RunMessages | None = None
        self._last_token: int | None = None
        self._num_messages = 0

    @property
    def stop_matched(self) -> bool:
        """A stop string was completed: the output ends at the token that completed it."""
        return self._detok.stop_str is not None

    def first_message(self, first: prefill_pb2.PrefillResponse) -> generation_pb2.GenerateResponse:
        """The message of the prefill's first token (the terminal one when it ended the request)."""
        self.prompt_logprobs = first.prompt_logprobs
        logprobs = [first.first_logprobs] if first.HasField("first_logprobs") else []
        ids, lps, text = self._accept([first.first_token_id], logprobs)
        if self._detok.stop_str is not None:
            return self.final(FR.FINISH_REASON_STOP, ids, lps, text, stop_reason=self._detok.stop_str)
        if first.finish_reason:
            return self.final(first.finish_reason, ids, lps, text + self._detok.flush())
        message = self._message(ids, lps, text)
        message.timings.CopyFrom(self._timings(None))
        return message

    def accept_delta(self, delta: decode_pb2.TokenDelta, *, local_prefill: bool) -> Accepted:
        """Take a decode delta's tokens (and, on the first output, what the decode computed of the prompt)."""
        first_output = self.num_output_tokens == 0
        if local_prefill and first_output and delta.cached_prompt_tokens:
            self.cached_prompt_tokens = delta.cached_prompt_tokens
        if first_output:
            self.prompt_logprobs = delta.prompt_logprobs  # prefilled by the decode itself
        ids, lps, text = self._accept(delta.token_ids, delta.logprobs)
        return Accepted(ids, lps, text, first_output)

    def delta_message(
        self, delta: decode_pb2.TokenDelta, accepted: Accepted, *, decode_name: str
    ) -> generation_pb2.GenerateResponse:
        """The message of an accepted delta: the terminal one on a stop string or the decode's finish."""
        ids, lps, text = accepted.token_ids, accepted.logprobs, accepted.text
        if self._detok.stop_str is not None:
            return self.final(
                FR.FINISH_REASON_STOP, ids, lps, text, stop_reason=self._detok.stop_str, decode_timings=delta.timings
            )
        if delta.finish_reason:
            text += self._detok.flush()
            if self._detok.stop_str is not None:
                return self.final(
                    FR.FINISH_REASON_STOP,
                    ids,
                    lps,
                    text,
                    stop_reason=self._detok.stop_str,
                    decode_timings=delta.timings,
                )
            error = f"decode instance {decode_name}: {delta.error}" if delta.error else ""
            return self.final(delta.finish_reason, ids, lps, text, error=error, decode_timings=delta.timings)
        message = self._message(ids, lps, text)
        if accepted.first_output and ids:
            message.timings.CopyFrom(self._timings(None))
        return message

    def final(
        self,
        finish_reason: int,
        ids: Sequence[int] = (),
        logprobs: Sequence = (),
        text: str = "",
        *,
        stop_reason: str = "",
        error: str = "",
        decode_timings: common_pb2.Timings | None = None,
    ) -> generation_pb2.GenerateResponse:
        """The terminal message: finish_reason, usage, timings, stop_reason or error."""
        self.finished = True
        if (
            finish_reason == FR.FINISH_REASON_STOP
            and not stop_reason
            and self._last_token is not None
            and self._last_token in self._params.stop_token_ids
        ):
            stop_reason = str(self._last_token)
        message = self._message(ids, logprobs, text)
        message.finish_reason = finish_reason
        message.stop_reason = stop_reason
        message.error = error
        message.usage.cached_prompt_tokens = self.cached_prompt_tokens
        message.timings.CopyFrom(self._timings(decode_timings))
        if error:
            log.warning("request_id=%s failed: %s", self._request_id, error)
            self.error = error
        return message

    def _accept(
        self, token_ids: Sequence[int], logprobs: Sequence[common_pb2.TokenLogprobs]
    ) -> tuple[list[int], list[common_pb2.TokenLogprobs], str]:
        """Detokenize token by token; keep tokens up to the one that completes a stop string."""
        ids: list[int] = []
        pieces: list[str] = []
        for token_id in token_ids:
            if self._detok.finished:
                break
            ids.append(token_id)
            pieces.append(self._detok.push([token_id]).text)
        self.num_output_tokens += len(ids)
        if ids:
            self._last_token = ids[-1]
        kept_logprobs = list(logprobs[: len(ids)]) if len(logprobs) >= len(ids) else list(logprobs)
        return ids, kept_logprobs, "".join(pieces)

    def _message(
        self, ids: Sequence[int], logprobs: Sequence[common_pb2.TokenLogprobs], text: str
    ) -> generation_pb2.GenerateResponse:
        if ids and not self.first_message_ns:
            self.first_message_ns = time.time_ns()
        if self._drop_output:
            ids, logprobs, text = (), (), ""
        message = generation_pb2.GenerateResponse(
            request_id=self._request_id, text=text, token_ids=ids, logprobs=logprobs, index=self._index
        )
        self._num_messages += 1
        if self._num_messages == 1:
            self._add_prompt_parts(message)
        message.usage.prompt_tokens = len(self._prompt)  # counts so far (vLLM's continuous_usage_stats)
        message.usage.completion_tokens = self.num_output_tokens
        return message

    def _add_prompt_parts(self, message: generation_pb2.GenerateResponse) -> None:
        """The first message: echo's prompt text before the output, the prompt's ids (echo or prompt
        logprobs) and the prompt logprobs the prefill computed."""
        if self.lead is not None:
            self.prompt_logprobs = self.lead.prompt_logprobs  # computed once, for the lead: every choice has them
        if self._echo_text is not None:
            message.text = self._echo_text + message.text
        if self._echo_text is not None or self._params.prompt_logprobs is not None:
            message.prompt_token_ids.extend(self._prompt)
        if self._params.prompt_logprobs is not None:
            message.prompt_logprobs.extend(self.prompt_logprobs)

    def _timings(self, decode: common_pb2.Timings | None) -> common_pb2.Timings:
        """Prefill's and decode's stage times added up; total_ns measured by the gateway."""
        timings = common_pb2.Timings()
        for part in (self.prefill_timings, decode):
            if part is not None:
                timings.queue_ns += part.queue_ns
                timings.prefill_ns += part.prefill_ns
                timings.transfer_ns += part.transfer_ns
                timings.decode_ns += part.decode_ns
        timings.total_ns = time.monotonic_ns() - self._arrival_ns
        return timings


async def next_item(
    queue: asyncio.Queue, stashed: object | None, wanted_tokens: int
) -> tuple[decode_pb2.TokenDelta | LinkFailure | object, object | None]:
    """The next item of a request's queue, and the one to read first next time (or None). The TokenDeltas
    already queued are merged into one, so a slow client gets fewer, larger messages, and deltas are gathered
    until they hold `wanted_tokens` tokens or one ends the request; a LinkFailure or DEADLINE behind them is
    returned by the next call (`stashed`), after the tokens that came before it."""
    if stashed is not None:
        item = stashed
    else:
        item = await queue.get() if queue.empty() else queue.get_nowait()
    if item is DEADLINE or isinstance(item, LinkFailure):
        return item, None
    deltas = [item]
    num_tokens = len(item.token_ids)
    while not deltas[-1].finish_reason and (num_tokens < wanted_tokens or not queue.empty()):
        following = queue.get_nowait() if not queue.empty() else await queue.get()
        if following is DEADLINE or isinstance(following, LinkFailure):
            return merge_deltas(deltas), following
        deltas.append(following)
        num_tokens += len(following.token_ids)
    return merge_deltas(deltas), None


def merge_deltas(deltas: Sequence[decode_pb2.TokenDelta]) -> decode_pb2.TokenDelta:
    """One delta holding the tokens of consecutive deltas; the end state of the last one (a lone delta as is)."""
    if len(deltas) == 1:
        return deltas[0]
    first, last = deltas[0], deltas[-1]
    merged = decode_pb2.TokenDelta(
        request_id=first.request_id,
        cached_prompt_tokens=first.cached_prompt_tokens,
        num_blocks_pulled=first.num_blocks_pulled,
        finish_reason=last.finish_reason,
        error=last.error,
        prompt_logprobs=first.prompt_logprobs,
    )
    for delta in deltas:
        merged.token_ids.extend(delta.token_ids)
        merged.logprobs.extend(delta.logprobs)
    if last.HasField("timings"):
        merged.timings.CopyFrom(last.timings)
    return merged
