"""Reusable staging buffers: one contiguous byte buffer that grows to the largest message."""

from __future__ import annotations

import zlib
from collections.abc import Sequence

import torch


class StagingBuffer:
    """A uint8 buffer reused across transfers (receives never allocate in steady state)."""

    def __init__(self, device: torch.device, initial_bytes: int = 1 << 20) -> None:
        self.device = device
        self._buf = torch.empty(initial_bytes, dtype=torch.uint8, device=device)

    def view(self, num_bytes: int) -> torch.Tensor:
        """The first ``num_bytes`` bytes, growing the buffer if needed."""
        if num_bytes > self._buf.numel():
            self._buf = torch.empty(max(num_bytes, 2 * self._buf.numel()), dtype=torch.uint8,
                                    device=self.device)
        return self._buf[:num_bytes]

    def typed(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A tensor of ``shape``/``dtype`` laid over the buffer's start."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        n = itemsize
        for d in shape:
            n *= d
        return self.view(n).view(dtype).view(shape)


def checksum(data: torch.Tensor) -> int:
    """CRC32 of a tensor's bytes (tests and the optional integrity check)."""
    return zlib.crc32(data.contiguous().view(torch.uint8).cpu().numpy().tobytes())


def to_device(values: bytes | Sequence[int], device: torch.device) -> torch.Tensor:
    """Host bytes (as uint8) or ints (as int64) on ``device``, without a host sync: on CUDA
    the copy goes from pinned memory, queued on the current stream (torch's pinned-memory
    cache keeps the host block until the copy ran)."""
    if isinstance(values, (bytes, bytearray)):
        host = torch.frombuffer(bytearray(values), dtype=torch.uint8)
    else:
        host = torch.as_tensor(list(values), dtype=torch.long)
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)
