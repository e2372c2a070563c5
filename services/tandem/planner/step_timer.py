"""One engine in a Ray actor, configured as a worker of the cluster, timing its steps
(``tandem profile``'s grids)."""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any

from tandem.planner.perf_model import attention_pairs
from tandem.common.config import EngineConfig


PREFILL_WARMUPS = (64, 512)  # prompt lengths of the prefill grid's untimed steps


def ramp_steps(batch: int, length: int, budget: int) -> int:
    """Steps until a decode setup's ``batch`` prompts of ``length`` tokens are all computed
    (chunked by the token budget, which the first ones' decodes share), at most."""
    return -(-batch * (length + 1) // budget) + 1


def decode_max_tokens(ramp: int, repeats: int, mixed_steps: int) -> int:
    """Tokens each sequence of a decode setup may generate: one a step while the others'
    prompts are computed (``ramp``), the untimed, timed and mixed steps, and a margin: none
    finishes before the setup is done."""
    return ramp + 1 + repeats + mixed_steps + 2


def grid_blocks(prefill_tokens: list[int], prefill_batches: list[tuple[int, int]],
                decode_setups: list[tuple[int, int]], mixed_setups: list[tuple[int, int, tuple[int, ...]]],
                repeats: int, block_size: int, budget: int) -> int:
    """KV blocks the grids hold at once at most (their largest step: a decode setup's
    sequences at their longest, every mixed prompt beside them): what a ``StepTimer``'s
    cache needs."""
    from tandem.engine.kv_cache.kv_manager import blocks_needed

    mixed = {(b, n): sizes for b, n, sizes in mixed_setups}
    prompts = [b * blocks_needed(n + 1, block_size) for b, n in [*((1, n) for n in prefill_tokens),
                                                                 *prefill_batches]]
    if prompts:  # the prefill grid's warm-ups too
        prompts += [blocks_needed(n + 1, block_size) for n in PREFILL_WARMUPS]
    decodes = [b * blocks_needed(n + decode_max_tokens(ramp_steps(b, n, budget), repeats,
                                                       len(mixed.get((b, n), ()))), block_size)
               + sum(blocks_needed(m + 1, block_size) for m in mixed.get((b, n), ()))
               for b, n in decode_setups]
    return max(prompts + decodes)


class StepTimer:
    """One engine configured as a worker of the cluster (its threads, niceness and CPU
    weight layout) that times its own steps; ``tandem profile`` runs it as a Ray actor.

    Its KV cache holds what the grids need (``blocks``, from ``grid_blocks``; on CPU); the
    cache a served worker gets (``kv_cache_gb``, as ``tandem serve --kv-cache-gb``; None:
    serve's default) is what ``limits`` reports, for ``tandem plan`` to simulate."""

    def __init__(self, model: str, threads: int, niceness: int, device: str = "cpu",
                 kv_cache_gb: float | None = None, layout: str = EngineConfig.cpu_weight_layout, seed: int = 0,
                 blocks: int = 0) -> None:
        import numpy as np
        import torch

        from tandem.common.config import CacheConfig
        from tandem.engine import gc_freeze
        from tandem.engine.engine import LLMEngine  # torch: loaded in the actor only
        from tandem.engine.kv_cache.paged_cache import PagedKVCache
        from tandem.engine.kv_cache.sizing import num_kv_blocks

        if niceness:
            os.nice(niceness)
        os.environ["OMP_NUM_THREADS"] = str(threads)  # as EngineWorker does
        torch.set_num_threads(threads)
        served = CacheConfig(memory_gb=kv_cache_gb, enable_prefix_caching=False)
        # on CPU the timed engine holds the grids, whatever a served worker would hold
        timed = dataclasses.replace(served, num_blocks=max(2, blocks)) if device == "cpu" and blocks else served
        self.config = EngineConfig(model=model, num_threads=threads, device=device, cpu_weight_layout=layout,
                                   cache=timed)
        self.engine = LLMEngine(self.config)
        mc = self.engine.model_config
        per_block = PagedKVCache.bytes_per_block(mc.num_layers, served.block_size, mc.num_kv_heads,
                                                 mc.head_dim, self.engine.dtype)
        self.served_blocks = self.engine.block_pool.num_blocks if timed is served \
            else num_kv_blocks(served, per_block, self.engine.device, 0)
        self.rng = np.random.default_rng(seed)
        self.n = 0
        if gc_freeze.in_actor_process():  # as a worker actor freezes its heap (EngineWorker)
            gc_freeze.freeze()

    def pid(self) -> int:
        return os.getpid()

    def limits(self) -> dict[str, Any]:
        e, mc = self.engine, self.engine.model_config
        return {"max_num_batched_tokens": e.config.scheduler.max_num_batched_tokens,
                "max_num_seqs": e.config.scheduler.max_num_seqs,
                "block_size": e.config.cache.block_size, "num_blocks": self.served_blocks,
                "kv_bytes_per_token": e.kv_cache.bytes_per_block(
                    mc.num_layers, 1, mc.num_kv_heads, mc.head_dim, e.dtype),
                "dtype": str(e.dtype).removeprefix("torch."), "device": str(e.device),
                "gpu": __import__("torch").cuda.get_device_name(e.device) if e.device.type == "cuda" else None,
                "max_model_len": e.max_model_len,
                "model": {"path": e.model_path, "architecture": mc.architecture, "layers": mc.num_layers,
                          "hidden_size": mc.hidden_size, "kv_heads": mc.num_kv_heads, "head_dim": mc.head_dim,
                          "vocab_size": mc.vocab_size}}

    def _add(self, length: int, max_tokens: int) -> str:
        from tandem.common.sampling_params import SamplingParams

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

    def prefill(self, tokens: list[int], batches: list[tuple[int, int]], repeats: int,
                warmup: bool = True) -> list[dict]:
        """One timed step per point: the whole prompt(s) in one step, then finished.
        ``warmup`` False: no untimed steps first (a later pass over the grid, as
        ``tandem profile`` calls it once per repeat to show its progress)."""
        budget = self.engine.config.scheduler.max_num_batched_tokens
        if max([*tokens, *(b * n for b, n in batches)]) > budget:
            raise ValueError(f"a timed prefill step holds at most max_num_batched_tokens={budget} tokens")
        need = grid_blocks(tokens, batches, [], [], repeats, self.engine.config.cache.block_size, budget)
        if need > self.engine.block_pool.num_blocks:
            raise ValueError(f"the prefill grid needs {need} KV blocks; this engine has "
                             f"{self.engine.block_pool.num_blocks}")
        for n in PREFILL_WARMUPS if warmup else ():
            self._add(n, 1), self._timed_step()
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
        bs, budget = self.engine.config.cache.block_size, self.engine.config.scheduler.max_num_batched_tokens
        for b, length in setups:
            need = grid_blocks([], [], [(b, length)], mixed_setups, repeats, bs, budget)
            if b > self.engine.config.scheduler.max_num_seqs or need > self.engine.block_pool.num_blocks:
                raise ValueError(f"a decode step of {b} x {length} tokens needs {need} KV blocks and {b} "
                                 f"sequences; this engine has {self.engine.block_pool.num_blocks} and "
                                 f"max_num_seqs={self.engine.config.scheduler.max_num_seqs}")
            extra, ramp = len(mixed.get((b, length), ())), ramp_steps(b, length, budget)
            for _ in range(b):
                self._add(length, decode_max_tokens(ramp, repeats, extra))
            def decoding() -> bool:
                return len(sched.running) == b and all(s.num_uncomputed_tokens == 1 for s in sched.running)

            for _ in range(ramp):
                if decoding():
                    break
                self.engine.step()
            if not decoding():
                raise RuntimeError(f"{b} prompts of {length} tokens were not all decoding after {ramp} steps")
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
