"""One engine in a Ray actor, configured as a worker of the cluster, timing its steps
(``tandem profile``'s grids)."""

from __future__ import annotations

import os
import time
from typing import Any

from services.bench.perf_model import attention_pairs
from services.common.config import EngineConfig


class StepTimer:
    """One engine configured as a worker of the cluster (its threads, niceness and CPU
    weight layout) that times its own steps; ``tandem profile`` runs it as a Ray actor."""

    def __init__(self, model: str, threads: int, niceness: int, device: str = "cpu", kv_cache_gb: float = 0.25,
                 layout: str = EngineConfig.cpu_weight_layout, seed: int = 0) -> None:
        import numpy as np
        import torch

        from services.common.config import CacheConfig
        from services.engine import heap
        from services.engine.engine import LLMEngine  # torch: loaded in the actor only

        if niceness:
            os.nice(niceness)
        os.environ["OMP_NUM_THREADS"] = str(threads)  # as EngineWorker does
        torch.set_num_threads(threads)
        self.config = EngineConfig(model=model, num_threads=threads, device=device, cpu_weight_layout=layout,
                                   cache=CacheConfig(memory_gb=kv_cache_gb, enable_prefix_caching=False))
        self.engine = LLMEngine(self.config)
        self.rng = np.random.default_rng(seed)
        self.n = 0
        if heap.in_actor_process():  # as a worker actor freezes its heap (EngineWorker)
            heap.freeze()

    def pid(self) -> int:
        return os.getpid()

    def limits(self) -> dict[str, Any]:
        e, mc = self.engine, self.engine.model_config
        return {"max_num_batched_tokens": e.config.scheduler.max_num_batched_tokens,
                "max_num_seqs": e.config.scheduler.max_num_seqs,
                "block_size": e.config.cache.block_size, "num_blocks": e.block_pool.num_blocks,
                "kv_bytes_per_token": e.kv_cache.bytes_per_block(
                    mc.num_layers, 1, mc.num_kv_heads, mc.head_dim, e.dtype),
                "dtype": str(e.dtype).removeprefix("torch."), "device": str(e.device),
                "gpu": __import__("torch").cuda.get_device_name(e.device) if e.device.type == "cuda" else None,
                "max_model_len": e.max_model_len,
                "model": {"path": e.model_path, "architecture": mc.architecture, "layers": mc.num_layers,
                          "hidden_size": mc.hidden_size, "kv_heads": mc.num_kv_heads, "head_dim": mc.head_dim,
                          "vocab_size": mc.vocab_size}}

    def _add(self, length: int, max_tokens: int) -> str:
        from services.common.sampling_params import SamplingParams

        self.n += 1
        rid = f"p{self.n}"
        ids = self.rng.integers(16, 1000, size=length).tolist()
        self.engine.add_request(rid, ids, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
        return rid

    def _timed_step(self) -> float:
        t0 = time.perf_counter()
        self.engine.step()
        return time.perf_counter() - t0

    def _drain(self) -> None:
        for seq in list(self.engine.scheduler.seqs):
            self.engine.abort(seq)

    def prefill(self, tokens: list[int], batches: list[tuple[int, int]], repeats: int) -> list[dict]:
        """One timed step per point: the whole prompt(s) in one step, then finished."""
        budget = self.engine.config.scheduler.max_num_batched_tokens
        if max([*tokens, *(b * n for b, n in batches)]) > budget:
            raise ValueError(f"a timed prefill step holds at most max_num_batched_tokens={budget} tokens")
        self._add(64, 1), self._timed_step()  # warm-up
        self._add(512, 1), self._timed_step()
        out = []
        for _ in range(repeats):
            for n in tokens:
                self._add(n, 1)
                out.append({"tokens": n, "seqs": 1, "pairs": attention_pairs(n), "seconds": self._timed_step()})
            for b, n in batches:
                for _ in range(b):
                    self._add(n, 1)
                out.append({"tokens": b * n, "seqs": b, "pairs": b * attention_pairs(n),
                            "seconds": self._timed_step()})
        self._drain()
        return out

    def decode(self, setups: list[tuple[int, int]], mixed_setups: list[tuple[int, int, tuple[int, ...]]],
               repeats: int) -> tuple[list[dict], list[dict]]:
        """Decode steps of each (batch, prompt length); mixed steps where ``mixed_setups`` says."""
        mixed = {(b, n): sizes for b, n, sizes in mixed_setups}
        sched = self.engine.scheduler
        points, mixed_points = [], []
        for b, length in setups:
            extra = len(mixed.get((b, length), ()))
            for _ in range(b):
                self._add(length, 4 + repeats + extra + 2)
            while not (len(sched.running) == b and all(s.num_uncomputed_tokens == 1 for s in sched.running)):
                self.engine.step()
            self.engine.step()  # one untimed decode step
            for _ in range(repeats):
                ctx = sum(s.num_tokens for s in sched.running)
                points.append({"batch": b, "context": ctx, "seconds": self._timed_step()})
            for n in mixed.get((b, length), ()):
                ctx = sum(s.num_tokens for s in sched.running)
                self._add(n, 1)
                mixed_points.append({"batch": b, "context": ctx, "prefill_tokens": n,
                                     "seconds": self._timed_step()})
            self._drain()
        return points, mixed_points
