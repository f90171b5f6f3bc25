"""Stable chained hashes of full KV blocks, shared by gateway, prefill and decode.

    hash_i = sha256(hash_{i-1} ‖ token_ids of block i as little-endian uint32 ‖ extra_keys)

The first block's parent is the empty string. `extra_keys` carries the model id and
any cache salt, so two models never share a block. Never Python's hash(): it differs
between processes and every process must agree on these values.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence


def extra_keys_for(model_id: str, cache_salt: str = "") -> bytes:
    """The bytes mixed into every block hash of one model (and salt)."""
    return f"model={model_id}\x00salt={cache_salt}".encode()


def hash_block(parent: bytes, token_ids: Sequence[int], extra_keys: bytes) -> bytes:
    """Hash of one full block given its parent's hash."""
    h = hashlib.sha256(parent)
    h.update(struct.pack(f"<{len(token_ids)}I", *token_ids))
    h.update(extra_keys)
    return h.digest()


def hash_full_blocks(
    token_ids: Sequence[int], block_size: int, extra_keys: bytes, parent_hashes: Sequence[bytes] = ()
) -> list[bytes]:
    """Chained hashes of every full block of token_ids.

    `parent_hashes` are hashes already computed for the leading blocks (reused, not
    recomputed), so extending a request's hashes after each step costs only its new blocks.
    """
    hashes = list(parent_hashes)
    parent = hashes[-1] if hashes else b""
    for start in range(len(hashes) * block_size, len(token_ids) - block_size + 1, block_size):
        parent = hash_block(parent, token_ids[start : start + block_size], extra_keys)
        hashes.append(parent)
    return hashes
