"""Per-sequence block tables on top of the block pool: allocation, prefix hits, release."""

from __future__ import annotations

from tandem.common.block_hash import hash_block
from tandem.engine.kv_cache.block_pool import BlockPool
from tandem.engine.sequence import Sequence


def blocks_needed(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class KVCacheManager:
    """Grows and frees the block tables of sequences; pure Python."""

    def __init__(self, pool: BlockPool, block_size: int) -> None:
        self.pool = pool
        self.block_size = block_size

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    def match_prefix(self, seq: Sequence) -> int:
        """Attach cached blocks for the longest cached prefix of a blockless sequence.

        At least one token is always left to compute (its logits sample the
        next token). Returns the number of tokens served from the cache.
        """
        assert not seq.block_ids and seq.num_computed_tokens == 0
        if not self.pool.enable_prefix_caching:
            return 0
        bs = self.block_size
        tokens = seq.token_ids()
        parent = None
        for i in range((len(tokens) - 1) // bs):
            h = hash_block(parent, tokens[i * bs:(i + 1) * bs])
            block_id = self.pool.lookup(h)
            if block_id is None:
                break
            self.pool.acquire(block_id)
            seq.block_ids.append(block_id)
            seq.block_hashes.append(h)
            parent = h
        seq.num_computed_tokens = len(seq.block_ids) * bs
        return seq.num_computed_tokens

    def can_allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        need = blocks_needed(seq.num_computed_tokens + num_new_tokens, self.block_size)
        return need - len(seq.block_ids) <= self.pool.num_free

    def allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Ensure blocks for ``num_new_tokens`` more tokens; False (nothing taken) if short."""
        need = blocks_needed(seq.num_computed_tokens + num_new_tokens, self.block_size)
        extra = need - len(seq.block_ids)
        if extra <= 0:
            return True
        if extra > self.pool.num_free:
            return False
        seq.block_ids.extend(self.pool.allocate(extra))
        return True

    def reserve(self, seq: Sequence, num_tokens: int) -> bool:
        """Allocate blocks for ``num_tokens`` tokens of a blockless sequence (KV import)."""
        assert not seq.block_ids
        return self.allocate(seq, num_tokens)

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register every block that is now full of computed tokens in the prefix cache."""
        if not self.pool.enable_prefix_caching:
            return
        bs = self.block_size
        num_full = min(seq.num_computed_tokens // bs, len(seq.block_ids))
        if len(seq.block_hashes) >= num_full:
            return
        parent = seq.block_hashes[-1] if seq.block_hashes else None
        for i in range(len(seq.block_hashes), num_full):
            parent = hash_block(parent, seq.token_slice(i * bs, (i + 1) * bs))
            seq.block_hashes.append(parent)
            self.pool.register(seq.block_ids[i], parent)

    def free(self, seq: Sequence) -> None:
        """Release all of a sequence's blocks (tail first) and reset its KV state."""
        self.pool.free(reversed(seq.block_ids))
        seq.block_ids = []
        seq.block_hashes = []
        seq.num_computed_tokens = 0
