"""``tandem bench migrate``, part 1: the pause a stream sees when its request leaves its
decode worker, moved with its KV against re-driven, per context length.

On a 1P+2D cluster one request at a time runs a prompt of ``context - move_after``
tokens; once its client has ``move_after`` tokens (so the request holds ``context``), it
leaves its decode worker for the other one:

- ``migrate``: ``Cluster.migrate`` (pre-copy with the KV, ``router/migration.py``);
- ``redrive``: the driver's re-drive path. The request's stream from its decode worker
  fails as a lost worker's does (a transient ``WorkerLostError``, raised in the gateway
  by :class:`Redrive`; the worker itself runs on), so ``RequestDriver`` goes on on the
  other decode worker with the prompt plus the tokens so far, prefilled there again.
  A real loss adds the time it takes to be noticed; this arm leaves that out.

The pause is the longest gap between two consecutive deltas the client receives from
the moment the move is asked for to the end of the stream (``step``: the median gap
before it). Both arms run the same prompt, greedy with EOS ignored: their tokens must
be equal (checked). Prefix caching is off, so a re-drive prefills everything again.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import time
import uuid
from contextlib import aclosing
from dataclasses import dataclass, field

from tandem.common.sampling_params import SamplingParams
from tandem.router.driver import WorkerLostError
from tandem.router.migration import HEADROOM_TOKENS, MIGRATED

MIGRATE, REDRIVE = "migrate", "redrive"
ARMS = (MIGRATE, REDRIVE)
WARM_UP_CONTEXT = 256  # the warm-up round's context at most: the paths run, cheaply


@dataclass
class Stream:
    """One client stream: its tokens, each delta's arrival (perf_counter seconds), when the
    move was asked for, and how the move went (``outcome``: ``migrated``, ``redriven``,
    or why not)."""

    tokens: list[int] = field(default_factory=list)
    arrivals: list[float] = field(default_factory=list)
    asked_at: float | None = None
    outcome: str | None = None
    driver_pause_s: float | None = None
    kv_bytes: int = 0

    def gaps(self) -> list[float]:
        """Seconds between consecutive deltas (the first token's wait not counted)."""
        return [b - a for a, b in zip(self.arrivals, self.arrivals[1:])]

    def pause_s(self) -> float | None:
        """The longest gap whose later delta came after the move was asked for."""
        after = [b - a for a, b in zip(self.arrivals, self.arrivals[1:])
                 if self.asked_at is not None and b > self.asked_at]
        return max(after) if after else None

    def step_s(self) -> float | None:
        """The median gap before the move was asked for."""
        before = [b - a for a, b in zip(self.arrivals, self.arrivals[1:])
                  if self.asked_at is None or b <= self.asked_at]
        return statistics.median(before) if before else None


class Redrive:
    """Makes the driver re-drive chosen requests: installed on the cluster's decode
    handles, it ends a request's stream from its worker, after the delta it was cut at,
    with the ``WorkerLostError(transient=True)`` a worker's loss raises there (the worker
    is not marked dead, and runs on). ``remove`` puts the handles back."""

    def __init__(self, handles) -> None:
        self._cut: set[str] = set()
        self._handles = list(handles)
        for h in self._handles:
            h.decode = self._wrap(h, h.decode)

    def cut(self, request_id: str) -> None:
        """Re-drive ``request_id`` when its client asks for its next delta."""
        self._cut.add(request_id)

    def remove(self) -> None:
        for h in self._handles:
            h.__dict__.pop("decode", None)

    def _wrap(self, handle, decode):
        cut = self._cut

        async def wrapped(req):
            async with aclosing(decode(req)) as stream:
                async for delta in stream:
                    yield delta
                    if req.request_id in cut:
                        cut.discard(req.request_id)
                        raise WorkerLostError(handle.worker_id, f"{req.request_id} cut for a "
                                              "re-drive (benchmark)", transient=True)
        return wrapped


async def run_stream(cluster, prompt: list[int], params: SamplingParams, *, arm: str | None,
                     move_after: int, redrive: Redrive | None = None,
                     request_id: str | None = None) -> Stream:
    """Stream one request; once ``move_after`` tokens are in, ``arm`` moves it (None: it
    stays). A move that fails or comes too late is recorded in ``outcome``."""
    rid = request_id or f"{arm or 'stay'}-{uuid.uuid4().hex[:8]}"
    s = Stream()
    fut = None
    redrives = cluster.driver.num_redrives
    async with aclosing(cluster.generate(prompt, params, request_id=rid)) as deltas:
        async for delta in deltas:
            s.arrivals.append(time.perf_counter())
            s.tokens += delta.token_ids
            if arm is not None and s.asked_at is None and len(s.tokens) >= move_after:
                s.asked_at = time.perf_counter()
                if arm == MIGRATE:
                    try:
                        fut = cluster.migrate(rid)
                    except Exception as e:  # noqa: BLE001 - no room elsewhere: reported
                        s.outcome = f"not asked: {e}"
                else:
                    redrive.cut(rid)
    if fut is not None:
        result = await asyncio.wrap_future(fut)
        s.outcome = result.outcome if result.outcome == MIGRATED else f"failed: {result.error}"
        s.driver_pause_s, s.kv_bytes = result.pause_s, result.kv_bytes
    elif arm == REDRIVE:
        s.outcome = "redriven" if cluster.driver.num_redrives > redrives else "not re-driven"
    return s


def prompt_ids(n: int, vocab: int, salt: str) -> list[int]:
    """``n`` token ids drawn from ``salt`` (distinct prompts: no prefix shared)."""
    rng = random.Random(salt)
    return [rng.randrange(3, vocab) for _ in range(n)]


def longest_context(max_model_len: int, capacity_tokens: int, output_len: int,
                    move_after: int, block_size: int) -> int:
    """The longest context a trial can move: the whole request within the model's
    length, and its KV plus a move's headroom within one decode worker's cache."""
    tail = output_len - move_after  # tokens still to come at the move
    by_model = max_model_len - tail - 1
    by_cache = capacity_tokens - HEADROOM_TOKENS - block_size - tail
    return min(by_model, by_cache)


def contexts(spec: str, longest: int, move_after: int) -> list[int]:
    """``auto``: 256, 512, ... below ``longest``, then ``longest``; else the listed ones
    (each more than ``move_after`` and at most ``longest``)."""
    if spec == "auto":
        out, n = [], 256
        while n < longest:
            out.append(n)
            n *= 2
        return out + [longest]
    out = [int(x) for x in spec.split(",") if x.strip()]
    for n in out:
        if not move_after < n <= longest:
            raise ValueError(f"context {n}: must be above --move-after ({move_after}) and at "
                             f"most {longest} (the model's length and one decode worker's cache)")
    return out


async def measure(cluster, lens: list[int], repeats: int, output_len: int, move_after: int,
                  vocab: int, progress=lambda msg: None) -> list[dict]:
    """Per context: ``repeats`` rounds of migrate then re-drive on one prompt per round
    (after one warm-up round at a short context), their medians and equality."""
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    redrive = Redrive(cluster.decode)
    warm = min(min(lens), WARM_UP_CONTEXT)
    try:
        for arm in ARMS:  # warm-up: both paths run once before anything is timed
            await run_stream(cluster, prompt_ids(warm - move_after, vocab, "warm"), params,
                             arm=arm, move_after=move_after, redrive=redrive)
        rows = []
        for n in lens:
            trials: dict[str, list[Stream]] = {a: [] for a in ARMS}
            for r in range(repeats):
                prompt = prompt_ids(n - move_after, vocab, f"{n}-{r}")
                for arm in ARMS:  # interleaved: migrate, re-drive, migrate, re-drive, ...
                    s = await run_stream(cluster, prompt, params, arm=arm,
                                         move_after=move_after, redrive=redrive)
                    trials[arm].append(s)
                    progress(f"context {n} round {r + 1}/{repeats} {arm}: {s.outcome}, pause "
                             f"{_f(_ms(s.pause_s()))} ms")
            rows.append(summarize(n, trials))
        return rows
    finally:
        redrive.remove()


def summarize(context: int, trials: dict[str, list[Stream]]) -> dict:
    """One row: each arm's pauses (only moves that happened), their medians, the median
    of the rounds' ratios, and which rounds' outputs differ."""
    def ok(arm: str, s: Stream) -> bool:
        return s.outcome == (MIGRATED if arm == MIGRATE else "redriven")

    pauses = {a: [s.pause_s() if ok(a, s) else None for s in trials[a]] for a in ARMS}
    med = {a: _median([p for p in pauses[a] if p is not None]) for a in ARMS}
    ratios = [r / m for m, r in zip(pauses[MIGRATE], pauses[REDRIVE]) if m and r]
    mig = trials[MIGRATE]
    return dict(
        context=context, repeats=len(mig),
        step_ms=_ms(_median([s.step_s() for s in mig + trials[REDRIVE] if s.step_s()])),
        migrate=dict(pause_ms=[_ms(p) for p in pauses[MIGRATE]], median_pause_ms=_ms(med[MIGRATE]),
                     driver_pause_ms=[_ms(s.driver_pause_s) for s in mig],
                     kv_mb=_median([s.kv_bytes / 2**20 for s in mig if s.kv_bytes]),
                     outcomes=[s.outcome for s in mig],
                     moved=sum(ok(MIGRATE, s) for s in mig)),
        redrive=dict(pause_ms=[_ms(p) for p in pauses[REDRIVE]],
                     median_pause_ms=_ms(med[REDRIVE]),
                     outcomes=[s.outcome for s in trials[REDRIVE]],
                     redriven=sum(ok(REDRIVE, s) for s in trials[REDRIVE])),
        ratio=_median(ratios),
        mismatches=[r for r, (a, b) in enumerate(zip(mig, trials[REDRIVE]))
                    if a.tokens != b.tokens])


def _median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def _ms(s: float | None) -> float | None:
    return None if s is None else 1e3 * s


def _f(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}"
