"""CPU contention in ``tandem plan``'s simulation: workers, the frontend and other processes
share the cores by weight (Linux CFS), no thread faster than one core; threads either
placed on whole cores (``CorePlacement``) or spread over all of them (``share_cores``)."""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Hardware:
    """What the workers run on: ``cores`` shared by all, ``threads`` per worker."""

    cores: float
    threads: int = 1
    prefill_nice: int = 0
    background_cores: float = 0.0  # other processes' CPU
    server_idle_cores: float = 0.0  # the server's own CPU at rest (load polls, Ray), paid at any rate
    # CPU the whole request path spends per streamed token outside the engine steps
    # (gateway, client, Ray, the workers' own threads), the part below included
    frontend_s_per_token: float = 0.0
    # what a served worker's step takes longer per token it emits than the profiled step
    # (its outputs handed to the token feed, its Ray threads holding the GIL meanwhile)
    step_s_per_token: float = 0.0
    # a request's latency through the request path at rest (HTTP, routing, Ray's calls
    # there and back) beyond its CPU: the simulation routes it that much after it was sent
    request_latency_s: float = 0.0
    # CPU the request path spends per worker step that streams tokens, whatever their number
    # (the step's feed item: the worker's actor threads, Ray's stream, the gateway's dispatch)
    frontend_s_per_step: float = 0.0
    # a served worker's engine-step CPU against the profiled step's, for the prompt and the
    # decode part: what sharing the cores with the other workers and the request path costs
    # a step (preemptions, caches refilled); `--validate` measures both
    prefill_step_factor: float = 1.0
    decode_step_factor: float = 1.0
    # a disaggregated or conditional mix on one host: its decode / prefill workers run this
    # many threads while the other pool leaves them its cores (``tandem serve``'s
    # --decode-burst-threads / --prefill-burst-threads), their steps at the profile's burst
    # timings (``Simulation``'s ``bursts``); 0: never
    decode_burst_threads: int = 0
    prefill_burst_threads: int = 0
    # threads placed on whole cores (``CorePlacement``); False, or fractional or unbounded
    # ``cores`` (GPU workers): every busy thread an equal share of all the cores (fluid)
    whole_cores: bool = True

    @property
    def outside_workers_s_per_token(self) -> float:
        """The request path's CPU per token that the workers' steps do not already spend."""
        return max(0.0, self.frontend_s_per_token - self.step_s_per_token)


@dataclass
class Job:
    """A CPU consumer: ``remaining`` seconds of work at full speed, wanting ``threads`` cores."""

    threads: float
    weight: float
    remaining: float = 0.0
    rate: float = 0.0


def share_cores(jobs: Sequence[Job], cores: float) -> None:
    """Set each busy job's ``rate`` (share of full speed): weighted fair sharing of ``cores``,
    no thread above one core (water-filling)."""
    open_ = [j for j in jobs if j.threads > 0]
    for j in jobs:
        j.rate = 0.0
    cap = cores
    while open_:
        total = sum(j.threads * j.weight for j in open_)
        level = cap / total if total > 0 else math.inf
        full = [j for j in open_ if j.weight * level >= 1.0]
        if not full:
            for j in open_:
                j.rate = j.weight * level
            return
        for j in full:
            j.rate = 1.0
            cap -= j.threads
            open_.remove(j)


def nice_weight(nice: int) -> float:
    """Linux CFS: each niceness step is ~1.25x less CPU weight."""
    return 1.25 ** -nice


class CorePlacement:
    """Whole threads on whole cores, placed roughly as Linux's scheduler places them.

    A thread that starts work goes to a core with the fewest threads (ties at random, from
    ``seed``); it stays there while it works, except that when two cores' counts differ by
    two or more a thread moves from the fullest to the emptiest (idle balancing). So three
    busy threads on two cores run as two sharing one core and one alone, not as three at 2/3
    each: the same mean, but whoever shares gets half a core for as long as both work, which
    is what stretches a decode step's tail. Each core is shared by weight among its threads
    and the fluid jobs (the background, the request path), which take the cores
    no placed thread holds first and spread what is left evenly over the others; a job of several threads (one per core)
    runs at its slowest thread's share (its parallel regions end at a barrier).
    """

    def __init__(self, cores: int, seed: int = 0) -> None:
        if cores < 1:
            raise ValueError("whole-core placement needs at least one core")
        self.threads_on: list[list[int]] = [[] for _ in range(cores)]  # per core: id(job) per thread
        self.cores_of: dict[int, list[int]] = {}  # id(job) -> the core of each of its threads
        self.rng = random.Random(seed)

    def share(self, jobs: Sequence[Job], *fluid: Job) -> None:
        """Place ``jobs``' threads (``threads`` rounded up, at most one per core), then set every
        job's ``rate`` and each ``fluid`` job's (``threads``: the cores it wants, not placed: the
        background, or the request path's many short-lived threads, which wake wherever a
        core is free)."""
        n = len(self.threads_on)
        wanted = {id(j): min(n, math.ceil(j.threads - 1e-9)) if j.threads > 0 else 0 for j in jobs}
        for jid, cores in list(self.cores_of.items()):
            while len(cores) > wanted.get(jid, 0):
                self.threads_on[cores.pop()].remove(jid)
            if not cores:
                del self.cores_of[jid]
        for j in jobs:
            have = self.cores_of.setdefault(id(j), [])
            while len(have) < wanted[id(j)]:
                free = [c for c in range(n) if c not in have]
                fewest = min(len(self.threads_on[c]) for c in free)
                c = self.rng.choice([c for c in free if len(self.threads_on[c]) == fewest])
                have.append(c)
                self.threads_on[c].append(id(j))
            if not have:
                del self.cores_of[id(j)]
        self._balance()
        by_id = {id(j): j for j in jobs}
        # fluid work runs on the cores no placed thread holds first (a waking thread takes an
        # idle core), and what they cannot take spreads evenly over the others
        busy = [c for c in range(n) if self.threads_on[c]]
        idle = [Job(f.threads, f.weight) for f in fluid]
        share_cores(idle, n - len(busy))
        rest = [f.threads * (1.0 - i.rate) for f, i in zip(fluid, idle)]  # threads' worth left
        done = [i.rate * f.threads for f, i in zip(fluid, idle)]  # cores' worth got
        shares: dict[int, list[float]] = {}
        for c in busy:
            slices = [Job(1.0, by_id[jid].weight) for jid in self.threads_on[c]]
            spread = [Job(r / len(busy), f.weight) for f, r in zip(fluid, rest)]
            share_cores([*slices, *spread], 1.0)
            for jid, s in zip(self.threads_on[c], slices):
                shares.setdefault(jid, []).append(s.rate)
            for k, part in enumerate(spread):
                done[k] += part.rate * part.threads
        for f, cores in zip(fluid, done):
            f.rate = cores / f.threads if f.threads > 0 else 0.0
        for j in jobs:  # threads beyond the cores run on the same ones: slower by as much
            placed = len(self.cores_of.get(id(j), ()))
            j.rate = min(shares[id(j)]) * placed / j.threads if placed else 0.0

    def _balance(self) -> None:
        while True:
            counts = [len(t) for t in self.threads_on]
            hi, lo = counts.index(max(counts)), counts.index(min(counts))
            if counts[hi] - counts[lo] < 2:
                return
            movable = [jid for jid in self.threads_on[hi] if lo not in self.cores_of[jid]]
            if not movable:
                return
            jid = self.rng.choice(movable)
            self.threads_on[hi].remove(jid)
            self.threads_on[lo].append(jid)
            cores = self.cores_of[jid]
            cores[cores.index(hi)] = lo
