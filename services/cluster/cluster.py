"""Wires a tandem cluster on Ray: pools, transfer group, router and request driver."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import threading
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
        self.replacements = 0
        self._healing: asyncio.Future | None = None
        self._serving = threading.Event()  # cleared while the transfer group is rebuilt
        self._serving.set()

    # -- lifecycle --------------------------------------------------------------
    def start(self, timeout_s: float = 300.0) -> Cluster:
        from services.engine.model_source import resolve_model

        cfg = self.config
        if not ray.is_initialized():
            self._progress("starting Ray" if cfg.ray_address is None
                           else f"joining Ray at {cfg.ray_address}")
            local = {} if cfg.ray_address else {"_node_ip_address": "127.0.0.1"}  # Ray stays internal
            ray.init(address=cfg.ray_address, include_dashboard=False,
                     log_to_driver=False, configure_logging=False, **local)
            self._owns_ray = True
        model = str(resolve_model(cfg.engine.model).path)
        engine = dataclasses.replace(cfg.engine, model=model, num_threads=cfg.threads_per_worker)
        colocated = cfg.mode == "colocated"
        n_prefill = 0 if colocated else cfg.prefill_workers
        n_decode = cfg.decode_workers + (cfg.prefill_workers if colocated else 0)
        self._progress(f"loading {model} on {n_prefill} prefill + {n_decode} decode workers")
        self._engine = engine
        role = "both" if colocated else "decode"
        self.prefill = [RayPrefill(self._actor(PrefillWorker, f"prefill-{i}"), f"prefill-{i}",
                                   "prefill", rank=i) for i in range(n_prefill)]
        self.decode = [RayDecode(self._actor(DecodeWorker, f"decode-{i}"), f"decode-{i}", role,
                                 rank=n_prefill + i) for i in range(n_decode)]
        ray.get([w.actor.ready.remote() for w in self.prefill + self.decode], timeout=timeout_s)
        if not colocated:
            self._connect(timeout_s)
        self.router = Router(RouterConfig(
            mode=cfg.mode, local_prefill_threshold=cfg.local_prefill_threshold,
            max_queued_requests=cfg.max_queued_requests, block_size=cfg.engine.cache.block_size),
            self.prefill + self.decode)
        self.driver = RequestDriver(self.router, max_attempts=cfg.max_attempts,
                                    layer_group_size=cfg.layer_group_size, checksum=cfg.checksum)
        self._progress("cluster ready")
        return self

    def _actor(self, cls, worker_id: str):
        cfg = self.config
        prefill = cls is PrefillWorker
        opts: dict = dict(num_cpus=cfg.cpus_per_worker, num_gpus=cfg.gpus_per_worker,
                          max_concurrency=10_000,
                          name=f"tandem-{worker_id}-{uuid.uuid4().hex[:6]}")
        accel = cfg.prefill_accelerator_type if prefill else cfg.decode_accelerator_type
        if accel:
            opts["accelerator_type"] = accel
        resources = dict(cfg.prefill_resources if prefill else cfg.decode_resources)
        if resources:
            opts["resources"] = resources
        args = (worker_id, self._engine, cfg.prefill_nice) if prefill else (
            worker_id, self._engine, cfg.transfer_timeout_s,
            "both" if cfg.mode == "colocated" else "decode")
        return ray.remote(cls).options(**opts).remote(*args)

    def _connect(self, timeout_s: float) -> None:
        """Check every P-D pair's KV layout, then build one transfer group over all of them."""
        pre, dec = self.prefill, self.decode
        p_compat = ray.get([w.actor.compatibility.remote() for w in pre], timeout=timeout_s)
        d_compat = ray.get([w.actor.compatibility.remote() for w in dec], timeout=timeout_s)
        for p, pc in zip(pre, p_compat):
            for d, dc in zip(dec, d_compat):
                dc.check(pc, ours=d.worker_id, theirs=p.worker_id)
        backend = self.config.transfer_backend
        if backend == "auto":
            backend = "nccl" if self.config.engine.device.startswith("cuda") else "gloo"
        world, group = len(pre) + len(dec), f"tandem-kv-{uuid.uuid4().hex[:8]}"
        ranks = [w.rank for w in pre]
        in_place = self.config.kv_in_place_min_bytes
        calls = [w.actor.join_transfer_group.remote(backend, world, w.rank, group,
                                                    in_place_min_bytes=in_place) for w in pre]
        calls += [w.actor.join_transfer_group.remote(backend, world, w.rank, group, ranks)
                  for w in dec]
        ray.get(calls, timeout=timeout_s)
        self._progress(f"transfer group {group} ({backend}, {world} ranks) connected")

    def replace_dead(self, timeout_s: float = 300.0) -> list[str]:
        """Start a new actor for every dead worker and rebuild the transfer group around it.

        Transfers in flight during the rebuild fail and their requests are re-driven.
        Returns the ids of the replaced workers.
        """
        dead = []
        for w in self.prefill + self.decode:
            try:
                alive = ray.get(w.actor.load.remote(), timeout=10)["alive"]
            except Exception:
                alive = False
            if not alive:
                dead.append(w)
        if not dead:
            return []
        self._progress(f"replacing {', '.join(w.worker_id for w in dead)}")
        self._serving.clear()
        try:
            self._replace(dead, timeout_s)
        finally:
            self._serving.set()
        return [w.worker_id for w in dead]

    def _replace(self, dead: list, timeout_s: float) -> None:
        for w in dead:
            with contextlib.suppress(Exception):
                ray.kill(w.actor, no_restart=True)
            w.actor = self._actor(PrefillWorker if w in self.prefill else DecodeWorker, w.worker_id)
        ray.get([w.actor.ready.remote() for w in dead], timeout=timeout_s)
        if self.config.mode != "colocated":
            live = [w for w in self.prefill + self.decode if w not in dead]
            ray.get([w.actor.leave_transfer_group.remote() for w in live], timeout=timeout_s)
            self._connect(timeout_s)
        for w in dead:
            self.router.add_worker(w)  # same id: revives it in the router
        self.replacements += len(dead)

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

    @property
    def serving(self) -> bool:
        """False while the transfer group is being rebuilt around a replaced worker."""
        return self._serving.is_set()

    def _heal(self) -> None:
        try:
            self.replace_dead()
        except Exception:
            log.exception("replacing dead workers failed; will retry")

    async def _refresh_forever(self) -> None:
        while True:
            await self.refresh_loads()
            workers = self.prefill + self.decode
            if any(not w.load().alive for w in workers) and (
                    self._healing is None or self._healing.done()):
                self._healing = asyncio.ensure_future(asyncio.to_thread(self._heal))
            await asyncio.sleep(LOAD_REFRESH_S)

    async def generate(self, prompt_token_ids: Sequence[int], params: SamplingParams,
                       request_id: str | None = None) -> AsyncIterator[TokenDelta]:
        """Stream one request's deltas (token #1 from the prefill worker, then decode)."""
        if self.driver is None:
            raise RuntimeError("the cluster is not started")
        if self._refresher is None or self._refresher.done():
            await self.refresh_loads()
            self._refresher = asyncio.get_running_loop().create_task(self._refresh_forever())
        if not self._serving.is_set():  # a rebuild is under way: wait for it (bounded)
            await asyncio.to_thread(self._serving.wait, 60.0)
        rid = request_id or f"req-{next(self._ids)}-{uuid.uuid4().hex[:8]}"
        async with contextlib.aclosing(self.driver.generate(rid, prompt_token_ids, params)) as gen:
            async for delta in gen:
                yield delta

    async def worker_metric_families(self) -> list:
        """Every live worker's Prometheus metric families (labelled role/worker)."""
        async def one(w) -> list:
            try:
                return await asyncio.wait_for(w.actor.metrics_families.remote(), 5.0)
            except Exception:
                return []
        lists = await asyncio.gather(*(one(w) for w in self.prefill + self.decode))
        return [f for fams in lists for f in fams]

    async def worker_stats(self) -> list[dict]:
        """Each live worker's load snapshot plus its transfer counters (dead ones say so)."""
        async def one(w) -> dict:
            try:
                return await w.actor.stats.remote()
            except Exception as e:
                return {"worker_id": w.worker_id, "role": w.role, "alive": False, "error": str(e)}
        return list(await asyncio.gather(*(one(w) for w in self.prefill + self.decode)))

