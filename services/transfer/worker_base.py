"""What prefill and decode workers share: a role engine on its own thread, metrics, probes."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable

import torch

from services.common.config import EngineConfig, EngineRole
from services.common.metrics import worker_metrics
from services.engine.engine import LLMEngine
from services.engine.engine_loop import EngineLoop
from services.protocol.messages import CompatibilityDescriptor
from services.transfer.endpoint import compatibility


class EngineWorker:
    """Base of the worker actors: ``engine`` in ``role``, driven by ``loop``."""

    def __init__(self, worker_id: str, config: EngineConfig, role: str,
                 on_layer_done: Callable[[int, list], None] | None = None,
                 niceness: int = 0) -> None:
        self.worker_id, self.role = worker_id, role
        if niceness:  # before the engine's threads start: Linux niceness is per thread, inherited
            os.nice(niceness)
        if config.num_threads is not None:  # Ray sets OMP_NUM_THREADS=1 in actors
            os.environ["OMP_NUM_THREADS"] = str(config.num_threads)
            torch.set_num_threads(config.num_threads)
        cfg = dataclasses.replace(config, scheduler=dataclasses.replace(
            config.scheduler, role=EngineRole(role)))
        self.metrics, self._registry = worker_metrics(role, worker_id)
        self.engine = LLMEngine(cfg, metrics=self.metrics)
        self.loop = EngineLoop(self.engine, on_layer_done=on_layer_done)
        self.transfer_failures = 0

    def ready(self) -> str:
        return self.worker_id

    def compatibility(self) -> CompatibilityDescriptor:
        return compatibility(self.engine)

    def load(self) -> dict:
        return {**self.engine.load_snapshot(), "worker_id": self.worker_id, "role": self.role,
                "alive": self.loop.error is None}

    def metrics_families(self) -> list:
        """This worker's Prometheus metric families (merged into the gateway's /metrics)."""
        self.engine.update_gauges()
        return list(self._registry.collect())

    def stats(self) -> dict:
        return {**self.load(), "transfer_failures": self.transfer_failures,
                "num_preemptions": self.engine.scheduler.num_preemptions, **self.counters()}

    def counters(self) -> dict:
        return {}
