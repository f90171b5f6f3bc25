"""Which blocks each request holds, prefix-cache lookups, and block hashing.

The scheduler asks this manager for slots; it never touches block state itself. The
pool (scheduling/block_pool.py) owns ref counts; this manager owns the request → blocks map
and each request's block hashes.

    token_ids:  [ b0 (full) | b1 (full) | b2 (partial) ]
    blocks:     [ id0       | id1       | id2          ]   id0, id1 registered by hash
                ^ computed prefix found in the cache is touched, not recomputed
"""

from __future__ import annotations

from splitserve.common.prefix_hash import hash_full_blocks
from splitserve.engine.scheduling.block_pool import BlockPool
from splitserve.engine.scheduling.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KvCacheManager:
    """Allocates, caches and frees the blocks of requests (by request_id)."""

    def __init__(self, pool: BlockPool, block_size: int, extra_keys: bytes) -> None:
        self.pool = pool
        self.block_size = block_size
        self.extra_keys = extra_keys
        self.req_blocks: dict[str, list[int]] = {}
        self._req_hashes: dict[str, list[bytes]] = {}
        self._num_registered: dict[str, int] = {}
        self.num_prefix_queries_tokens = 0
        self.num_prefix_hit_tokens = 0

    # -- prefix cache ----------------------------------------------------------------------
    def block_hashes(self, request: Request) -> list[bytes]:
        """Chained hashes of the request's full blocks (extended incrementally)."""
        hashes = self._req_hashes.get(request.request_id, [])
        if len(hashes) < request.num_tokens // self.block_size:
            hashes = hash_full_blocks(request.token_ids, self.block_size, self.extra_keys, hashes)
            self._req_hashes[request.request_id] = hashes
        return hashes

    def keep_hashes(self, request_id: str, hashes: list[bytes]) -> None:
        """The hashes of a request's full prompt blocks, computed by the caller (an import's prefix lookup), kept
        as its own: caching its blocks later hashes nothing again (a 2,048-token prompt: 128 sha256 blocks)."""
        self._req_hashes[request_id] = hashes

    def find_cached_prefix(self, request: Request) -> list[int]:
        """Block ids of the longest cached prefix of the request, leaving >= 1 token to compute.

        At least one token must be computed so the step produces logits to sample from.
        """
        if not self.pool.enable_caching:
            return []
        max_blocks = (request.num_tokens - 1) // self.block_size
        found = []
        for block_hash in self.block_hashes(request)[:max_blocks]:
            block_id = self.pool.lookup(block_hash)
            if block_id is None:
                break
            found.append(block_id)
        self.num_prefix_queries_tokens += request.num_tokens
        self.num_prefix_hit_tokens += len(found) * self.block_size
        return found

    def lookup_hashes(self, hashes: list[bytes]) -> list[int]:
        """Block ids of the longest prefix of `hashes` present in the cache."""
        found = []
        for block_hash in hashes:
            block_id = self.pool.lookup(block_hash)
            if block_id is None:
                break
            found.append(block_id)
        return found

    # -- allocation ------------------------------------------------------------------------
    def num_blocks_needed(self, request: Request, num_new_tokens: int, cached: list[int] = ()) -> int:
        """New blocks an allocate_slots call would take (cached blocks that are free count too)."""
        held = len(self.req_blocks.get(request.request_id, ())) + len(cached)
        need = (
            cdiv(request.num_computed_tokens + len(cached) * self.block_size + num_new_tokens, self.block_size) - held
        )
        revived = sum(1 for b in cached if self.pool.ref_counts[b] == 0)
        return max(need, 0) + revived

    def allocate_slots(self, request: Request, num_new_tokens: int, cached: list[int] = ()) -> bool:
        """Make room for num_new_tokens more tokens (after adopting `cached` prefix blocks).

        Returns False, changing nothing, when the pool cannot supply the blocks.
        """
        held = self.req_blocks.get(request.request_id)
        if (
            not cached
            and held is not None
            and len(held) * self.block_size >= request.num_computed_tokens + num_new_tokens
        ):
            return True  # e.g. a decode step inside its last block: nothing to allocate
        if self.num_blocks_needed(request, num_new_tokens, cached) > self.pool.num_free_blocks:
            return False
        blocks = self.req_blocks.setdefault(request.request_id, [])
        if cached:
            self.pool.touch(cached)
            blocks.extend(cached)
            self._num_registered[request.request_id] = len(blocks)
        total = request.num_computed_tokens + len(cached) * self.block_size + num_new_tokens
        missing = cdiv(total, self.block_size) - len(blocks)
        if missing > 0:
            blocks.extend(self.pool.allocate(missing))
        return True

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Register the hashes of the request's blocks that are now full and computed."""
        if not self.pool.enable_caching:
            return
        num_full = num_computed_tokens // self.block_size
        start = self._num_registered.get(request.request_id, 0)
        if num_full <= start:
            return
        hashes = self.block_hashes(request)
        blocks = self.req_blocks[request.request_id]
        for i in range(start, num_full):
            self.pool.register_hash(blocks[i], hashes[i])
        self._num_registered[request.request_id] = num_full

    def fork(self, parent_id: str, child_id: str, num_tokens: int) -> tuple[int, int] | None:
        """Give `child_id` the parent's KV of its first `num_tokens` tokens: the full blocks shared (one
        more reference each), the partial block after them, if any, as a fresh block to copy it into.

        Returns that copy as (parent's block, child's block), or None when there is no partial block.
        Raises NoFreeBlocksError, changing nothing, when no block is free for the copy.
        """
        parent_blocks = self.req_blocks[parent_id]
        num_full, partial = divmod(num_tokens, self.block_size)
        copy = (parent_blocks[num_full], self.pool.allocate(1)[0]) if partial else None
        shared = parent_blocks[:num_full]
        self.pool.touch(shared)
        self.req_blocks[child_id] = shared + ([copy[1]] if copy else [])
        self._num_registered[child_id] = min(num_full, self._num_registered.get(parent_id, 0))
        return copy

    def free(self, request_id: str) -> None:
        """Release every block of the request, tail first (so its tail is evicted first)."""
        blocks = self.req_blocks.pop(request_id, [])
        self.pool.free(reversed(blocks))
        self._req_hashes.pop(request_id, None)
        self._num_registered.pop(request_id, None)

    def blocks_of(self, request_id: str) -> list[int]:
        return self.req_blocks.get(request_id, [])
