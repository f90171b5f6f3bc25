"""Block pool, prefix hashing and the KV cache manager: exact block ids and free-list order."""

import hashlib

import pytest

from splitserve.common.prefix_hash import extra_keys_for, hash_block, hash_full_blocks
from splitserve.common.sampling_params import SamplingParams
from splitserve.engine.scheduling.block_pool import BlockPool, NoFreeBlocksError
from splitserve.engine.scheduling.kv_cache_manager import KvCacheManager
from splitserve.engine.scheduling.request import Request

EXTRA = extra_keys_for("tiny")


def make_request(request_id, tokens):
    return Request(
        request_id=request_id, prompt_token_ids=list(tokens), sampling_params=SamplingParams(), seed=0, max_tokens=8
    )


def test_hashes_are_chained_stable_and_model_scoped():
    a = hash_full_blocks([1, 2, 3, 4, 5, 6, 7, 8, 9], 4, EXTRA)
    assert len(a) == 2  # the trailing partial block has no hash
    assert a[0] == hash_block(b"", [1, 2, 3, 4], EXTRA)
    assert a[1] == hash_block(a[0], [5, 6, 7, 8], EXTRA)
    # the known sha256 values, identical in every process (never Python's hash()): the scheme of
    # prefix_hash.py written out by hand, parent ‖ token ids as little-endian uint32 ‖ extra keys
    extra = b"model=tiny\x00salt="
    assert EXTRA == extra
    block_0 = bytes.fromhex("01000000 02000000 03000000 04000000")
    block_1 = bytes.fromhex("05000000 06000000 07000000 08000000")
    expected_0 = hashlib.sha256(b"" + block_0 + extra).digest()
    expected_1 = hashlib.sha256(expected_0 + block_1 + extra).digest()
    assert expected_0.hex() == "247235733c8f9a5219b7abee3f5431f2068493987dc141b0c66e4b17dd2aefa8"
    assert expected_1.hex() == "1f74ae1aa86cecf7017e961724130c54bd34fcbdbd67b9d6727a8d365a35c122"
    assert a == [expected_0, expected_1]
    assert hash_full_blocks([9, 2, 3, 4, 5, 6, 7, 8], 4, EXTRA)[1] != a[1]  # parent differs
    assert hash_full_blocks([1, 2, 3, 4], 4, extra_keys_for("other"))[0] != a[0]
    assert hash_full_blocks([1, 2, 3, 4, 5, 6, 7, 8], 4, EXTRA, parent_hashes=a[:1]) == a


def test_a_long_prompt_hashes_block_by_block_as_hash_block_does():
    """hash_full_blocks packs all the new blocks' ids at once: the same bytes as one hash_block per block, for
    ids over 16 bits up to the largest uint32, from scratch and extending earlier hashes."""
    ids = [(i * 2654435761) % 2**32 for i in range(2048)] + [2**32 - 1, 0, 7]  # 128 full blocks of 16, then 3
    chain, parent = [], b""
    for start in range(0, 2048, 16):
        parent = hash_block(parent, ids[start : start + 16], EXTRA)
        chain.append(parent)
    assert hash_full_blocks(ids, 16, EXTRA) == chain
    assert hash_full_blocks(ids, 16, EXTRA, parent_hashes=chain[:100]) == chain
    assert hash_full_blocks(ids[:40], 16, EXTRA, parent_hashes=chain[:5]) == chain[:5]  # nothing new to hash


def test_allocate_free_order_and_errors():
    pool = BlockPool(4)
    assert pool.allocate(3) == [0, 1, 2]
    assert pool.num_free_blocks == 1
    with pytest.raises(NoFreeBlocksError, match="asked for 2 blocks, 1 free"):
        pool.allocate(2)
    pool.free([2, 1, 0])
    assert pool.free_block_ids() == [3, 2, 1, 0]
    with pytest.raises(RuntimeError, match="block 3 freed with ref count 0"):
        pool.free([3])


def test_cached_blocks_survive_free_and_are_evicted_lru_after_empty_ones():
    pool = BlockPool(4)
    assert pool.allocate(2) == [0, 1]
    assert pool.register_hash(0, b"h0") and pool.register_hash(1, b"h1")
    assert not pool.register_hash(1, b"other")  # already hashed
    pool.free([1, 0])
    assert pool.num_free_blocks == 4 and pool.num_cached_blocks == 2
    assert pool.lookup(b"h0") == 0
    # empty blocks 2, 3 go first; then the least recently freed cached block (1), dropping its hash
    assert pool.allocate(3) == [2, 3, 1]
    assert pool.lookup(b"h1") is None and pool.lookup(b"h0") == 0
    assert pool.num_evictions == 1
    pool.touch([0])  # revive the cached block
    assert pool.ref_counts[0] == 1 and pool.num_free_blocks == 0


def test_manager_allocates_exact_blocks_and_reuses_prefix():
    pool = BlockPool(8)
    kv = KvCacheManager(pool, 4, EXTRA)
    r1 = make_request("r1", range(10))  # 2 full blocks + 2 tokens
    assert kv.allocate_slots(r1, 10)
    assert kv.blocks_of("r1") == [0, 1, 2]
    kv.cache_blocks(r1, 10)
    r2 = make_request("r2", list(range(8)) + [50, 51, 52])
    cached = kv.find_cached_prefix(r2)
    assert cached == [0, 1]
    assert kv.allocate_slots(r2, 3, cached)
    assert kv.blocks_of("r2") == [0, 1, 3]
    assert pool.ref_counts[:4] == [2, 2, 1, 1]
    kv.free("r1")
    kv.free("r2")
    assert pool.num_free_blocks == 8
    assert pool.ref_counts == [0] * 8
    # tail first: r2's tail (3) then r1's tail (2) went to the empty list; 0 and 1 stay cached
    assert pool.free_block_ids() == [4, 5, 6, 7, 2, 3, 1, 0]


def test_full_prompt_hit_leaves_one_token_to_compute():
    pool = BlockPool(4)
    kv = KvCacheManager(pool, 4, EXTRA)
    r1 = make_request("r1", range(8))
    kv.allocate_slots(r1, 8)
    kv.cache_blocks(r1, 8)
    r2 = make_request("r2", range(8))
    assert kv.find_cached_prefix(r2) == [0]  # block 1 would leave nothing to compute


def test_allocation_failure_changes_nothing():
    pool = BlockPool(2)
    kv = KvCacheManager(pool, 4, EXTRA)
    r = make_request("r", range(12))
    assert not kv.allocate_slots(r, 12)
    assert kv.blocks_of("r") == [] and pool.num_free_blocks == 2
