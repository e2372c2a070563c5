"""Wires a tandem cluster on Ray: pools, transfer group, router and request driver."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import itertools
import threading
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence

import ray

from tandem.common.config import ClusterConfig, EngineConfig
from tandem.common.sampling_params import SamplingParams
from tandem.cluster import attach, control, cpu_sizing, drain, placement
from tandem.cluster import scale as resize
from tandem.cluster.drain import DRAIN_TIMEOUT_S, DrainReport
from tandem.cluster.handles import RayDecode, RayPrefill, is_transient
from tandem.cluster.migrate import Migrations
from tandem.cluster.rebalance import Rebalancer
from tandem.cluster.ray_start import RayRuntime
from tandem.decode.worker import DecodeWorker
from tandem.prefill.worker import PrefillWorker
from tandem.protocol.request_path import TokenDelta
from tandem.router import Router, RouterConfig
from tandem.router.driver import RequestDriver
from tandem.worker.decode_board import DecodeBoard
from tandem.transfer.placement import pair_transports

log = logging.getLogger(__name__)
# How often the gateway polls each worker's load. The router's in-flight ledger covers what a
# snapshot does not show yet; each poll costs CPU across gateway, worker and Ray, which a
# shorter interval turns into a noticeable share of a core on an idle cluster
# (services/RESULTS.md).
LOAD_REFRESH_S = 0.2
REBUILD_WAIT_S = 60.0  # the longest a request or re-drive waits for the pools to heal


class Cluster:
    """Prefill and decode pools on Ray, and the path a request takes through them.

    ``start()`` blocks until every worker is up and connected; ``generate()``
    streams one request's ``TokenDelta``s; ``shutdown()`` kills the actors.
    """

    def __init__(self, config: ClusterConfig,
                 progress: Callable[[str], None] = lambda msg: log.info(msg),
                 deployment: str | None = None) -> None:
        """``deployment``: run the workers as detached actors under this name, so they
        outlive the gateway and a restarted one re-attaches to them (see ``attach``)."""
        # thread counts left unset: sized to the host, or by each worker on a joined Ray cluster
        self.config = cpu_sizing.resolve(config)
        if deployment:  # detached workers outlive the board this gateway would keep for them
            self.config = dataclasses.replace(self.config, prefill_burst_threads=0)
        self.board: DecodeBoard | None = None  # the host's, while prefill workers burst
        self.deployment = deployment
        self.reattached: list[str] = []
        self.placement: dict[str, placement.NodePlacement] = {}  # worker id -> its Ray node
        self.control_name = control.name_of(deployment)  # where `tandem drain` finds it
        self._control: control.ControlWatcher | None = None
        self._progress = progress
        self.prefill: list[RayPrefill] = []
        self.decode: list[RayDecode] = []
        self.draining: dict[str, RayPrefill | RayDecode] = {}  # out of the pools, not yet gone
        self.router: Router | None = None
        self.driver: RequestDriver | None = None
        self._ids = itertools.count()
        self._refresher: threading.Thread | None = None
        self._refresher_stop = threading.Event()
        self._first_refresh = threading.Event()
        self._ray = RayRuntime(config.ray_address)  # a Ray started here listens on loopback only
        self.replacements = 0
        self.rebuilds = 0
        self.migrations = Migrations(self)
        self.rebalancer = Rebalancer(self)
        self._serving = threading.Event()  # cleared while the transfer group is rebuilt
        self._membership = threading.RLock()  # one heal, drain or resize at a time
        self._serving.set()

    # -- lifecycle --------------------------------------------------------------
    def start(self, timeout_s: float = 300.0) -> Cluster:
        if self.config.prefill_burst_threads:
            self.board = DecodeBoard.create()
        try:
            return self._start(timeout_s)
        except BaseException:
            self._remove_board()
            raise

    def _remove_board(self) -> None:
        if self.board is not None:
            self.board.remove()
            self.board = None

    def _start(self, timeout_s: float) -> Cluster:
        from tandem.engine.model_source import resolve_model

        cfg = self.config
        if not ray.is_initialized():
            self._progress("starting Ray (loopback only)" if cfg.ray_address is None
                           else f"joining Ray at {cfg.ray_address}")
            self._ray.start()
        model = str(resolve_model(cfg.engine.model).path)
        engine = dataclasses.replace(cfg.engine, model=model, num_threads=cfg.threads_per_worker)
        colocated = cfg.mode == "colocated"
        n_prefill = 0 if colocated else cfg.prefill_workers
        n_decode = cfg.decode_workers + (cfg.prefill_workers if colocated else 0)
        self._progress(f"loading {model} on {n_prefill} prefill + {n_decode} decode workers, "
                       + cpu_sizing.describe(cfg))
        self._engine = engine
        role = "both" if colocated else "decode"
        attached = attach.reattach(self, n_prefill, n_decode, timeout_s) if self.deployment else {}
        self.prefill = [RayPrefill(attached.get(f"prefill-{i}") or self._actor(
            PrefillWorker, f"prefill-{i}"), f"prefill-{i}", "prefill", rank=i)
            for i in range(n_prefill)]
        self.decode = [RayDecode(attached.get(f"decode-{i}") or self._actor(
            DecodeWorker, f"decode-{i}"), f"decode-{i}", role, rank=n_prefill + i)
            for i in range(n_decode)]
        ray.get([w.actor.ready.remote() for w in self.prefill + self.decode], timeout=timeout_s)
        self._locate(self.prefill + self.decode, timeout_s)
        if self.deployment:
            attach.claim_new(self, [w for w in self.prefill + self.decode
                                    if w.worker_id not in attached], timeout_s)
        if not colocated:
            if attached:  # the group of the previous gateway: leave it, build a fresh one
                ray.get([w.actor.leave_transfer_group.remote()
                         for w in self.prefill + self.decode], timeout=timeout_s)
            self._connect(timeout_s)
        self.router = Router(RouterConfig(
            mode=cfg.mode, local_prefill_threshold=cfg.local_prefill_threshold,
            prefill_saturation_s=cfg.prefill_saturation_s,
            max_queued_requests=cfg.max_queued_requests, block_size=cfg.engine.cache.block_size),
            self.prefill + self.decode)
        self.driver = RequestDriver(self.router, max_attempts=cfg.max_attempts,
                                    layer_group_size=cfg.layer_group_size, checksum=cfg.checksum,
                                    wait_until_serving=self.wait_until_serving,
                                    on_moved=self.migrations.record)
        self._start_refresher()
        if not self._first_refresh.wait(timeout_s):
            raise TimeoutError(f"no worker loads within {timeout_s:g}s")
        self.publish_placement()
        self._control = control.ControlWatcher(self.control_name, self).start()
        self._progress("cluster ready")
        return self

    def _actor(self, cls, worker_id: str):
        cfg = self.config
        prefill = cls is PrefillWorker
        opts: dict = dict(num_cpus=cfg.cpus_per_worker, num_gpus=cfg.gpus_per_worker,
                          max_concurrency=10_000,
                          name=f"tandem-{worker_id}-{uuid.uuid4().hex[:6]}")
        if self.deployment:  # outlives this gateway; found again by name
            opts.update(name=attach.actor_name(self.deployment, worker_id),
                        namespace=attach.NAMESPACE, lifetime="detached")
        accel = cfg.prefill_accelerator_type if prefill else cfg.decode_accelerator_type
        if accel:
            opts["accelerator_type"] = accel
        resources = dict(cfg.prefill_resources if prefill else cfg.decode_resources)
        if resources:
            opts["resources"] = resources
        colocated = cfg.mode == "colocated"  # no prefill pool whose idle cores to take
        engine = self.engine_config(worker_id)
        board = self.board.path if self.board else None
        args = (worker_id, engine, cfg.prefill_nice, None, cfg.prefill_burst_threads, board) if prefill \
            else (worker_id, engine, cfg.transfer_timeout_s, "both" if colocated else "decode",
                  None, 0 if colocated else cfg.decode_burst_threads, board)  # sync None: the device's own
        for _ in range(50):  # a detached name is free again once its killed actor is gone
            try:
                return ray.remote(cls).options(**opts).remote(*args)
            except ValueError as e:
                if not self.deployment or "already taken" not in str(e):
                    raise
                time.sleep(0.2)
        raise RuntimeError(f"the actor name of {worker_id} stays taken")

    def engine_config(self, worker_id: str) -> EngineConfig:
        """The engine ``worker_id`` runs: the cluster's, with its pool's weight layout in a
        disaggregated or conditional cluster (colocated workers run both phases: they keep
        the cluster's)."""
        role = "colocated" if self.config.mode == "colocated" else \
            "prefill" if worker_id.startswith("prefill-") else "decode"
        layout = self.config.pool_layout(role)
        if layout == self._engine.cpu_weight_layout:
            return self._engine
        return dataclasses.replace(self._engine, cpu_weight_layout=layout)

    def _locate(self, workers: list, timeout_s: float) -> None:
        """Record (and report) the Ray node each of ``workers`` runs on."""
        self.placement.update(placement.locate(workers, timeout_s))
        self._progress("placement: " + placement.describe(workers, self.placement))

    def publish_placement(self) -> None:
        """Keep the workers' nodes where ``tandem drain --this-node`` looks (best effort)."""
        nodes = {w.worker_id: self.placement[w.worker_id].node_id
                 for w in self.prefill + self.decode if w.worker_id in self.placement}
        try:
            control.publish_nodes(self.control_name, nodes)
        except Exception:  # noqa: BLE001 - only node-wide drains need it
            log.warning("publishing the workers' nodes failed", exc_info=True)

    def _connect(self, timeout_s: float) -> None:
        """Check every pair's KV layout, then build one transfer group over all of them."""
        pre, dec = self.prefill, self.decode
        p_compat = ray.get([w.actor.compatibility.remote() for w in pre], timeout=timeout_s)
        d_compat = ray.get([w.actor.compatibility.remote() for w in dec], timeout=timeout_s)
        others = list(zip(pre, p_compat)) + (list(zip(dec, d_compat)) if self.config.kv_migration
                                               else [])
        for p, pc in others:
            for d, dc in zip(dec, d_compat):
                if p is not d:
                    dc.check(pc, ours=d.worker_id, theirs=p.worker_id)
        for rank, w in enumerate(pre + dec):  # contiguous again after a worker left
            w.rank = rank
        ranks = [w.rank for w in pre]
        cuda = self.config.engine.device.startswith("cuda")
        uuids = ray.get([w.actor.device_uuid.remote() for w in pre + dec], timeout=timeout_s)
        transports = pair_transports(
            str(self.config.transfer_backend), cuda, {w.rank: u for w, u in zip(pre + dec, uuids)},
            ranks, [w.rank for w in dec], {w.rank: w.worker_id for w in pre + dec},
            migration=self.config.kv_migration)
        world, group = len(pre) + len(dec), f"tandem-kv-{uuid.uuid4().hex[:8]}"
        in_place = self.config.kv_in_place_min_bytes
        op_timeout = self.config.transfer_timeout_s  # every send/recv of the group is bounded
        calls = [w.actor.join_transfer_group.remote(transports[w.rank], world, w.rank, group,
                                                    in_place_min_bytes=in_place,
                                                    op_timeout_s=op_timeout) for w in pre]
        calls += [w.actor.join_transfer_group.remote(transports[w.rank], world, w.rank, group,
                                                     ranks, op_timeout_s=op_timeout) for w in dec]
        ray.get(calls, timeout=timeout_s)
        kinds = sorted({k for peers in transports.values() for k in peers.values()})
        self._progress(f"transfer group {group} ({'+'.join(kinds)}, {world} ranks) connected")

    def replace_dead(self, timeout_s: float = 300.0) -> list[str]:
        """Heal the pools: start a new actor for every dead worker, and rebuild the
        transfer group around it or around any worker whose channel broke.

        A worker Ray cannot reach for now (``ActorUnavailableError``) is left for a
        later round. Transfers in flight during the rebuild fail and their requests
        are re-driven once it is done. Returns the ids of the replaced workers.
        """
        with self._membership:  # checked under the lock: a drain or resize changes the pools
            dead, broken = self._unhealthy()
            if not dead and not broken:
                return []
            what = [f"replacing {', '.join(w.worker_id for w in dead)}"] if dead else []
            what += [f"rebuilding the transfer group ({', '.join(w.worker_id for w in broken)}: "
                     "channel broken)"] if broken else []
            self._progress("; ".join(what))
            self._serving.clear()
            try:
                self._replace(dead, timeout_s)
            finally:
                self._serving.set()
        return [w.worker_id for w in dead]

    def _unhealthy(self) -> tuple[list, list]:
        """(dead workers, workers whose transfer channel broke), asked of each worker."""
        dead, broken = [], []
        for w in self.prefill + self.decode:
            try:
                load = ray.get(w.actor.load.remote(), timeout=10)
            except Exception as e:
                if not is_transient(e):
                    dead.append(w)
                continue
            if not load.get("engine_alive", load["alive"]):
                dead.append(w)
            elif load.get("transfer_broken"):
                broken.append(w)
        return dead, broken

    def _replace(self, dead: list, timeout_s: float) -> None:
        for w in dead:
            with contextlib.suppress(Exception):
                ray.kill(w.actor, no_restart=True)
            w.actor = self._actor(PrefillWorker if w in self.prefill else DecodeWorker, w.worker_id)
        ray.get([w.actor.ready.remote() for w in dead], timeout=timeout_s)
        self._locate(dead, timeout_s)
        if self.config.mode != "colocated":
            live = [w for w in self.prefill + self.decode if w not in dead]
            ray.get([w.actor.leave_transfer_group.remote() for w in live], timeout=timeout_s)
            self._connect(timeout_s)
        if dead and self._control is not None:
            self.publish_placement()
        self.refresh_loads_now()
        for w in dead:
            self.router.add_worker(w)  # same id: revives it in the router
        self.replacements += len(dead)
        self.rebuilds += 1

    def drain_worker(self, worker_id: str, timeout_s: float = DRAIN_TIMEOUT_S) -> DrainReport:
        """Take a worker out of the cluster without cutting a stream (a scale-down): see
        ``tandem.cluster.drain``."""
        return drain.drain_worker(self, worker_id, timeout_s)

    def migrate(self, request_id: str, to: str | None = None) -> concurrent.futures.Future:
        """Move a running request to another decode worker with its KV (``to``, or the
        one the router picks); the future gets its ``MoveResult`` (see
        ``tandem.cluster.migrate``)."""
        return self.migrations.migrate(request_id, to)

    def scale(self, role: str, workers: int, timeout_s: float = resize.ADD_TIMEOUT_S,
              drain_timeout_s: float = DRAIN_TIMEOUT_S) -> resize.ScaleReport:
        """Resize the ``prefill`` or ``decode`` pool to ``workers``: new workers join once
        Ray places them, surplus ones are drained (see ``tandem.cluster.scale``)."""
        return resize.scale_pool(self, role, workers, timeout_s, drain_timeout_s)

    def shutdown(self, kill_workers: bool | None = None) -> None:
        """Stop; the workers are killed unless they belong to a deployment (detached:
        a restarted gateway re-attaches to them), or as ``kill_workers`` says."""
        try:
            self._stop_refresher()
            if self._control is not None:
                self._control.stop()
                self._control = None
                self.placement = {}
                self.publish_placement()  # forgets them all
            if kill_workers is None:
                kill_workers = self.deployment is None
            for w in self.prefill + self.decode + list(self.draining.values()):
                if not kill_workers:
                    continue
                with contextlib.suppress(Exception):
                    ray.kill(w.actor)
            self.prefill, self.decode = [], []
            self._ray.stop()
        finally:
            self._remove_board()

    # -- health: loads refreshed and workers healed from start-up -------------------
    async def refresh_loads(self) -> None:
        await asyncio.gather(*(w.refresh() for w in self.prefill + self.decode))

    def refresh_loads_now(self, timeout_s: float = 10.0) -> None:
        """Fetch every worker's load before returning (from any thread): after the pools or
        the transfer group changed, so that no request is placed on a snapshot taken
        meanwhile (a worker that had left the group reads as not alive, a new one as empty)."""
        thread = threading.Thread(target=lambda: asyncio.run(self.refresh_loads()),
                                  name="tandem-refresh-now", daemon=True)
        thread.start()
        thread.join(timeout_s)

    @property
    def serving(self) -> bool:
        """False while the transfer group is being rebuilt around a replaced worker."""
        return self._serving.is_set()

    def _heal(self) -> None:
        try:
            self.replace_dead()
        except Exception:
            log.exception("healing the pools failed; will retry")

    def _start_refresher(self) -> None:
        """Refresh loads (and heal) on a thread of its own, from start-up to shutdown."""
        self._refresher_stop.clear()
        self._first_refresh.clear()
        self._refresher = threading.Thread(target=lambda: asyncio.run(self._refresh_forever()),
                                           name="tandem-refresher", daemon=True)
        self._refresher.start()

    def _stop_refresher(self) -> None:
        self._refresher_stop.set()
        if self._refresher is not None and self._refresher is not threading.current_thread():
            self._refresher.join(timeout=30)
        self._refresher = None

    async def _refresh_forever(self) -> None:
        healing: asyncio.Future | None = None
        while not self._refresher_stop.is_set():
            try:
                await self.refresh_loads()
            except Exception:  # noqa: BLE001 - never let the refresher die
                log.exception("refreshing worker loads failed")
            self._first_refresh.set()
            try:
                self.rebalancer.tick()
            except Exception:  # noqa: BLE001 - never let the refresher die
                log.exception("rebalancing the decode pool failed")
            workers = self.prefill + self.decode
            if any(not w.load().alive and not is_transient(w.last_error) for w in workers) \
                    and (healing is None or healing.done()):
                healing = asyncio.ensure_future(asyncio.to_thread(self._heal))
            await asyncio.sleep(LOAD_REFRESH_S)
        if healing is not None:
            await healing

    async def wait_until_serving(self, timeout_s: float = REBUILD_WAIT_S) -> None:
        """Return once no rebuild is under way and every worker reports alive, or after
        ``timeout_s`` (then the router places the request on what is alive)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            await self.refresh_loads()
            if self._serving.is_set() and all(w.load().alive for w in self.prefill + self.decode):
                return
            await asyncio.sleep(LOAD_REFRESH_S)

    async def generate(self, prompt_token_ids: Sequence[int], params: SamplingParams,
                       request_id: str | None = None) -> AsyncIterator[TokenDelta]:
        """Stream one request's deltas (token #1 from the prefill worker, then decode)."""
        if self.driver is None:
            raise RuntimeError("the cluster is not started")
        if not self._serving.is_set():  # a rebuild is under way: wait for it (bounded)
            await self.wait_until_serving()
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

