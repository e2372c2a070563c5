"""A discrete-event simulation of a tandem cluster serving one request sequence.

What it models, and from where:
- routing: the real ``tandem.router.Router`` (decode worker first by free KV blocks and
  batch occupancy, then the prefill worker with the smallest prefill backlog; admission
  bounds), fed with each simulated worker's exact load;
- each worker's continuous batching (``sim_worker``) as ``tandem.engine.scheduler`` does
  it: per step a token budget, decodes first, then in-progress prompt chunks, then waiting
  prompts in arrival order (chunked prefill), at most ``max_num_seqs`` running;
- step times from the profile's fitted models (``tandem.planner.perf_model``), their
  prompt and decode parts ``prefill_step_factor`` and ``decode_step_factor`` times the
  profiled cost (a served step's CPU against the profiled step's: preemptions, caches
  shared with the other workers and the request path), each longer by
  ``step_s_per_token`` per token it emits (what a served worker does on its step path
  that the profiled engine alone does not);
- disaggregated: the prompt goes to its prefill worker once the decode worker reserved its
  blocks, which its engine thread does between steps (a busy decode worker delays every
  prompt by what is left of its current step); token #1 at the end of the prefill step
  that completes the prompt (the gateway streams it at once), the KV reaches the decode
  worker after the profiled transfer time of its bytes, which then decodes tokens 2..n;
  conditional: the same, but the prompts the router keeps local (shorter than its
  threshold, or every prefill worker saturated) prefill on the decode worker, chunked
  into its steps at the cost of ``local_prefill`` (prompts on its weight layout);
  colocated: one worker does all of it;
- bursts (a disaggregated or conditional mix on one host, ``Hardware``'s burst threads): a
  decode worker's step starts with its burst threads, at the ``bursts`` step costs, while
  no remote prefill is pending for it (no blocks reserved for KV on its way), a prefill
  worker's while no decode worker holds a request but those being prefilled, as
  ``tandem.worker.threads`` decides it between steps;
- CPU contention: every busy worker wants ``threads`` cores, a frontend (gateway, load
  generator) wants one core while it has tokens to pass on, a background wants
  ``background_cores`` plus the server's own CPU at rest (``server_idle_cores``); each
  busy worker thread sits on one core as Linux places it (``cpu_share.CorePlacement``:
  three threads on two cores run as two sharing one and one alone), while the frontend and
  the background, many short-lived threads, run on the cores no worker holds first and
  spread what they cannot get there over the others; with
  ``whole_cores`` off, all share all the cores (processor sharing); a core is shared by
  weight (Linux CFS: nice ``n`` weighs ``1.25**-n``), re-divided at each event;
- the request path: the frontend passes each step's tokens on in order, at its CPU cost
  per feed item and per token and its share of the cores (a token reaches the client when
  it is through); a worker's steps that wait behind the item in progress join into one
  feed item, as its token feed batches them; every request reaches its worker
  ``request_latency_s`` after it was sent
  (the path's latency at rest: HTTP, routing, Ray's calls). Its CPU stands for the whole
  path outside the engine steps (gateway, load generator, Ray's calls and streams, KV
  send/receive threads).

Not modelled: preemption (KV blocks are assumed to suffice), prefix-cache hits, the
network between gateway and workers, the request path's per-request and per-prompt-token
CPU (folded into the per-token one), scheduling delays of the path's threads beyond
their CPU share (under load its latency grows past its latency at rest, so measured TTFT
runs above the simulated one on oversubscribed cores; services/RESULTS.md), threads
waiting for each other's GIL.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from tandem.planner.cpu_share import CorePlacement, Hardware, Job, nice_weight, share_cores
from tandem.planner.mix import Mix
from tandem.planner.perf_model import PrefillModel, StepModel, TransferModel
from tandem.planner.sim_worker import Engine, SimRequest, SimSeq, SimWorker
from tandem.router.config import RouterConfig
from tandem.router.errors import ClusterFullError, PromptTooLargeError
from tandem.router.router import Router
from tandem.router.load import BOTH, DECODE, PREFILL, blocks_for

EPS = 1e-12


@dataclass
class SimResult:
    """One record per request, in the shape ``tandem.bench.metrics_math`` scores, and per
    worker role the engine steps run and their CPU: (steps, prompt part s, decode part s), each
    step's time times the threads it ran on."""

    records: list[dict[str, Any]]
    duration_s: float
    engine: dict[str, tuple[int, float, float]] = field(default_factory=dict)


class Simulation:
    """The workers of ``mix`` serving ``requests``; ``run()`` returns one record per request.
    A conditional mix's decode workers prefill the prompts the router keeps local at
    ``local_prefill``'s cost (the profiled prompt steps on their layout; ``steps``' when None).
    ``bursts``: the prefill and the decode workers' steps with their burst threads (the
    decode workers' prompts at their own layout's cost), for ``hardware``'s burst counts."""

    def __init__(self, requests: Sequence[SimRequest], *, mix: Mix, steps: StepModel,
                 transfer: TransferModel | None, engine: Engine, hardware: Hardware,
                 router: RouterConfig | None = None, local_prefill: PrefillModel | None = None,
                 bursts: tuple[StepModel, StepModel] | None = None) -> None:
        if mix.decode < 1 or (not mix.colocated and mix.prefill < 1):
            raise ValueError("a mix needs at least one decode worker, and one prefill worker when disaggregated")
        if not mix.colocated and transfer is None:
            raise ValueError("a disaggregated mix needs the profile's KV transfer model")
        self.requests = list(requests)
        steps = steps.served(hardware.prefill_step_factor, hardware.decode_step_factor)
        decode_steps = steps
        if mix.conditional and local_prefill is not None:
            decode_steps = dataclasses.replace(steps, prefill=local_prefill.scaled(hardware.prefill_step_factor))
        self.steps, self.transfer, self.engine, self.hw = steps, transfer, engine, hardware
        cfg = router or RouterConfig()
        self.router = Router(dataclasses.replace(cfg, mode=mix.mode, block_size=engine.block_size))
        self.workers: dict[str, SimWorker] = {}
        pw = nice_weight(hardware.prefill_nice)
        served = [b.served(hardware.prefill_step_factor, hardware.decode_step_factor) for b in bursts or ()]
        burst_prefill, burst_decode = served or (None, None)
        for i in range(0 if mix.colocated else mix.prefill):
            self._add(SimWorker(f"prefill-{i}", PREFILL, engine, steps, Job(0, pw), hardware.step_s_per_token,
                                burst_prefill if hardware.prefill_burst_threads else None))
        for i in range(mix.decode):
            self._add(SimWorker(f"decode-{i}", BOTH if mix.colocated else DECODE, engine, decode_steps,
                                Job(0, 1.0), hardware.step_s_per_token,
                                burst_decode if hardware.decode_burst_threads and not mix.colocated else None))
        self.frontend = Job(0, 1.0)
        # tokens on their way to the client, one feed item per worker step, or per run of
        # its steps while the path is behind: [CPU seconds left, seqs, worker id]
        self.deliveries: deque[list] = deque()
        self.background = Job(hardware.background_cores + hardware.server_idle_cores, 1.0, math.inf)
        whole = hardware.whole_cores and float(hardware.cores).is_integer()
        self.placement = CorePlacement(int(hardware.cores)) if whole else None
        self.now = 0.0
        self._events: list[tuple[float, int, str, Any]] = []
        self._n = 0
        self.records: list[dict[str, Any] | None] = [None] * len(self.requests)
        self.token_times: dict[int, list[float]] = {}

    def _threads(self, w: SimWorker) -> int:
        """The threads ``w``'s next step starts with: its burst threads while the other pool
        leaves it the cores (see the module docstring), else ``Hardware.threads``."""
        if w.burst_steps is None:
            return self.hw.threads
        if w.role == DECODE:
            return self.hw.decode_burst_threads if not w.reserved else self.hw.threads
        decodes = [d for d in self.workers.values() if d.role == DECODE]
        idle = all(not d.running and not d.waiting for d in decodes)
        return self.hw.prefill_burst_threads if idle else self.hw.threads

    def _add(self, w: SimWorker) -> None:
        self.workers[w.worker_id] = w
        self.router.add_worker(w)

    def _push(self, t: float, kind: str, payload: Any) -> None:
        self._n += 1
        heapq.heappush(self._events, (t, self._n, kind, payload))

    # -- events ---------------------------------------------------------------------
    def _route(self, i: int) -> None:
        req = self.requests[i]
        rid = f"r{i}"
        try:
            d = self.router.route(rid, req.prompt, req.output_len)
        except (ClusterFullError, PromptTooLargeError) as e:
            self._fail(i, "rejected", str(e))
            return
        seq = SimSeq(rid, req, i, len(req.prompt), out_left=req.output_len)
        dec = self.workers[d.decode.worker_id]
        if d.prefill is None:
            dec.waiting.append(seq)
            return
        dec.reserved[rid] = blocks_for(len(req.prompt) + 1, self.engine.block_size)
        seq.decode_worker = dec
        # the blocks are reserved on the decode worker's engine thread, between its steps;
        # only then is the prompt sent to the prefill worker
        prefill = self.workers[d.prefill.worker_id]
        if dec.step is None:
            prefill.waiting.append(seq)
        else:
            dec.commands.append(lambda: prefill.waiting.append(seq))

    def _kv_arrived(self, seq: SimSeq) -> None:
        dec = seq.decode_worker
        assert dec is not None
        dec.reserved.pop(seq.rid, None)
        seq.prefill_left, seq.tokens = 0, len(seq.req.prompt)
        dec.running.append(seq)

    def _send(self, w: SimWorker, seqs: list[SimSeq]) -> None:
        """One step's tokens enter the request path (FIFO, at the frontend's CPU share). A
        worker's token feed takes every output pending since its last item as one item
        (``tandem.decode.feed``): while an item of the same worker still waits behind
        the one in progress, the step's tokens join it, at their per-token cost only."""
        if not seqs:
            return
        per_token = self.hw.outside_workers_s_per_token * len(seqs)
        for item in reversed(self.deliveries):
            if item is self.deliveries[0]:
                break  # in progress: the path already took it
            if item[2] == w.worker_id:
                item[0] += per_token
                item[1].extend(seqs)
                return
        work = self.hw.frontend_s_per_step + per_token
        if work <= EPS and not self.deliveries:
            self._deliver(seqs)
            return
        self.deliveries.append([work, list(seqs), w.worker_id])

    def _deliver(self, seqs: list[SimSeq]) -> None:
        for s in seqs:
            times = self.token_times.setdefault(s.index, [])
            times.append(self.now)
            if s.finished and len(times) == s.emitted:
                self._record(s)

    def _finish_step(self, w: SimWorker) -> None:
        decodes, chunks = w.step  # type: ignore[misc]
        w.step = None
        w.prefill_rate.observe(sum(n for _, n in chunks), self.now - w.step_started)
        for command in w.commands:
            command()
        w.commands.clear()
        out: list[SimSeq] = []  # the seqs that produced a token this step
        for s in decodes:
            s.tokens += 1
            self._emit(s, out)
            if s.out_left == 0:
                w.running.remove(s)
                self._done(s)
        for s, n in chunks:
            s.prefill_left -= n
            s.tokens += n
            if s.prefill_left:
                continue
            self._emit(s, out)
            self.router.prefill_done(s.rid)
            if w.role == PREFILL:
                w.running.remove(s)
                if s.out_left == 0:  # the first token ends it: finished at the prefill worker
                    s.decode_worker.reserved.pop(s.rid, None)  # type: ignore[union-attr]
                    self._done(s)
                else:
                    nbytes = len(s.req.prompt) * self.engine.kv_bytes_per_token
                    self._push(self.now + self.transfer(nbytes), "kv", s)  # type: ignore[misc]
            elif s.out_left == 0:
                w.running.remove(s)
                self._done(s)
        self._send(w, out)

    @staticmethod
    def _emit(s: SimSeq, out: list[SimSeq]) -> None:
        s.out_left -= 1
        s.emitted += 1
        out.append(s)

    def _done(self, s: SimSeq) -> None:
        """Its worker produced the last token (the client has it once the request path delivers it)."""
        self.router.complete(s.rid)
        s.finished = True

    def _record(self, s: SimSeq) -> None:
        times = self.token_times.pop(s.index)
        out = len(times)
        ttft, e2e = times[0] - s.req.arrival, times[-1] - s.req.arrival
        self.records[s.index] = {
            "index": s.index, "kind": s.req.kind, "ok": True, "sent": True, "error": None,
            "prompt_tokens": len(s.req.prompt), "output_tokens": out, "expected_output_tokens": s.req.output_len,
            "ttft_s": ttft, "e2e_s": e2e, "tpot_s": (e2e - ttft) / (out - 1) if out > 1 else None,
            "itl_s": [b - a for a, b in zip(times, times[1:])]}

    def _fail(self, i: int, error: str, detail: str) -> None:
        self.records[i] = {"index": i, "kind": self.requests[i].kind, "ok": False, "sent": True, "error": error,
                           "error_detail": detail, "prompt_tokens": len(self.requests[i].prompt),
                           "output_tokens": 0, "ttft_s": None, "e2e_s": None, "tpot_s": None, "itl_s": []}

    # -- the loop -------------------------------------------------------------------
    def run(self, max_time_s: float = math.inf) -> SimResult:
        """Simulate until every request finished (or ``max_time_s``: the rest fail as ``deadline``)."""
        for i, r in enumerate(self.requests):
            self._push(r.arrival + self.hw.request_latency_s, "route", i)
        jobs = [w.job for w in self.workers.values()]
        all_jobs = [*jobs, self.frontend, self.background]
        while True:
            if not (self._events and self._events[0][0] <= self.now):  # simultaneous arrivals share a step
                for w in self.workers.values():
                    if w.step is not None:
                        continue
                    threads = self._threads(w)
                    if w.start_step(threads, burst=threads != self.hw.threads):
                        w.job.threads = threads
                        w.step_started = self.now
            self.frontend.threads = 1.0 if self.deliveries else 0.0
            if self.placement is not None:
                self.placement.share(jobs, self.background, self.frontend)
            else:
                share_cores(all_jobs, self.hw.cores)
            busy = [w for w in self.workers.values() if w.step is not None]
            t_step, first = math.inf, None
            for w in busy:
                if w.job.rate <= 0:
                    continue
                t = self.now + w.job.remaining / w.job.rate
                if t < t_step:
                    t_step, first = t, w
            t_event = self._events[0][0] if self._events else math.inf
            if self.frontend.threads and self.frontend.rate > 0:
                t_front = self.now + max(0.0, self.deliveries[0][0]) / self.frontend.rate
            else:
                t_front = math.inf
            t_next = min(t_step, t_event, t_front)
            if t_next == math.inf or t_next > max_time_s:
                break
            dt = t_next - self.now
            for w in busy:
                w.job.remaining -= dt * w.job.rate
            if self.frontend.threads:
                self.deliveries[0][0] -= dt * self.frontend.rate
            self.now = t_next
            if t_front == t_next:
                self._deliver(self.deliveries.popleft()[1])
            elif t_step == t_next and first is not None:
                first.job.remaining = 0.0
                first.job.threads = 0
                self._finish_step(first)
            elif t_event == t_next:
                _, _, kind, payload = heapq.heappop(self._events)
                if kind == "route":
                    self._route(payload)
                else:
                    self._kv_arrived(payload)
        for i, rec in enumerate(self.records):
            if rec is None:
                self._fail(i, "deadline", "still in flight when the simulation stopped")
        start = min((r.arrival for r in self.requests), default=0.0)
        engine: dict[str, tuple[int, float, float]] = {}
        for w in self.workers.values():
            steps, prompt, decode = engine.get(w.role, (0, 0.0, 0.0))
            engine[w.role] = (steps + w.num_steps, prompt + w.prefill_s, decode + w.decode_s)
        return SimResult(self.records, self.now - start, engine)  # type: ignore[arg-type]
