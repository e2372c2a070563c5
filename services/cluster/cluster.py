"""Wires a tandem cluster on Ray: pools, transfer group, router and request driver."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import uuid
from collections.abc import AsyncIterator, Callable, Sequence

import ray

from services.common.config import ClusterConfig
from services.common.sampling_params import SamplingParams
from services.cluster.handles import RayDecode, RayPrefill
from services.decode.worker import DecodeWorker
from services.prefill.worker import PrefillWorker
from services.protocol.request_path import TokenDelta
from services.router import Router, RouterConfig
from services.router.driver import RequestDriver

log = logging.getLogger(__name__)
LOAD_REFRESH_S = 0.05


class Cluster:
    """Prefill and decode pools on Ray, and the path a request takes through them.

    ``start()`` blocks until every worker is up and connected; ``generate()``
    streams one request's ``TokenDelta``s; ``shutdown()`` kills the actors.
    """

    def __init__(self, config: ClusterConfig,
                 progress: Callable[[str], None] = lambda msg: log.info(msg)) -> None:
        self.config = config
        self._progress = progress
        self.prefill: list[RayPrefill] = []
        self.decode: list[RayDecode] = []
        self.router: Router | None = None
        self.driver: RequestDriver | None = None
        self._ids = itertools.count()
        self._refresher: asyncio.Task | None = None
        self._owns_ray = False

    # -- lifecycle --------------------------------------------------------------
    def start(self, timeout_s: float = 300.0) -> Cluster:
        from services.engine.default_model import default_model_path

        cfg = self.config
        if not ray.is_initialized():
            self._progress("starting Ray" if cfg.ray_address is None
                           else f"joining Ray at {cfg.ray_address}")
            ray.init(address=cfg.ray_address, include_dashboard=False,
                     log_to_driver=False, configure_logging=False)
            self._owns_ray = True
        model = cfg.engine.model or str(default_model_path())
        engine = dataclasses.replace(cfg.engine, model=model, num_threads=cfg.threads_per_worker)
        colocated = cfg.mode == "colocated"
        n_prefill = 0 if colocated else cfg.prefill_workers
        n_decode = cfg.decode_workers + (cfg.prefill_workers if colocated else 0)
        self._progress(f"loading {model} on {n_prefill} prefill + {n_decode} decode workers")
        pre = [self._actor(PrefillWorker, "prefill", i, engine) for i in range(n_prefill)]
        dec = [self._actor(DecodeWorker, "decode", i, engine, colocated) for i in range(n_decode)]
        ray.get([a.ready.remote() for a, _ in pre + dec], timeout=timeout_s)
        if not colocated:
            self._connect(pre, dec, timeout_s)
        self.prefill = [RayPrefill(a, wid, "prefill", rank=i) for i, (a, wid) in enumerate(pre)]
        role = "both" if colocated else "decode"
        self.decode = [RayDecode(a, wid, role, rank=n_prefill + i) for i, (a, wid) in enumerate(dec)]
        self.router = Router(RouterConfig(
            mode=cfg.mode, local_prefill_threshold=cfg.local_prefill_threshold,
            max_queued_requests=cfg.max_queued_requests, block_size=cfg.engine.cache.block_size),
            self.prefill + self.decode)
        self.driver = RequestDriver(self.router, max_attempts=cfg.max_attempts,
                                    layer_group_size=cfg.layer_group_size, checksum=cfg.checksum)
        self._progress("cluster ready")
        return self

    def _actor(self, cls, role: str, i: int, engine, colocated: bool = False):
        cfg = self.config
        worker_id = f"{role}-{i}"
        opts: dict = dict(num_cpus=cfg.cpus_per_worker, num_gpus=cfg.gpus_per_worker,
                          max_concurrency=10_000, name=f"tandem-{worker_id}-{uuid.uuid4().hex[:6]}")
        accel = cfg.prefill_accelerator_type if role == "prefill" else cfg.decode_accelerator_type
        if accel:
            opts["accelerator_type"] = accel
        resources = dict(cfg.prefill_resources if role == "prefill" else cfg.decode_resources)
        if resources:
            opts["resources"] = resources
        args = (worker_id, engine) if cls is PrefillWorker else (
            worker_id, engine, cfg.transfer_timeout_s, "both" if colocated else "decode")
        return ray.remote(cls).options(**opts).remote(*args), worker_id

    def _connect(self, pre, dec, timeout_s: float) -> None:
        """Check every P-D pair's KV layout, then build one transfer group over all of them."""
        p_compat = ray.get([a.compatibility.remote() for a, _ in pre], timeout=timeout_s)
        d_compat = ray.get([a.compatibility.remote() for a, _ in dec], timeout=timeout_s)
        for (_, pid), pc in zip(pre, p_compat):
            for (_, did), dc in zip(dec, d_compat):
                dc.check(pc, ours=did, theirs=pid)
        backend = self.config.transfer_backend
        if backend == "auto":
            backend = "nccl" if self.config.engine.device.startswith("cuda") else "gloo"
        world, group = len(pre) + len(dec), f"tandem-kv-{uuid.uuid4().hex[:8]}"
        ranks = list(range(len(pre)))
        calls = [a.join_transfer_group.remote(backend, world, i, group) for i, (a, _) in enumerate(pre)]
        calls += [a.join_transfer_group.remote(backend, world, len(pre) + j, group, ranks)
                  for j, (a, _) in enumerate(dec)]
        ray.get(calls, timeout=timeout_s)
        self._progress(f"transfer group {group} ({backend}, {world} ranks) connected")

    def shutdown(self) -> None:
        if self._refresher is not None:
            self._refresher.cancel()
        for w in self.prefill + self.decode:
            with contextlib.suppress(Exception):
                ray.kill(w.actor)
        self.prefill, self.decode = [], []
        if self._owns_ray:
            ray.shutdown()

    # -- requests ---------------------------------------------------------------
    async def refresh_loads(self) -> None:
        await asyncio.gather(*(w.refresh() for w in self.prefill + self.decode))

    async def _refresh_forever(self) -> None:
        while True:
            await self.refresh_loads()
            await asyncio.sleep(LOAD_REFRESH_S)

    async def generate(self, prompt_token_ids: Sequence[int], params: SamplingParams,
                       request_id: str | None = None) -> AsyncIterator[TokenDelta]:
        """Stream one request's deltas (token #1 from the prefill worker, then decode)."""
        if self.driver is None:
            raise RuntimeError("the cluster is not started")
        if self._refresher is None or self._refresher.done():
            await self.refresh_loads()
            self._refresher = asyncio.get_running_loop().create_task(self._refresh_forever())
        rid = request_id or f"req-{next(self._ids)}-{uuid.uuid4().hex[:8]}"
        async with contextlib.aclosing(self.driver.generate(rid, prompt_token_ids, params)) as gen:
            async for delta in gen:
                yield delta

    async def worker_stats(self) -> list[dict]:
        """Each live worker's load snapshot plus its transfer counters (dead ones say so)."""
        async def one(w) -> dict:
            try:
                return await w.actor.stats.remote()
            except Exception as e:
                return {"worker_id": w.worker_id, "role": w.role, "alive": False, "error": str(e)}
        return list(await asyncio.gather(*(one(w) for w in self.prefill + self.decode)))

