"""What the engine gives back: one `RequestOutput` per request a step progressed or ended, and the error
for a request it refuses. At the bottom of the engine: the core, its process and the offline API read them."""

from __future__ import annotations

import operator
from dataclasses import dataclass, field, fields


class RequestError(ValueError):
    """A request the engine refuses (bad prompt, over the context or the pool)."""


@dataclass
class RequestOutput:
    """What one step did for one request."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list = field(default_factory=list)
    finished: bool = False
    finish_reason: str | None = None  # stop | length | abort | error | prefilled
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    error: str | None = None
    queue_ns: int = 0  # arrival to first scheduled compute, on a request's first output
    # with the first token, when asked for: the logprobs of prompt tokens 1.. (worker/prompt_logprobs.py)
    prompt_logprobs: list | None = None

    def __reduce__(self):
        # every step pickles one of these per running request (core -> service): a positional tuple
        # pickles and unpickles faster than a dataclass's attribute dict (docs/performance.md, "Host step")
        return RequestOutput, _output_fields(self)


_output_fields = operator.attrgetter(*(f.name for f in fields(RequestOutput)))
