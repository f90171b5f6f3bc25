"""Prompt logprobs (vLLM's `prompt_logprobs`): each prompt token's logprob given the tokens before it.

The logits at position p predict token p + 1, so a prefill chunk computing positions
[start, end) of a P-token prompt yields the logprobs of prompt tokens start+1 .. min(end, P-1):

    prompt      t0   t1   t2   t3   t4          (P = 5)
    chunk 1     [start=0 ...... end=3)          rows p = 0, 1, 2 -> logprobs of t1, t2, t3
    chunk 2                    [3 .. 5)         row  p = 3       -> logprob of t4
                                                (p = 4's logits sample the first output token)

Entry j of a request's list is the logprob of prompt token j + 1 (t0 has none: vLLM and OpenAI
answer None for it). A chunk that recomputes from `start` (preemption) replaces entries from
`start` on, so a recompute never duplicates them. Requests asking for prompt logprobs read no
prefix-cache blocks until their prompt is done (the scheduler): every position is computed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from splitserve.common.logprobs import TokenLogprobs

ROWS_PER_PIECE = 512  # rows of (rows, V) logits materialized at once, bounding the memory one chunk takes


@dataclass(frozen=True)
class PromptRows:
    """One request's prompt-logprob rows in a step: hidden rows [first_row, first_row + len(targets)) are
    positions start, start+1, ...; `targets` are the prompt tokens they predict; `num_top` alternatives."""

    request_id: str
    start: int
    first_row: int
    targets: tuple[int, ...]
    num_top: int


def prompt_rows(request, start: int, end: int, first_row: int) -> PromptRows | None:
    """The rows of a step computing positions [start, end) of `request` (hidden row `first_row` is `start`),
    or None when it wants no prompt logprobs or the chunk predicts no prompt token."""
    if not request.needs_prompt_logprobs:
        return None
    stop = min(end, request.num_prompt_tokens - 1)
    if stop <= start:
        return None
    targets = tuple(request.prompt_token_ids[start + 1 : stop + 1])
    return PromptRows(request.request_id, start, first_row, targets, request.sampling_params.prompt_logprobs)


def compute_prompt_logprobs(
    compute_logits, hidden: torch.Tensor, rows: list[PromptRows]
) -> dict[str, tuple[int, list[TokenLogprobs]]]:
    """request_id -> (start position, logprobs of the prompt tokens the rows predict, with their ranks and
    top alternatives), from the step's hidden states (T, H); float64 models stay in float64."""
    out = {}
    for r in rows:
        entries: list[TokenLogprobs] = []
        for lo in range(0, len(r.targets), ROWS_PER_PIECE):
            targets = r.targets[lo : lo + ROWS_PER_PIECE]
            h = hidden[r.first_row + lo : r.first_row + lo + len(targets)]  # (R, H)
            entries += _entries(compute_logits(h), targets, r.num_top)
        out[r.request_id] = (r.start, entries)
    return out


def _entries(logits: torch.Tensor, targets: tuple[int, ...], num_top: int) -> list[TokenLogprobs]:
    work = logits if logits.dtype == torch.float64 else logits.float()
    logprobs = work.log_softmax(dim=-1)  # (R, V)
    index = torch.tensor(targets, device=logprobs.device)[:, None]  # (R, 1)
    chosen = logprobs.gather(1, index)  # (R, 1)
    ranks = (logprobs > chosen).sum(dim=-1) + 1  # (R,) 1 = the most likely token
    top_ids: list[list[int]] = [[] for _ in targets]
    top_vals: list[list[float]] = [[] for _ in targets]
    if num_top > 0:
        top = logprobs.topk(min(num_top, logprobs.shape[-1]), dim=-1)  # (R, num_top)
        top_ids, top_vals = top.indices.tolist(), top.values.tolist()
    return [
        TokenLogprobs(t, lp, list(zip(ids, vals)), rank)
        for t, lp, rank, ids, vals in zip(targets, chosen[:, 0].tolist(), ranks.tolist(), top_ids, top_vals)
    ]
