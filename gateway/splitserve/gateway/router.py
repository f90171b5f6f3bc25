"""Which prefill and which decode instance take a request.

Prefill: the up instance with the least prompt work ahead of this request's own new tokens
(ties: fewest waiting requests):

    work = queued prompt tokens (Describe) + prompt tokens sent since its last Describe
           - leading prompt tokens it prefilled recently (prefix affinity: its cache has them)

Decode: among the candidates (compatible with the chosen prefill, or colocated workers,
or any up decode for a local prefill) that have room (fewer than max_waiting_per_decode
requests waiting: Describe's num_waiting plus requests sent since and not yet running there; a request
already prefilled when none has room may go to a full one that is not draining: `overflow_candidates`),
the highest score

    score = free_blocks - blocks assigned since its last Describe
            - max(running + waiting, this gateway's in-flight requests there)
            + leading prompt blocks it served recently (prefix affinity)

A cached leading block counts as one free block: the decode will not allocate or pull it.
Affinity is an LRU per pool of block hash -> (address, start time); block hashes are the
chained prefix hashes of common.prefix_hash with the instance's block_size, so they are
the hashes its own prefix cache uses.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence

from splitserve.common.prefix_hash import extra_keys_for, hash_full_blocks
from splitserve.gateway.registry import Instance, Registry

AFFINITY_CAPACITY = 1 << 16  # block hashes remembered


class Router:
    """Routing policy over a Registry; owns the local load counters and the affinity LRU."""

    def __init__(
        self, registry: Registry, affinity_capacity: int = AFFINITY_CAPACITY, max_waiting_per_decode: int = 256
    ) -> None:
        self._registry = registry
        self.max_waiting_per_decode = max_waiting_per_decode
        # per pool: a request's blocks are cached both where it was prefilled and where it decodes
        self._affinity: dict[str, OrderedDict[bytes, tuple[str, int]]] = {
            "prefill": OrderedDict(),
            "decode": OrderedDict(),
        }
        self._capacity = affinity_capacity

    # -- prefill ---------------------------------------------------------------------------

    def pick_prefill(self, prompt_token_ids: Sequence[int] = (), decode: Instance | None = None) -> Instance | None:
        """The up prefill with the least work ahead (see the module docstring) among those with at
        least one compatible up decode (compatible with `decode`, when given: the one seating the request)."""
        decodes = [decode] if decode is not None else [d for d in self._registry.decodes() if d.up]
        candidates = [
            p
            for p in self._registry.prefills()
            if p.up and not p.describe.draining and any(self._registry.compatible(p, d) for d in decodes)
        ]
        if not candidates:
            return None
        overlaps = self._overlaps(candidates, prompt_token_ids, "prefill") if prompt_token_ids else {}

        def key(p: Instance) -> tuple[int, int]:
            load = p.describe.load
            cached_tokens = overlaps.get(p.affinity_key, 0) * _hash_params(p)[0]
            return (load.num_queued_tokens + p.pending_tokens - cached_tokens, load.num_waiting + p.pending_requests)

        return min(candidates, key=key)  # min() keeps the first listed of equal keys

    # -- decode ----------------------------------------------------------------------------

    def decode_candidates(
        self, prefill: Instance | None, *, colocated_only: bool = False, with_room: bool = True
    ) -> list[Instance]:
        """Up decodes that may take a request: compatible with `prefill` when given, else
        colocated workers (colocated_only) or every up decode (local prefill); only those
        with room unless `with_room` is False."""
        decodes = [d for d in self._registry.decodes() if d.up and (not with_room or self.has_room(d))]
        if prefill is not None:
            return [d for d in decodes if self._registry.compatible(prefill, d)]
        if colocated_only:
            return [d for d in decodes if d.role == "both"]
        return decodes

    def overflow_candidates(self, prefill: Instance | None) -> list[Instance]:
        """Up decodes compatible with `prefill` (any, without one) that are not draining, however many requests
        wait there: for a
        request already prefilled when every decode filled up (it was admitted while one had room). Its first
        token is out and its KV held: queueing it at a decode beats failing it mid-stream; the limit keeps
        deciding admission (a burst of 1,024 on a CPU `up` failed 17-51 prefilled requests so)."""
        return [d for d in self.decode_candidates(prefill, with_room=False) if not d.describe.draining]

    def num_waiting(self, d: Instance) -> int:
        """Requests waiting at decode `d`: its last Describe's, plus those sent since."""
        return d.describe.load.num_waiting + d.pending_requests

    def has_room(self, d: Instance, ahead: Callable[[int], int] | None = None) -> bool:
        """False when full, or draining (it finishes what it has and takes nothing new). `ahead`: of the requests
        waiting there, how many a request would wait behind (the decode runs lower shares first), so that a caller
        with little in flight is not refused because another one filled the queue."""
        waiting = self.num_waiting(d)
        if ahead is not None and waiting >= self.max_waiting_per_decode:  # asked only when it can matter
            waiting = min(waiting, ahead(waiting))
        return not d.describe.draining and waiting < self.max_waiting_per_decode

    def pick_decode(self, candidates: Sequence[Instance], prompt_token_ids: Sequence[int]) -> Instance | None:
        """The best-scoring candidate (see the module docstring); ties go to the first listed."""
        if not candidates:
            return None
        overlaps = self._overlaps(candidates, prompt_token_ids, "decode")

        def score(d: Instance) -> int:
            load = d.describe.load
            busy = max(load.num_running + load.num_waiting, d.in_flight)
            return load.num_free_blocks - d.pending_blocks - busy + overlaps.get(d.affinity_key, 0)

        return max(candidates, key=score)  # max() keeps the first of equal scores

    def _overlaps(
        self, candidates: Sequence[Instance], prompt_token_ids: Sequence[int], pool: str
    ) -> dict[tuple[str, int], int]:
        """Longest leading-block match (in blocks) per candidate's affinity key."""
        affinity = self._affinity[pool]
        wanted = {d.affinity_key for d in candidates}
        found: dict[tuple[str, int], int] = {}
        for block_size, model_id in {_hash_params(d) for d in candidates}:
            hashes = self._hashes(prompt_token_ids, block_size, model_id)
            for index in range(len(hashes) - 1, -1, -1):
                owner = affinity.get(hashes[index])
                if owner in wanted and owner not in found:
                    found[owner] = index + 1
                if len(found) == len(wanted):
                    break
        return found

    @staticmethod
    def _hashes(prompt_token_ids: Sequence[int], block_size: int, model_id: str) -> list[bytes]:
        if block_size <= 0:
            return []
        return hash_full_blocks(list(prompt_token_ids), block_size, extra_keys_for(model_id))

    # -- bookkeeping -----------------------------------------------------------------------

    def seat(self, inst: Instance) -> None:
        """A request took a seat reservation on decode `inst` (it waits there for a seat or for its prefill):
        count it in flight until release(); it waits at the decode only once sent there (assign)."""
        inst.in_flight += 1

    def assign(self, inst: Instance, prompt_token_ids: Sequence[int], seated: bool = False) -> None:
        """A request was sent to `inst`: count it until release() (`seated`: counted since seat()); remember its
        blocks."""
        if not seated:
            inst.in_flight += 1
        inst.pending_requests += 1
        inst.pending_tokens += len(prompt_token_ids)
        if inst.describe is not None:
            block_size, model_id = _hash_params(inst)
            if block_size > 0:
                if inst.pool == "decode":
                    inst.pending_blocks += -(-len(prompt_token_ids) // block_size)
                affinity = self._affinity[inst.pool]
                for h in self._hashes(prompt_token_ids, block_size, model_id):
                    affinity[h] = inst.affinity_key
                    affinity.move_to_end(h)
                while len(affinity) > self._capacity:
                    affinity.popitem(last=False)

    @staticmethod
    def started(inst: Instance, describes_at_assign: int) -> None:
        """A request assigned to decode `inst` (when it had `describes_at_assign` Describe answers) sent its
        first output: it runs there, so it is no longer waiting. Counted as waiting (pending_requests) only until
        the next Describe, which counts it itself. Without this, every request sent between two Describes
        counted as waiting: in a burst a decode looked full (max_waiting_per_decode) while its batch had room,
        and prefilled requests failed for want of a decode (docs/performance.md, "Findings that set defaults")."""
        if inst.num_describes == describes_at_assign and inst.pending_requests > 0:
            inst.pending_requests -= 1

    @staticmethod
    def release(inst: Instance) -> None:
        """The request left `inst` (finished, failed or aborted)."""
        inst.in_flight = max(0, inst.in_flight - 1)


def _hash_params(d: Instance) -> tuple[int, str]:
    layout = d.describe.layout
    return (layout.block_size, layout.model_id or d.describe.model_id)
