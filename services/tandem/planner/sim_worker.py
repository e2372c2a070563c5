"""One simulated worker of ``tandem plan``'s simulation (``plan_sim``): its queues, its
continuous batching by the engine's own rule (``tandem.engine.batching``), its step in progress
and its load as the router sees it."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from tandem.planner.cpu_share import Job
from tandem.planner.perf_model import StepModel, attention_pairs
from tandem.engine import batching
from tandem.engine.prefill_rate import PrefillRate
from tandem.router.load import WorkerLoad, blocks_for


@dataclass(frozen=True)
class SimRequest:
    """One request: when it arrives (s), its prompt's token ids and its output length."""

    arrival: float
    prompt: tuple[int, ...]
    output_len: int
    kind: str = ""


@dataclass(frozen=True)
class Engine:
    """Batching limits and KV sizes of every worker (from the profile)."""

    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    block_size: int = 16
    num_blocks: int = 65536
    kv_bytes_per_token: int = 0


@dataclass
class SimSeq:
    """A request as one worker holds it."""

    rid: str
    req: SimRequest
    index: int
    prefill_left: int
    tokens: int = 0  # tokens whose KV this worker holds (prompt computed so far, then outputs)
    out_left: int = 0
    emitted: int = 0  # tokens its worker produced so far
    finished: bool = False  # its worker produced the last one
    decode_worker: SimWorker | None = None  # disaggregated: where its KV goes


class SimWorker:
    """One worker: its queues, its step in progress, its load as the router sees it."""

    def __init__(self, worker_id: str, role: str, engine: Engine, steps: StepModel, job: Job,
                 step_s_per_token: float = 0.0, burst_steps: StepModel | None = None) -> None:
        """``burst_steps``: its steps while it bursts (more threads; ``start_step`` with them)."""
        self.worker_id, self.role, self.engine, self.steps, self.job = worker_id, role, engine, steps, job
        self.step_s_per_token = step_s_per_token
        self.burst_steps = burst_steps
        self.waiting: deque[SimSeq] = deque()
        self.running: list[SimSeq] = []
        self.reserved: dict[str, int] = {}  # rid -> blocks held for KV on its way
        # what callers asked of its engine thread while a step ran: done when the step ends
        self.commands: list[Callable[[], None]] = []
        self.step: tuple[list[SimSeq], list[tuple[SimSeq, int]]] | None = None
        self.num_steps = 0
        self.step_started = 0.0  # simulated time its step in progress started
        self.prefill_rate = PrefillRate()  # as its engine measures it, in simulated seconds
        # its steps' CPU by ``steps`` (each step's time times the threads it ran on; the
        # per-token part left out): prompt and decode parts, as a served engine counts them
        self.prefill_s = self.decode_s = 0.0

    def load(self) -> WorkerLoad:
        e = self.engine
        # a running sequence holds the blocks of its KV so far and, while its step runs, of
        # the tokens that step computes (the engine allocates them when it schedules them)
        computing = {s.rid: 1 for s in self.step[0]} | {s.rid: n for s, n in self.step[1]} if self.step else {}
        used = sum(self.reserved.values()) + sum(blocks_for(max(s.tokens + computing.get(s.rid, 0), 1), e.block_size)
                                                 for s in self.running)
        queued = sum(s.prefill_left for s in self.waiting) + sum(s.prefill_left for s in self.running)
        ids = frozenset([*self.reserved, *(s.rid for s in self.running), *(s.rid for s in self.waiting)])
        return WorkerLoad(self.worker_id, self.role, alive=True, total_blocks=e.num_blocks,
                          free_blocks=max(0, e.num_blocks - used), block_size=e.block_size,
                          running=len(self.running), waiting=len(self.waiting),
                          queued_prefill_tokens=queued, max_num_seqs=e.max_num_seqs, request_ids=ids,
                          prefill_tokens_per_s=self.prefill_rate.tokens_per_s())

    def start_step(self, threads: int = 1, burst: bool = False) -> bool:
        """Schedule a step on ``threads`` as the engine's scheduler would, at ``burst_steps``'
        cost with ``burst``; False when there is nothing to do."""
        budget = batching.StepBudget(self.engine.max_num_batched_tokens, self.engine.max_num_seqs)
        decodes: list[SimSeq] = []
        chunks: list[tuple[SimSeq, int]] = []
        for s in batching.running_order(self.running, lambda s: s.prefill_left or 1):
            if budget.left == 0:
                break
            n = budget.share(s.prefill_left or 1)
            if s.prefill_left == 0:
                decodes.append(s)
            else:
                chunks.append((s, n))
            budget.spend(n)
        while self.waiting and budget.admits(len(self.running)):
            s = self.waiting.popleft()
            self.running.append(s)
            n = budget.share(s.prefill_left)
            chunks.append((s, n))
            budget.spend(n)
        if not decodes and not chunks:
            return False
        self.step = (decodes, chunks)
        model = self.burst_steps if burst and self.burst_steps is not None else self.steps
        prompt, decode = model.parts(sum(n for _, n in chunks),
                                          sum(attention_pairs(n, s.tokens) for s, n in chunks),
                                          len(decodes), sum(s.tokens + 1 for s in decodes))
        self.num_steps += 1
        self.prefill_s += prompt * threads
        self.decode_s += decode * threads
        emitted = len(decodes) + sum(1 for s, n in chunks if n == s.prefill_left)
        self.job.remaining = prompt + decode + self.step_s_per_token * emitted
        return True
