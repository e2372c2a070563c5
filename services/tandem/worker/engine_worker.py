"""What prefill and decode workers share: a role engine on its own thread, metrics, probes.

``EngineWorker`` owns the engine loop (and so the engine's thread), the
worker's niceness, thread count and Prometheus registry, and the health the
cluster acts on: ``load()["alive"]`` is false when the engine loop stopped or
the worker's end of the transfer group is broken, so the cluster rebuilds the
group or replaces the worker and ``/ready`` says so.

On CUDA the worker runs on the GPU Ray assigned it (``device.py``) and the engine
thread computes on a non-blocking stream of the worker's (``compute_stream``),
never on the legacy default stream; KV transfer work is ordered against it by
events (``tandem.transfer.device_sync``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
from collections.abc import Callable
from typing import TypeVar

import torch

from tandem.common.config import EngineConfig, EngineRole
from tandem.common.metrics import worker_metrics
from tandem.engine import gc_freeze
from tandem.engine.engine import LLMEngine
from tandem.engine.engine_loop import EngineLoop
from tandem.protocol.messages import CompatibilityDescriptor
from tandem.transfer.endpoint import compatibility
from tandem.transfer.device_sync import DeviceSync, make_sync
from tandem.worker.device import actor_device, device_uuid
from tandem.worker.threads import ElasticThreads, node_threads

T = TypeVar("T")
COMMAND_TIMEOUT_S = 60.0  # the longest an engine command may wait for its turn


class EngineWorker:
    """Base of the worker actors: ``engine`` in ``role``, driven by ``loop``."""

    def __init__(self, worker_id: str, config: EngineConfig, role: str,
                 on_layer_done: Callable[[int, list], None] | None = None,
                 niceness: int = 0,
                 on_request_failed: Callable[[LLMEngine, str], object] | None = None,
                 sync: DeviceSync | None = None) -> None:
        """``sync``: the device's streams and events (default: this device's own)."""
        self.worker_id, self.role = worker_id, role
        if niceness:  # before the engine's threads start: Linux niceness is per thread, inherited
            os.nice(niceness)
        if config.num_threads is None and config.device == "cpu":  # on a Ray node it joined
            config = dataclasses.replace(config, num_threads=node_threads())
        if config.num_threads is not None:  # Ray sets OMP_NUM_THREADS=1 in actors
            os.environ["OMP_NUM_THREADS"] = str(config.num_threads)
            torch.set_num_threads(config.num_threads)
        self.num_threads = torch.get_num_threads()
        self.threads = ElasticThreads(self.num_threads, 0)  # a role that bursts replaces it
        device = actor_device(config.device)
        if device != "cpu":
            torch.cuda.set_device(torch.device(device))
        cfg = dataclasses.replace(config, device=device, scheduler=dataclasses.replace(
            config.scheduler, role=EngineRole(role)))
        self.metrics, self._registry = worker_metrics(role, worker_id)
        self.engine = LLMEngine(cfg, metrics=self.metrics)
        self.sync = sync or make_sync(self.engine.device)
        self.compute_stream = self.sync.new_stream("compute")
        if self.engine.device.type == "cuda":  # weights and cache were written on the default stream
            torch.cuda.synchronize(self.engine.device)
        self.loop = EngineLoop(self.engine, on_layer_done=on_layer_done,
                               on_request_failed=on_request_failed)
        self.loop.call(lambda e: self.sync.bind(self.compute_stream))  # before any request
        self.transfer_failures = 0
        self._generation, self._identity = 0, None  # of the gateway that owns this worker
        if gc_freeze.in_actor_process():  # this process serves this engine to its end
            gc_freeze.freeze()

    def ready(self) -> str:
        return self.worker_id

    # -- ownership by a gateway (detached workers re-attached after a restart) ------
    def owner_generation(self) -> int:
        return self._generation

    def claim(self, generation: int, identity: str) -> str:
        """A gateway takes this worker over: ``"claimed"``; ``"stale"`` when a gateway
        of a later generation holds it; ``"mismatch"`` when built from another config."""
        if generation <= self._generation:
            return "stale"
        if self._identity is not None and identity != self._identity:
            return "mismatch"
        self._generation, self._identity = generation, identity
        return "claimed"

    async def abort_all(self) -> int:
        """Abort every request (those of a gateway that is gone); returns how many."""
        rids = list(self.loop.snapshot.get("request_ids", ()))
        for rid in rids:
            await self.abort(rid)
        return len(rids)

    async def abort(self, request_id: str) -> None:
        raise NotImplementedError

    def pid(self) -> int:
        """The worker's process id (operators and fault tests send it signals)."""
        return os.getpid()

    def compatibility(self) -> CompatibilityDescriptor:
        return compatibility(self.engine)

    def device_uuid(self) -> str | None:
        """The UUID of this worker's GPU (None on CPU): pairs on one GPU use CUDA IPC."""
        return device_uuid(self.engine.device)

    def transfer_broken(self) -> str | None:
        """Why this worker's end of the transfer group is unusable (None: fine or none)."""
        return None

    def load(self) -> dict:
        """The engine loop's last published snapshot plus health (never touches the
        scheduler from this thread)."""
        broken = self.transfer_broken()
        return {**self.loop.snapshot, "worker_id": self.worker_id, "role": self.role,
                "alive": self.loop.alive and broken is None,
                "engine_alive": self.loop.alive, "transfer_broken": broken}

    async def metrics_families(self) -> list:
        """This worker's Prometheus metric families (merged into the gateway's /metrics);
        the gauges are read on the engine thread."""
        await asyncio.wait_for(asyncio.wrap_future(
            self.loop.submit(lambda e: e.update_gauges())), COMMAND_TIMEOUT_S)
        self.metrics.threads.set(self.threads_now())
        return list(self._registry.collect())

    async def _run(self, fn: Callable[[LLMEngine], T]) -> T:
        """Run ``fn(engine)`` on the engine thread; bounded by ``COMMAND_TIMEOUT_S``
        (commands run between steps, so only a wedged engine makes this expire)."""
        return await asyncio.wait_for(asyncio.wrap_future(self.loop.submit(fn)),
                                      COMMAND_TIMEOUT_S)

    def threads_now(self) -> int:
        """Torch threads the engine's steps run with (set at start-up unless elastic)."""
        return self.threads.current or self.threads.base

    def stats(self) -> dict:
        return {**self.load(), "threads": self.threads_now(),
                "transfer_failures": self.transfer_failures, "failed_steps": self.loop.failed_steps,
                "num_preemptions": self.engine.scheduler.num_preemptions, **self.counters()}

    def counters(self) -> dict:
        return {}
