"""Per-client rate limits: token buckets on requests per second and on tokens per minute.

A bucket holds up to `capacity` units and refills continuously at `rate_per_s`. A request
takes one unit from the client's request bucket when it is admitted, and `cost` units from
its token bucket once its prompt is tokenized (cost = prompt tokens + max_tokens). When a
bucket is short the request is refused with RESOURCE_EXHAUSTED / HTTP 429 and Retry-After:
the whole seconds until the bucket holds enough again (at least 1). Nothing is refunded.
A cost larger than the token bucket's capacity can never be served: INVALID_ARGUMENT / 400
naming max_tokens (retrying would not help).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

from splitserve.gateway.admission import LocalBucket, LocalCounts
from splitserve.gateway.errors import GatewayError


class TokenBucket:
    """`capacity` units, refilled at `rate_per_s`; starts full. Times from `clock` (seconds).

    `state` holds the level and its time stamp: this bucket's own (the default), or a record that every
    process of the gateway shares (gateway/admission.py), read and updated under its lock."""

    def __init__(
        self, capacity: float, rate_per_s: float, clock: Callable[[], float], state: LocalBucket | None = None
    ) -> None:
        self.capacity = capacity
        self.rate_per_s = rate_per_s
        self._clock = clock
        self._state = state if state is not None else LocalBucket()

    def _refill(self) -> float:
        state, now = self._state, self._clock()
        level = min(self.capacity, state.level + (now - state.stamp) * self.rate_per_s) if state.used else self.capacity
        state.level, state.stamp, state.used = level, now, True
        return level

    def level(self) -> float:
        with self._state.locked():
            return self._refill()

    def take(self, units: float) -> int:
        """Take `units` and return 0, or take nothing and return the seconds to wait (>= 1)."""
        with self._state.locked():
            level = self._refill()
            if level >= units:
                self._state.level = level - units
                return 0
        return max(1, math.ceil((units - level) / self.rate_per_s))


class RateLimiter:
    """The buckets of every client id (created on first use, bounded by the configured keys).

    rps: requests per second (0 = off), burst: request bucket size (0 = max(1, ceil(rps))),
    tokens_per_min: token bucket size and refill per minute (0 = off). `counts` (gateway/admission.py) holds
    every bucket's state: this process's, or the one every process of the gateway shares.
    """

    def __init__(
        self,
        rps: float = 0.0,
        burst: int = 0,
        tokens_per_min: int = 0,
        clock: Callable[[], float] = time.monotonic,
        counts: LocalCounts | None = None,
    ) -> None:
        self.rps = rps
        self.burst = burst or max(1, math.ceil(rps))
        self.tokens_per_min = tokens_per_min
        self._clock = clock
        self._counts = counts if counts is not None else LocalCounts()
        self._requests: dict[str, TokenBucket] = {}
        self._tokens: dict[str, TokenBucket] = {}

    def take_request(self, client_id: str) -> None:
        """Charge one request to `client_id`; 429 with Retry-After when over the limit."""
        if not self.rps:
            return
        bucket = self._requests.get(client_id)
        if bucket is None:
            bucket = self._requests[client_id] = TokenBucket(
                self.burst, self.rps, self._clock, self._counts.bucket("requests", client_id)
            )
        wait_s = bucket.take(1)
        if wait_s:
            raise GatewayError(
                "rate_limited",
                f"rate limit exceeded: more than {self.rps:g} requests per second "
                f"(burst {self.burst}) for this API key; retry after {wait_s} s",
                code="rate_limit_exceeded",
                retry_after_s=wait_s,
            )

    def take_tokens(self, client_id: str, num_prompt_tokens: int, max_tokens: int, max_tokens_param: str) -> None:
        """Charge prompt + max_tokens to `client_id`; 429 (or 400 if it can never fit) when over."""
        if not self.tokens_per_min:
            return
        cost = num_prompt_tokens + max_tokens
        if cost > self.tokens_per_min:
            raise GatewayError(
                "invalid_argument",
                f"the request needs {cost} tokens ({num_prompt_tokens} prompt + {max_tokens} "
                f"{max_tokens_param}), more than this API key may use in a minute (rate_limit_tokens_per_min="
                f"{self.tokens_per_min}); lower {max_tokens_param} or shorten the prompt",
                param=max_tokens_param,
            )
        bucket = self._tokens.get(client_id)
        if bucket is None:
            bucket = self._tokens[client_id] = TokenBucket(
                self.tokens_per_min, self.tokens_per_min / 60.0, self._clock, self._counts.bucket("tokens", client_id)
            )
        wait_s = bucket.take(cost)
        if wait_s:
            raise GatewayError(
                "rate_limited",
                f"rate limit exceeded: the request needs {cost} tokens and this API "
                f"key has {int(bucket.level())} of its {self.tokens_per_min} tokens per minute left; "
                f"retry after {wait_s} s",
                code="rate_limit_exceeded",
                retry_after_s=wait_s,
            )
