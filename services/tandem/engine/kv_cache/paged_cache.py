"""Tensor storage of the paged KV cache and the gather/scatter hooks used by KV transfer."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tandem.engine import huge_pages


class PagedKVCache:
    """All layers' K and V in one tensor ``[L, 2, num_blocks, block_size, KVH, D]``.

    Block ``b`` of layer ``l`` is ``kv[l, :, b]``; a layer range of a set of
    blocks gathers into one contiguous tensor, which is what the transfer
    backends send.
    """

    LAYOUT_VERSION = 1

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device) -> None:
        self.num_layers, self.num_blocks, self.block_size = num_layers, num_blocks, block_size
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        self.dtype, self.device = dtype, device
        shape = (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim)
        # on CPU, huge pages: decode attention reads blocks all over it
        self.kv = huge_pages.zeros(shape, dtype) if torch.device(device).type == "cpu" \
            else torch.zeros(shape, dtype=dtype, device=device)

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                        dtype: torch.dtype) -> int:
        itemsize = torch.empty((), dtype=dtype).element_size()
        return num_layers * 2 * block_size * num_kv_heads * head_dim * itemsize

    def block_shape(self, num_blocks: int, layers: range) -> tuple[int, ...]:
        """Shape of ``gather(block_ids, layers)`` for ``num_blocks`` blocks."""
        return (len(layers), 2, num_blocks, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def plane_block_bytes(self) -> int:
        """Bytes of one block in one (layer, K|V) plane."""
        return self.block_size * self.num_kv_heads * self.head_dim * self.kv.element_size()

    def plane(self, layer: int, kv: int, first_block: int, num_blocks: int) -> torch.Tensor:
        """Blocks ``first_block ..+num_blocks`` of one (layer, K|V) plane as a uint8 view
        of the cache itself (contiguous): zero-copy transfer sends and receives these."""
        return self.kv[layer, kv, first_block:first_block + num_blocks].reshape(-1).view(torch.uint8)

    def gather(self, block_ids: Sequence[int], layers: range,
               out: torch.Tensor | None = None) -> torch.Tensor:
        """Copy blocks of a layer range into one contiguous ``[L, 2, n, bs, KVH, D]`` tensor."""
        index = torch.as_tensor(block_ids, dtype=torch.long, device=self.device)
        src = self.kv[layers.start:layers.stop]
        if out is None:
            return src.index_select(2, index)
        torch.index_select(src, 2, index, out=out)
        return out

    def scatter(self, block_ids: Sequence[int], layers: range, data: torch.Tensor) -> None:
        """Write ``data [L, 2, n, bs, KVH, D]`` (from ``gather``) into the given blocks."""
        index = torch.as_tensor(block_ids, dtype=torch.long, device=self.device)
        self.kv[layers.start:layers.stop].index_copy_(2, index, data.to(self.dtype))
