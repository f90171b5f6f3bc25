"""Per-token logprobs as the engine samples them and the wire carries them."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class TokenLogprobs:
    """The chosen token's logprob and the top-n alternatives (highest first); `rank` is the chosen token's
    place in the distribution (1 = most likely) where it was computed (prompt logprobs), else None."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]
    rank: int | None = None
