"""Per-token logprobs as the engine samples them and the wire carries them."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class TokenLogprobs:
    """The chosen token's logprob and the top-n alternatives (highest first)."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]
