"""What a step reports of each request it changed: a `RequestOutput` (the offline API's and the services' type)."""

from __future__ import annotations

from splitserve.engine.outputs import RequestOutput
from splitserve.engine.scheduling.request import Request, RequestStatus


def request_output(request: Request) -> RequestOutput:
    """The output of a request a step changed: its new token (and its logprobs), the end state when it ended or
    was parked (PREFILLED); a first output also carries the queue time and the prompt logprobs; a request whose
    step token was refused (FINISHED_ERROR) reports nothing new, only the reason."""
    status = request.status
    if status == RequestStatus.FINISHED_ERROR:  # its step's token was refused: nothing new, the reason
        return RequestOutput(request.request_id, [], finished=True, finish_reason="error", error=request.error)
    lp = [request.output_logprobs[-1]] if request.sampling_params.logprobs is not None else []
    first = len(request.token_ids) - request.num_prompt_tokens == 1  # what only a first output carries
    ended = status.is_finished or status == RequestStatus.PREFILLED
    return RequestOutput(
        request_id=request.request_id,
        new_token_ids=[request.token_ids[-1]],
        new_logprobs=lp,
        finished=ended,
        finish_reason=status.value if ended else None,
        stop_reason=request.stop_reason,
        num_cached_tokens=max(request.num_cached_tokens, 0),
        queue_ns=_queue_ns(request) if first else 0,
        prompt_logprobs=_first_prompt_logprobs(request) if first else None,
    )


def _queue_ns(request: Request) -> int:
    """Arrival to first scheduled compute (the caller asks on a request's first output only)."""
    if request.first_scheduled_time is None:
        return 0
    return int((request.first_scheduled_time - request.arrival_time) * 1e9)


def _first_prompt_logprobs(request: Request) -> list | None:
    """The prompt logprobs, when the request asked for them (the caller asks on its first output only)."""
    if request.sampling_params.prompt_logprobs is None:
        return None
    return list(request.prompt_logprobs)
