"""A request's state inside the engine (owned by the scheduler)."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from splitserve.common.sampling_params import SamplingParams
from splitserve.engine.grammar import RequestGrammar


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # queued (new, or preempted and waiting to recompute)
    WAITING_FOR_KV = "waiting_for_kv"  # decode role: blocks allocated, KV being pulled (vLLM: WAITING_FOR_REMOTE_KVS)
    RUNNING = "running"
    PREFILLED = "prefilled"  # prefill role: first token sampled, blocks held for a pull
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"

    @property
    def is_finished(self) -> bool:
        # by value: a member's hash is a Python-level call (Enum.__hash__), and this is asked for every running
        # request on every step
        return self._value_ in _FINISHED_VALUES


_FINISHED = {
    RequestStatus.FINISHED_STOPPED,
    RequestStatus.FINISHED_LENGTH,
    RequestStatus.FINISHED_ABORTED,
    RequestStatus.FINISHED_ERROR,
}
_FINISHED_VALUES = frozenset(status.value for status in _FINISHED)


@dataclass(eq=False)
class Request:
    """One generation request.

    `token_ids` is prompt followed by the output tokens the host has read. With asynchronous
    scheduling a sampled token stays on the device a step longer: `num_pending_tokens` counts
    those (0 or 1 when a step is scheduled, 2 while the next one is being launched), and the
    scheduler treats them as present. `num_computed_tokens` (advanced when a step is scheduled)
    counts the positions whose KV a launched step writes. A step schedules
    `num_tokens_with_pending - num_computed_tokens` (or a chunk of it); when a step brings it
    level, the step's last logits are sampled.

        token_ids:  [ prompt ........ | outputs read ]  pending: [ t ]  (on the device)
                    |<------ num_tokens ------------>|
                    |<------ num_tokens_with_pending ------------->|
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    seed: int
    max_tokens: int  # resolved: params.max_tokens, or what the context leaves
    eos_token_ids: tuple[int, ...] = ()
    priority: int = 0
    share: int = 0  # the caller's sequences in flight at the gateway: lower shares run first when saturated
    arrival_time: float = field(default_factory=time.monotonic)
    token_ids: list[int] = field(default_factory=list)
    output_logprobs: list = field(default_factory=list)
    prompt_logprobs: list = field(default_factory=list)  # entry j: prompt token j + 1 (worker/prompt_logprobs.py)
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1  # prompt tokens served from the prefix cache (set at first schedule)
    num_preemptions: int = 0
    num_pending_tokens: int = 0  # sampled on the device, not yet read by the host
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: int | str | None = None
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    error: str | None = None
    grammar: RequestGrammar | None = None  # structured output: advanced by every output token
    # len(prompt_token_ids), which never changes: read for every running request several times a step
    num_prompt_tokens: int = field(init=False)

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_tokens_with_pending(self) -> int:
        return len(self.token_ids) + self.num_pending_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Prompt logprobs asked for and not yet all computed (they are, once the first token is)."""
        return self.sampling_params.prompt_logprobs is not None and self.num_output_tokens == 0

    def store_prompt_logprobs(self, start: int, entries: list) -> None:
        """A chunk's prompt logprobs from position `start` on (a recompute replaces what it computes again)."""
        del self.prompt_logprobs[start:]
        self.prompt_logprobs.extend(entries)

    def append_output(self, token_id: int, logprobs=None) -> None:
        """Append one output token; a request with a grammar advances it (ValueError if it forbids the token)."""
        if self.grammar is not None:
            self.grammar.accept(token_id)
        self.token_ids.append(token_id)
        if self.sampling_params.logprobs is not None:
            self.output_logprobs.append(logprobs)

    def ends_by_length(self, max_model_len: int) -> bool:
        """True when the tokens sampled so far (pending ones included) already end this request by length:
        it needs no further step, whatever those tokens are."""
        num = self.num_tokens_with_pending
        return num - self.num_prompt_tokens >= self.max_tokens or num >= max_model_len

    def check_stop(self, max_model_len: int) -> RequestStatus | None:
        """The finished status this request reached after its last token, or None."""
        params = self.sampling_params
        num_out = self.num_output_tokens
        last = self.token_ids[-1]
        if num_out >= params.min_tokens:
            if not params.ignore_eos and last in self.eos_token_ids:
                self.stop_reason = None
                return RequestStatus.FINISHED_STOPPED
            if last in params.stop_token_ids:
                self.stop_reason = last
                return RequestStatus.FINISHED_STOPPED
        if self.grammar is not None and self.grammar.is_terminated:  # the grammar is complete (also with ignore_eos)
            self.stop_reason = None
            return RequestStatus.FINISHED_STOPPED
        if num_out >= self.max_tokens or self.num_tokens >= max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None
