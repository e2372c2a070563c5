"""A bounded LRU set of block hashes: what the router believes one worker has cached."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


class PrefixIndex:
    """Block hashes of prompts the router sent to one worker, oldest evicted first.

    It is a guess (the worker's own cache may evict earlier), which is fine
    for ranking: a wrong guess costs only a missed cache hit.
    """

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._hashes: OrderedDict[bytes, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._hashes)

    def hits(self, hashes: Sequence[bytes]) -> int:
        """How many leading blocks of a prompt (its chained ``hashes``) are held."""
        n = 0
        for h in hashes:
            if h not in self._hashes:
                break
            n += 1
        return n

    def insert(self, hashes: Sequence[bytes]) -> None:
        """Remember a prompt's blocks as most recently used, evicting the oldest.

        Inserted leaf first, so a prompt's leading blocks are the freshest and
        eviction trims prefixes from their tails (a leading-block count stays
        meaningful).
        """
        for h in reversed(hashes):
            self._hashes[h] = None
            self._hashes.move_to_end(h)
        while len(self._hashes) > self.capacity:
            self._hashes.popitem(last=False)
