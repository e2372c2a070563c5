"""The load generator: sends a run's requests at their arrival offsets, streams them all
concurrently, and returns one record per request (failures included, by kind).

Bounded in count (the requests given) and in time: each request has ``request_timeout_s``
and the whole run ``max_duration_s``; what is still in flight then is cancelled and
recorded as error ``deadline``, and what was not sent yet is recorded as not sent
(``sent: false``, no error: the server never saw it). Nothing is dropped. Besides the client's error
kinds (``tandem.bench.client``), a stream that ends without any token is ``no_tokens``.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from tandem.bench.client import StreamResult, completion_body, stream_completion
from tandem.bench.metrics_math import latencies
from tandem.bench.workload import BenchRequest
from tandem.engine.progress import Bar
from tandem.engine.progress import enabled as terminal_progress


@dataclass
class RunResult:
    records: list[dict[str, Any]]
    duration_s: float  # first send to last completion (or the deadline)
    client_cpu_s: float  # CPU this process spent meanwhile (the client shares the machine)


def make_record(req: BenchRequest, scheduled_s: float, res: StreamResult, t0: float) -> dict[str, Any]:
    """The JSON record of one finished (or failed) request."""
    ok = res.error is None
    rec: dict[str, Any] = {
        "index": req.index, "kind": req.kind, "scheduled_s": scheduled_s, "sent_s": res.send_t - t0,
        "expected_prompt_tokens": req.prompt_len, "expected_output_tokens": req.output_len,
        "prompt_tokens": res.prompt_tokens if res.prompt_tokens is not None else req.prompt_len,
        "output_tokens": (res.completion_tokens if res.completion_tokens is not None
                          else len(res.token_times)),
        "chunks": len(res.token_times),
        "multi_token_chunks": sum(1 for n in res.chunk_tokens if n is not None and n > 1),
        "ok": ok, "sent": True, "status": res.status,
        "error": res.error, "error_detail": res.detail,
    }
    done = res.done_t if res.done_t is not None else time.perf_counter()
    lat = latencies(res.send_t, res.token_times, done, rec["output_tokens"])
    if ok and lat["ttft_s"] is None:  # a stream without a token: nothing to time
        rec.update(ok=False, error="no_tokens", error_detail="the stream carried no token")
    rec.update(lat)
    return rec


def _deadline_record(req: BenchRequest, scheduled_s: float, sent: bool) -> dict[str, Any]:
    return {"index": req.index, "kind": req.kind, "scheduled_s": scheduled_s, "sent_s": None,
            "expected_prompt_tokens": req.prompt_len, "expected_output_tokens": req.output_len,
            "prompt_tokens": None, "output_tokens": 0, "chunks": 0, "multi_token_chunks": 0,
            "ok": False, "sent": sent, "status": None,
            "error": "deadline" if sent else None,
            "error_detail": "in flight at the run deadline" if sent
            else "not sent before the run deadline (--max-duration)",
            "ttft_s": None, "itl_s": [], "tpot_s": None, "e2e_s": None}


class Progress:
    """A run's progress on stderr: a bar on a terminal (``tandem.engine.progress``, below a
    sweep's bar) and its last status line when done; a status line every 10 s otherwise."""

    def __init__(self, label: str, total: int, enabled: bool = True) -> None:
        self.label, self.total, self.enabled = label, total, enabled
        self.sent = self.done = self.errors = 0
        self.t0 = time.monotonic()
        self._tty = terminal_progress()
        self._bar: Bar | None = None
        self._last = 0.0

    def line(self) -> str:
        return (f"[{self.label}] sent {self.sent}/{self.total}  done {self.done}  errors {self.errors}"
                f"  {time.monotonic() - self.t0:5.1f}s")

    def show(self, final: bool = False) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if self._tty:
            if self._bar is None:
                self._bar = Bar(self.total, desc=f"[{self.label}]", unit="req", leave=False)
            self._bar.set_count(self.done)
            self._bar.set_postfix(f"sent {self.sent}, errors {self.errors}")
            if final:
                self._bar.close()
                print(self.line(), file=sys.stderr, flush=True)  # above a sweep's bar, if any
        elif final or now - self._last >= 10:
            print(self.line(), file=sys.stderr, flush=True)
            self._last = now

    async def ticker(self) -> None:
        while True:
            self.show()
            await asyncio.sleep(0.5)


async def run_requests(url: str, model: str, requests: Sequence[BenchRequest], offsets: Sequence[float], *,
                       request_timeout_s: float = 300.0, max_duration_s: float = 600.0,
                       ignore_eos: bool = True, logprobs: int | None = 0, label: str = "run",
                       progress: bool = True, transport: httpx.AsyncBaseTransport | None = None) -> RunResult:
    """Send ``requests[i]`` at ``offsets[i]`` seconds after the start; records in request order.

    ``transport``: an httpx transport to use instead of the network (tests).
    """
    if len(requests) != len(offsets):
        raise ValueError("one arrival offset per request")
    bar = Progress(label, len(requests), progress)
    records: dict[int, dict[str, Any]] = {}
    sent: set[int] = set()
    limits = httpx.Limits(max_connections=len(requests) + 8, max_keepalive_connections=len(requests) + 8)
    timeout = httpx.Timeout(request_timeout_s, connect=min(30.0, request_timeout_s))
    cpu0 = time.process_time()
    async with httpx.AsyncClient(timeout=timeout, limits=limits, transport=transport) as client:
        t0 = time.perf_counter()

        async def one(i: int) -> None:
            req = requests[i]
            await asyncio.sleep(max(0.0, t0 + offsets[i] - time.perf_counter()))
            sent.add(i)
            bar.sent += 1
            body = completion_body(model, req.prompt, req.output_len, ignore_eos, logprobs)
            res = await stream_completion(client, url, body, request_timeout_s)
            records[i] = make_record(req, offsets[i], res, t0)
            bar.done += 1
            bar.errors += res.error is not None

        ticker = asyncio.create_task(bar.ticker())
        tasks = [asyncio.create_task(one(i)) for i in range(len(requests))]
        try:
            _, pending = await asyncio.wait(tasks, timeout=max_duration_s)
            for t in pending:
                t.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        finally:
            for t in tasks:
                t.cancel()
            ticker.cancel()
        end = time.perf_counter()
    for i, req in enumerate(requests):
        if i not in records:
            records[i] = _deadline_record(req, offsets[i], i in sent)
            bar.errors += i in sent
    bar.show(final=True)
    ends = [r["sent_s"] + r["e2e_s"] for r in records.values() if r["e2e_s"] is not None]
    duration = end - t0 if len(ends) < len(requests) else max(ends, default=end - t0)
    return RunResult([records[i] for i in range(len(requests))], duration, time.process_time() - cpu0)
