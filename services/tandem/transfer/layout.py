"""Zero-copy layout of a layer group: runs of blocks consecutive on both sides.

Where a request's blocks are consecutive in the prefill cache and in the decode
cache alike, each (layer, K|V) plane of a run is one contiguous range of both
caches and can be sent from and received into the caches in place, skipping the
gather and scatter copies. Few, large runs pay off; many small ones cost more
in per-message latency than the copies they save, and are gathered instead.
"""

from __future__ import annotations

from collections.abc import Sequence

from tandem.common.config import KV_IN_PLACE_MIN_BYTES as MIN_RUN_PLANE_BYTES

MAX_SEGMENTS = 16  # runs per layer group (each run is 2 x layers messages)


def common_runs(src: Sequence[int], dst: Sequence[int]) -> list[int]:
    """Lengths of the maximal runs over which both block-id lists go up by one."""
    if len(src) != len(dst):
        raise ValueError(f"{len(src)} source blocks but {len(dst)} destination blocks")
    runs: list[int] = []
    for i in range(len(src)):
        if i and src[i] == src[i - 1] + 1 and dst[i] == dst[i - 1] + 1:
            runs[-1] += 1
        else:
            runs.append(1)
    return runs


def zero_copy_segments(src: Sequence[int], dst: Sequence[int], plane_block_bytes: int,
                       min_run_plane_bytes: int = MIN_RUN_PLANE_BYTES) -> tuple[int, ...]:
    """The runs to send in place, or ``()`` where one gathered payload is cheaper
    (runs whose mean plane is under ``min_run_plane_bytes``, or too many runs)."""
    runs = common_runs(src, dst)
    if not runs or len(runs) > MAX_SEGMENTS:
        return ()
    if len(src) * plane_block_bytes < min_run_plane_bytes * len(runs):
        return ()
    return tuple(runs)


def runs_fit(block_ids: Sequence[int], segments: Sequence[int]) -> bool:
    """Whether ``segments`` cover ``block_ids`` exactly, each run consecutive ids."""
    if sum(segments) != len(block_ids):
        return False
    start = 0
    for n in segments:
        first = block_ids[start]
        if list(block_ids[start:start + n]) != list(range(first, first + n)):
            return False
        start += n
    return True


def messages(num_bytes: int, segments: Sequence[int],
             plane_block_bytes: int) -> list[tuple[int, int, int, int]]:
    """``(layer offset, kv, first index, blocks)`` per message of a zero-copy payload,
    in wire order; derived from the header alone, so a receiver can also drain one.

    Raises ``ValueError`` when ``num_bytes`` is not whole planes of the runs.
    """
    per_layer = 2 * sum(segments) * plane_block_bytes
    if per_layer == 0 or num_bytes % per_layer:
        raise ValueError(f"{num_bytes} bytes are not whole layers of runs {tuple(segments)}")
    out = []
    for layer in range(num_bytes // per_layer):
        for kv in (0, 1):
            start = 0
            for n in segments:
                out.append((layer, kv, start, n))
                start += n
    return out
