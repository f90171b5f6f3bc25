"""The scheduler's output types: what one step computes. The worker reads them without importing the scheduler."""

from __future__ import annotations

from dataclasses import dataclass, field

from splitserve.engine.scheduling.request import Request


@dataclass
class ScheduledRequest:
    """One request's share of a step: compute tokens [num_computed, num_computed + num_new)."""

    request: Request
    num_new_tokens: int
    num_computed_tokens: int  # before this step
    samples: bool | None = None  # this step brings the request level, so its last logits are sampled

    def __post_init__(self) -> None:
        if self.samples is None:
            self.samples = self.num_computed_tokens + self.num_new_tokens == self.request.num_tokens_with_pending

    @property
    def num_computed_after(self) -> int:
        return self.num_computed_tokens + self.num_new_tokens


@dataclass
class SchedulerOutput:
    """One step: who computes what. `prompt_logprobs` (request_id -> (start position, entries)) is filled by
    the runner when it runs the step, the only place the hidden states exist; update_from_output stores it."""

    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    step_number: int = 0  # set at launch (Scheduler.step_launched)
    prompt_logprobs: dict[str, tuple[int, list]] = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled
