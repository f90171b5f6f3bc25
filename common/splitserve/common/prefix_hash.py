"""Stable chained hashes of full KV blocks, shared by gateway, prefill and decode.

    hash_i = sha256(hash_{i-1} ‖ token_ids of block i as little-endian uint32 ‖ extra_keys)

The first block's parent is the empty string. `extra_keys` carries the model id and
any cache salt, so two models never share a block. Never Python's hash(): it differs
between processes and every process must agree on these values.
"""

from __future__ import annotations

import hashlib
import struct
import sys
from array import array
from collections.abc import Sequence

_UINT32 = next(code for code in "ILH" if array(code).itemsize == 4)  # 'I' on every platform we run on


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
    start = len(hashes) * block_size
    num_new = max(len(token_ids) - start, 0) // block_size
    if num_new == 0:
        return hashes
    # every new block's ids packed in one call (hash_block's bytes; 2.7x faster than a pack per block on a
    # 2,048-token prompt: this runs on the core thread for every imported or prefilled prompt)
    ids = array(_UINT32, token_ids[start : start + num_new * block_size])
    if sys.byteorder != "little":
        ids.byteswap()
    data, step = memoryview(ids.tobytes()), 4 * block_size
    for offset in range(0, num_new * step, step):
        h = hashlib.sha256(parent)
        h.update(data[offset : offset + step])
        h.update(extra_keys)
        parent = h.digest()
        hashes.append(parent)
    return hashes
