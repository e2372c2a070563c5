"""A KV transfer between two processes without Ray: the device check's transfer probe.

    from tandem.transfer.pair_check import check_pair
    result = check_pair("auto", ("cuda:0", "cuda:1"))   # NCCL across two GPUs
    result = check_pair("auto", ("cuda:0", "cuda:0"))   # CUDA IPC on one GPU
    result = check_pair("ipc", ("cpu", "cpu"))          # the plumbing, on CPU

Two processes (``torch.multiprocessing``, spawned) open the two ends with
``endpoint.open_pair_channel``: rank 0 sends (prefill), rank 1 receives (decode).
Both fill a ``PagedKVCache`` source from the same seed, so the receiver checks
every transferred block byte for byte. Each repeat moves all blocks in layer
groups, in place or gathered (alternating); times come from device events.
Spawned processes re-import the caller's main module: call ``check_pair`` under
``if __name__ == "__main__":`` in a script.
"""

from __future__ import annotations

import json
import statistics
import tempfile
from dataclasses import asdict, dataclass

import torch

LAYERS, BLOCK, KV_HEADS, HEAD_DIM = 8, 16, 8, 128  # 32 KiB planes per block in bf16


@dataclass
class PairCheckResult:
    kind: str  # the transport used: nccl or ipc
    num_bytes: int  # per transfer
    seconds: list[float]  # per transfer, first byte to last on the device
    intact: bool  # every block arrived byte for byte
    error: str | None = None

    @property
    def gbps(self) -> float:
        return self.num_bytes / statistics.median(self.seconds) / 1e9 if self.seconds else 0.0


def _cache(device: str, num_blocks: int, dtype: torch.dtype, fill: bool):
    from tandem.engine.kv_cache.paged_cache import PagedKVCache

    cache = PagedKVCache(LAYERS, num_blocks, BLOCK, KV_HEADS, HEAD_DIM, dtype, torch.device(device))
    if fill:
        gen = torch.Generator().manual_seed(1234)
        cache.kv.copy_(torch.randn(cache.kv.shape, generator=gen).to(dtype))
    return cache


def _run_end(rank: int, kind: str, device: str, directory: str, num_blocks: int,
             repeats: int, dtype_name: str, timeout_s: float) -> None:
    from tandem.transfer.endpoint import cache_receiver, cache_sender, open_pair_channel
    from tandem.transfer.rendezvous import FileRendezvous
    from tandem.transfer.sender import SendJob

    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    dtype = getattr(torch, dtype_name)
    meet = FileRendezvous(directory)
    try:
        channel = open_pair_channel(kind, rank, device, directory,
                                    timeout_ms=int(timeout_s * 1000), op_timeout_s=timeout_s)
        used = type(channel).__name__.removesuffix("Channel").lower()
        blocks = list(range(num_blocks))
        groups = [range(i, min(i + 2, LAYERS)) for i in range(0, LAYERS, 2)]
        if rank == 0:
            reports: list = []
            sender = cache_sender(channel, _cache(device, num_blocks, dtype, True), reports.append,
                                  min_run_plane_bytes=1)
            for r in range(repeats):
                meet.get(f"expect-{r}", timeout_s)
                for g, layers in enumerate(groups):
                    sender.submit(SendJob(f"check-{r}", 1, blocks, layers, g, g == len(groups) - 1,
                                          dst_block_ids=blocks if r % 2 == 0 else ()))
                meet.get(f"received-{r}", timeout_s)
            sender.close()
        else:
            dst = _cache(device, num_blocks, dtype, False)
            receiver = cache_receiver(channel, dst, [0])
            seconds, nbytes = [], 0
            for r in range(repeats):
                dst.kv.zero_()
                receiver.expect(f"check-{r}", 0, blocks, groups)
                meet.put(f"expect-{r}", b"1")
                pt = receiver.wait(f"check-{r}", timeout_s)
                receiver.forget(f"check-{r}")
                if pt.status.name != "DONE":
                    raise RuntimeError(f"transfer {r}: {pt.status.name}: {pt.error}")
                seconds.append(pt.seconds)
                nbytes = pt.num_bytes
                meet.put(f"received-{r}", b"1")
            intact = bool(torch.equal(dst.kv.cpu(), _cache("cpu", num_blocks, dtype, True).kv))
            meet.put("result", json.dumps(asdict(PairCheckResult(used, nbytes, seconds,
                                                                  intact))).encode())
        channel.close()
    except Exception as e:  # reported to the caller
        meet.put(f"error-{rank}", f"rank {rank}: {type(e).__name__}: {e}".encode())
        raise


def check_pair(kind: str = "auto", devices: tuple[str, str] = ("cuda:0", "cuda:1"),
               num_blocks: int = 64, repeats: int = 6, dtype: str = "bfloat16",
               timeout_s: float = 60.0) -> PairCheckResult:
    """Run the two ends in two spawned processes; return what the receiver measured."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="tandem-pair-") as directory:
        procs = [ctx.Process(target=_run_end, args=(rank, kind, devices[rank], directory,
                                                     num_blocks, repeats, dtype, timeout_s),
                             daemon=True) for rank in (0, 1)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout_s * (repeats + 2))
        for p in procs:
            if p.is_alive():
                p.kill()
        from tandem.transfer.rendezvous import FileRendezvous

        meet = FileRendezvous(directory)
        errors = [_read(meet, f"error-{r}") for r in (0, 1)]
        result = _read(meet, "result")
        if result is None or any(errors):
            reason = "; ".join(e for e in errors if e) or \
                f"no result (exit codes {[p.exitcode for p in procs]})"
            return PairCheckResult(kind, 0, [], False, reason)
        return PairCheckResult(**json.loads(result))


def _read(meet, key: str) -> str | None:
    try:
        return meet.get(key, 0.0).decode()
    except TimeoutError:
        return None
