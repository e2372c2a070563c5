"""Stream-ordering probe: what CUDA stream semantics the transfer path relies on, observed.

1. An event orders a consumer stream after a producer stream: the consumer
   reads what a slow producer wrote (a sleep kernel, then a fill), never the old
   contents.
2. A side stream torch creates (non-blocking) does not wait for work pending
   on a *blocking* stream (cupy's default kind, the one Ray's NCCL group uses),
   while the legacy default stream does: the hazard behind a decode step that
   hangs on a posted receive. Reported as found; only (1) and the side stream's
   independence are required.
"""

from __future__ import annotations

import time

import torch

from tandem.gpucheck.context import CheckContext
from tandem.gpucheck.report import Result, Status

SLEEP_CYCLES = 200_000_000  # GPU clock cycles: long enough that unordered work overtakes the spin


def check_streams(ctx: CheckContext) -> list[Result]:
    if ctx.device.type != "cuda":
        return [Result("stream ordering probe", Status.SKIP, "needs CUDA streams")]
    return [_event_ordering(ctx), _blocking_stream(ctx)]


def _event_ordering(ctx: CheckContext) -> Result:
    producer, consumer = torch.cuda.Stream(), torch.cuda.Stream()
    data = torch.zeros(1 << 20, device=ctx.device)
    seen = torch.empty_like(data)
    torch.cuda.synchronize()
    with torch.cuda.stream(producer):
        torch.cuda._sleep(SLEEP_CYCLES)
        data.fill_(1.0)
        done = torch.cuda.Event()
        done.record()
    with torch.cuda.stream(consumer):
        consumer.wait_event(done)
        seen.copy_(data)
    torch.cuda.synchronize()
    ok = bool((seen == 1).all())
    return Result("stream order: event", Status.PASS if ok else Status.FAIL,
                  "consumer waited for the producer's event" if ok
                  else "consumer read before the producer wrote", "", "ordered")


def _wait_s(stream: torch.cuda.Stream, x: torch.Tensor) -> float:
    """Seconds until a tiny op on ``x`` enqueued on ``stream`` completes."""
    t0 = time.perf_counter()
    with torch.cuda.stream(stream):
        x.add_(1)
    stream.synchronize()
    return time.perf_counter() - t0


def _blocking_stream(ctx: CheckContext) -> Result:
    try:
        import cupy
    except ImportError:
        return Result("stream order: blocking stream", Status.SKIP, "cupy is not installed")
    torch.cuda.synchronize()
    with cupy.cuda.Device(ctx.device.index or 0):
        blocking = cupy.cuda.Stream(non_blocking=False)
    busy = torch.cuda.ExternalStream(blocking.ptr, device=ctx.device)
    side = torch.cuda.Stream()
    x = torch.zeros(1, device=ctx.device)
    torch.cuda.synchronize()
    waits = {}
    for name, stream in (("side", side), ("default", torch.cuda.default_stream(ctx.device))):
        with torch.cuda.stream(busy):
            torch.cuda._sleep(SLEEP_CYCLES)
        waits[name] = _wait_s(stream, x)
        torch.cuda.synchronize()
    busy_s = max(waits.values())
    side_free = waits["side"] < busy_s / 4
    default_waits = waits["default"] > busy_s / 2
    return Result("stream order: blocking stream", Status.PASS if side_free else Status.FAIL,
                  f"side stream {'independent' if side_free else 'WAITED'}; legacy default "
                  f"stream {'waits' if default_waits else 'does not wait'} for a blocking stream",
                  f"{waits['side'] * 1e3:.1f} / {waits['default'] * 1e3:.1f} ms",
                  "side stream independent")
