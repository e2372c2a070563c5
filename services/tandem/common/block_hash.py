"""Stable content hashes of full KV blocks, shared by the engine's prefix cache and the
router's prefix-aware placement."""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence


def hash_block(parent_hash: bytes | None, token_ids: Sequence[int]) -> bytes:
    """Hash of a full block: its tokens chained to its parent block's hash."""
    h = hashlib.blake2b(digest_size=16)
    h.update(parent_hash or b"root")
    h.update(array("q", token_ids).tobytes())
    return h.digest()


def prefix_hashes(token_ids: Sequence[int], block_size: int) -> list[bytes]:
    """Chained hashes of every full block of ``token_ids``."""
    out: list[bytes] = []
    parent = None
    for i in range(len(token_ids) // block_size):
        parent = hash_block(parent, token_ids[i * block_size:(i + 1) * block_size])
        out.append(parent)
    return out
