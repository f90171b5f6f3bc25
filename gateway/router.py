"""Which prefill and which decode instance take a request.

Prefill: the up instance with the fewest queued prompt tokens (ties: fewest waiting
requests), counting what this gateway sent it since its last Describe.

Decode: among the candidates (compatible with the chosen prefill, or colocated workers,
or any up decode for a local prefill) that have room (fewer than max_waiting_per_decode
requests waiting: Describe's num_waiting plus requests sent since), the highest score

    score = free_blocks - blocks assigned since its last Describe
            - max(running + waiting, this gateway's in-flight requests there)
            + leading prompt blocks it served recently (prefix affinity)

A cached leading block counts as one free block: the decode will not allocate or pull it.
Affinity is an LRU of block hash -> (decode address, start time); block hashes are the
chained prefix hashes of engine.prefix_hash with the decode's block_size, so they are
the hashes the decode's own prefix cache uses.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Sequence

from engine.prefix_hash import extra_keys_for, hash_full_blocks
from gateway.registry import Instance, Registry

AFFINITY_CAPACITY = 1 << 16  # block hashes remembered


class Router:
    """Routing policy over a Registry; owns the local load counters and the affinity LRU."""

    def __init__(self, registry: Registry, affinity_capacity: int = AFFINITY_CAPACITY,
                 max_waiting_per_decode: int = 256) -> None:
        self._registry = registry
        self.max_waiting_per_decode = max_waiting_per_decode
        self._affinity: OrderedDict[bytes, tuple[str, int]] = OrderedDict()
        self._capacity = affinity_capacity

    # -- prefill ---------------------------------------------------------------------------

    def pick_prefill(self) -> Instance | None:
        """The least-loaded up prefill that has at least one compatible up decode."""
        decodes = [d for d in self._registry.decodes() if d.up]
        candidates = [p for p in self._registry.prefills()
                      if p.up and not p.describe.draining and any(self._registry.compatible(p, d) for d in decodes)]
        if not candidates:
            return None

        def key(p: Instance) -> tuple[int, int]:
            load = p.describe.load
            return (load.num_queued_tokens + p.pending_tokens, load.num_waiting + p.pending_requests)

        return min(candidates, key=key)  # min() keeps the first listed of equal keys

    # -- decode ----------------------------------------------------------------------------

    def decode_candidates(self, prefill: Instance | None, *, colocated_only: bool = False,
                          with_room: bool = True) -> list[Instance]:
        """Up decodes that may take a request: compatible with `prefill` when given, else
        colocated workers (colocated_only) or every up decode (local prefill); only those
        with room unless `with_room` is False."""
        decodes = [d for d in self._registry.decodes() if d.up and (not with_room or self.has_room(d))]
        if prefill is not None:
            return [d for d in decodes if self._registry.compatible(prefill, d)]
        if colocated_only:
            return [d for d in decodes if d.role == "both"]
        return decodes

    def num_waiting(self, d: Instance) -> int:
        """Requests waiting at decode `d`: its last Describe's, plus those sent since."""
        return d.describe.load.num_waiting + d.pending_requests

    def has_room(self, d: Instance) -> bool:
        """False when full, or draining (it finishes what it has and takes nothing new)."""
        return not d.describe.draining and self.num_waiting(d) < self.max_waiting_per_decode

    def pick_decode(self, candidates: Sequence[Instance], prompt_token_ids: Sequence[int]) -> Instance | None:
        """The best-scoring candidate (see the module docstring); ties go to the first listed."""
        if not candidates:
            return None
        overlaps = self._overlaps(candidates, prompt_token_ids)

        def score(d: Instance) -> int:
            load = d.describe.load
            busy = max(load.num_running + load.num_waiting, d.in_flight)
            return load.num_free_blocks - d.pending_blocks - busy + overlaps.get(d.affinity_key, 0)

        return max(candidates, key=score)  # max() keeps the first of equal scores

    def _overlaps(self, candidates: Sequence[Instance], prompt_token_ids: Sequence[int]) -> dict[tuple[str, int], int]:
        """Longest leading-block match (in blocks) per candidate's affinity key."""
        wanted = {d.affinity_key for d in candidates}
        found: dict[tuple[str, int], int] = {}
        for block_size, model_id in {_hash_params(d) for d in candidates}:
            hashes = self._hashes(prompt_token_ids, block_size, model_id)
            for index in range(len(hashes) - 1, -1, -1):
                owner = self._affinity.get(hashes[index])
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

    def assign(self, inst: Instance, prompt_token_ids: Sequence[int]) -> None:
        """A request was sent to `inst`: count it until release(); remember its blocks."""
        inst.in_flight += 1
        inst.pending_requests += 1
        inst.pending_tokens += len(prompt_token_ids)
        if inst.pool == "decode" and inst.describe is not None:
            block_size, model_id = _hash_params(inst)
            if block_size > 0:
                inst.pending_blocks += -(-len(prompt_token_ids) // block_size)
                for h in self._hashes(prompt_token_ids, block_size, model_id):
                    self._affinity[h] = inst.affinity_key
                    self._affinity.move_to_end(h)
                while len(self._affinity) > self._capacity:
                    self._affinity.popitem(last=False)

    @staticmethod
    def release(inst: Instance) -> None:
        """The request left `inst` (finished, failed or aborted)."""
        inst.in_flight = max(0, inst.in_flight - 1)


def _hash_params(d: Instance) -> tuple[int, str]:
    layout = d.describe.layout
    return (layout.block_size, layout.model_id or d.describe.model_id)

