"""The block pool: ref counts, the free list, and the prefix-cache hash map.

It is the only owner of block state; everyone else holds block ids. A block is in
exactly one of three states:

    in use        ref_count > 0                (in no free list)
    free, cached  ref_count == 0, has a hash   (in `_cached_free`, LRU order; reusable by hash)
    free, empty   ref_count == 0, no hash      (in `_empty_free`)

Allocation takes empty blocks first and only then evicts the least recently freed
cached block (dropping its hash). Freeing a hashed block keeps it reusable until evicted.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterable


class NoFreeBlocksError(RuntimeError):
    """Raised when an allocation asks for more blocks than are free."""


class BlockPool:
    """Fixed pool of `num_blocks` KV blocks with ref counts and an LRU prefix cache."""

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.ref_counts = [0] * num_blocks
        self.block_hashes: list[bytes | None] = [None] * num_blocks
        self._empty_free: deque[int] = deque(range(num_blocks))
        self._cached_free: OrderedDict[int, None] = OrderedDict()
        self._hash_to_block: dict[bytes, int] = {}
        self.num_evictions = 0
        self.num_blocks_freed = 0  # blocks that became free: waiting allocations retry only after one did

    # -- queries ---------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take now (empty plus evictable cached)."""
        return len(self._empty_free) + len(self._cached_free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._hash_to_block)

    def lookup(self, block_hash: bytes) -> int | None:
        """The block holding this hash, or None."""
        return self._hash_to_block.get(block_hash) if self.enable_caching else None

    def free_block_ids(self) -> list[int]:
        """Free blocks in allocation order (for tests)."""
        return list(self._empty_free) + list(self._cached_free)

    # -- mutations -------------------------------------------------------------------------
    def allocate(self, num: int) -> list[int]:
        """Take `num` free blocks (ref count 1 each), empty ones first, then LRU cached ones."""
        if num > self.num_free_blocks:
            raise NoFreeBlocksError(f"asked for {num} blocks, {self.num_free_blocks} free")
        out = []
        for _ in range(num):
            if self._empty_free:
                block_id = self._empty_free.popleft()
            else:
                block_id, _ = self._cached_free.popitem(last=False)
                self._drop_hash(block_id)
                self.num_evictions += 1
            self.ref_counts[block_id] = 1
            out.append(block_id)
        return out

    def touch(self, block_ids: Iterable[int]) -> None:
        """Add a reference to each block (a prefix-cache hit); revives free cached blocks."""
        for block_id in block_ids:
            if self.ref_counts[block_id] == 0:
                self._cached_free.pop(block_id)
            self.ref_counts[block_id] += 1

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one reference from each block, in the given order.

        Callers pass a request's blocks tail first, so its last blocks are evicted first.
        """
        for block_id in block_ids:
            count = self.ref_counts[block_id]
            if count <= 0:
                raise RuntimeError(f"block {block_id} freed with ref count {count}")
            self.ref_counts[block_id] = count - 1
            if count == 1:
                self.num_blocks_freed += 1
                if self.block_hashes[block_id] is not None:
                    self._cached_free[block_id] = None
                else:
                    self._empty_free.append(block_id)

    def register_hash(self, block_id: int, block_hash: bytes) -> bool:
        """Record that a (full, in-use) block holds `block_hash`. False if another block has it."""
        if not self.enable_caching or self.block_hashes[block_id] is not None:
            return False
        if block_hash in self._hash_to_block:
            return False
        self.block_hashes[block_id] = block_hash
        self._hash_to_block[block_hash] = block_id
        return True

    def reset_prefix_cache(self) -> int:
        """Forget every free cached block's hash; returns how many were dropped."""
        dropped = list(self._cached_free)
        for block_id in dropped:
            self._drop_hash(block_id)
            self._empty_free.append(block_id)
        self._cached_free.clear()
        return len(dropped)

    def _drop_hash(self, block_id: int) -> None:
        block_hash = self.block_hashes[block_id]
        if block_hash is not None:
            self.block_hashes[block_id] = None
            if self._hash_to_block.get(block_hash) == block_id:
                del self._hash_to_block[block_hash]
