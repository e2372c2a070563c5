"""Pure-Python pool of KV cache blocks: allocation, reference counts, prefix cache.

A block is free when its reference count is zero. Free blocks wait in an LRU
queue; a free block that still holds a registered prefix hash can be revived by
a cache hit until it is handed out again (then its hash is evicted).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable


class NoFreeBlocksError(RuntimeError):
    """Raised when an allocation asks for more blocks than are free."""


class BlockPool:
    """Owns block ids ``0..num_blocks-1``; knows nothing of tensors."""

    def __init__(self, num_blocks: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self._ref_counts = [0] * num_blocks
        self._hash_of: list[bytes | None] = [None] * num_blocks
        self._cached: dict[bytes, int] = {}  # prefix hash -> block id
        self._free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))

    @property
    def num_free(self) -> int:
        """Blocks that can be allocated now (including evictable cached ones)."""
        return len(self._free)

    @property
    def usage(self) -> float:
        return 1.0 - len(self._free) / self.num_blocks

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` free blocks (least recently freed first), all or nothing.

        Returned in ascending id order: blocks freed together come back as
        consecutive runs, which KV transfer can send in place.
        """
        if n > len(self._free):
            raise NoFreeBlocksError(f"asked for {n} blocks, {len(self._free)} free")
        out = []
        for _ in range(n):
            block_id, _ = self._free.popitem(last=False)
            self._evict(block_id)
            self._ref_counts[block_id] = 1
            out.append(block_id)
        out.sort()
        return out

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one reference from each block; blocks reaching zero become free.

        Pass a sequence's blocks in reverse so its tail is evicted before its
        (more shareable) head.
        """
        for block_id in block_ids:
            count = self._ref_counts[block_id]
            if count <= 0:
                raise RuntimeError(f"double free of block {block_id}")
            self._ref_counts[block_id] = count - 1
            if count == 1:
                self._free[block_id] = None

    def lookup(self, block_hash: bytes) -> int | None:
        """The block holding this prefix hash, if cached."""
        if not self.enable_prefix_caching:
            return None
        return self._cached.get(block_hash)

    def acquire(self, block_id: int) -> None:
        """Add a reference to a cached block (reviving it if it was free)."""
        if self._ref_counts[block_id] == 0:
            del self._free[block_id]
        self._ref_counts[block_id] += 1

    def register(self, block_id: int, block_hash: bytes) -> None:
        """Record that a full, in-use block holds the prefix ``block_hash``."""
        if not self.enable_prefix_caching or self._hash_of[block_id] is not None:
            return
        if block_hash in self._cached:
            return  # another block already holds this content
        self._hash_of[block_id] = block_hash
        self._cached[block_hash] = block_id

    def _evict(self, block_id: int) -> None:
        block_hash = self._hash_of[block_id]
        if block_hash is not None:
            self._hash_of[block_id] = None
            del self._cached[block_hash]

    def check_invariants(self) -> None:
        """Assert internal consistency (used by tests)."""
        for b in range(self.num_blocks):
            assert self._ref_counts[b] >= 0
            assert (self._ref_counts[b] == 0) == (b in self._free), b
        for h, b in self._cached.items():
            assert self._hash_of[b] == h
