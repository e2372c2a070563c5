"""``tandem profile``: what an engine step and a KV transfer cost on this hardware.

Measured on real engines in Ray actors set up as the cluster's workers are (torch and
OpenMP threads per worker, the prefill pool's niceness, each pool's CPU weight layout;
one actor at a time, so the figures are the worker alone on its cores):

- prefill: steps of one prompt of 16..2048 tokens, and of several prompts at once;
- decode: steps of batch 1..48 at several contexts, and mixed steps (decodes plus a
  prefill chunk, as chunked prefill schedules them) to check the additive model;
- colocated workers run both phases on their own layout (``ClusterConfig.pool_layout``):
  where it is not a pool's, that pool's grid is timed again on it (``points["colocated"]``);
- KV transfer: the KV protocol between two actors over gloo (nccl with ``--device cuda``)
  (``tandem.bench.transfer.bandwidth``), 0.25..16 MB;
- bursts (CPU, ``--burst-threads``, default the usable cores): the prefill steps on the
  prefill pool's layout and the decode steps and prompts on the decode pool's, again with
  that many threads, as a one-worker pool of a cluster started here runs while the other
  pool is idle (``tandem serve --decode-burst-threads/--prefill-burst-threads``).

Writes one JSON (schema ``SCHEMA``) with every timed point, the fitted models
(``tandem.planner.perf_model``), the hardware, the model and the engine's batching
limits. ``tandem plan`` reads it.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tandem.bench import runinfo
from tandem.engine.progress import bar
from tandem.planner.perf_model import DecodeModel, PrefillModel, StepModel, TransferModel, attention_pairs
from tandem.planner.step_timer import StepTimer, grid_blocks
from tandem.common.flags import add_config_flags
from tandem.common.config import CacheConfig, ClusterConfig, EngineConfig, SchedulerConfig

SCHEMA = "tandem.profile/v1"


@dataclass(frozen=True)
class Grid:
    """What is timed: coarse, so that a whole profile takes ~1.5 minutes on 2 cores (bench model)."""

    prefill_tokens: tuple[int, ...] = (16, 64, 128, 256, 512, 1024, 2048)  # one prompt per step
    prefill_batches: tuple[tuple[int, int], ...] = ((4, 64), (8, 128), (4, 256))  # (prompts, tokens each)
    decode_setups: tuple[tuple[int, int], ...] = ((1, 32), (1, 1024), (4, 32), (4, 512), (16, 32), (16, 256),
                                                  (48, 32), (48, 128), (8, 1024))  # (batch, prompt tokens)
    mixed_setups: tuple[tuple[int, int, tuple[int, ...]], ...] = (
        (4, 512, (128, 512, 1024)), (16, 256, (128, 512, 1024)))  # decodes + prefill chunk sizes
    transfer_mb: tuple[float, ...] = (0.25, 1.0, 4.0, 16.0)

def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="local HF folder (default: the embedded `bench` checkpoint)")
    p.add_argument("--threads-per-worker", type=int, default=1, help="torch threads per worker (as `tandem serve`)")
    p.add_argument("--device", default="cpu", help="cpu | cuda (one GPU per worker; KV over nccl)")
    p.add_argument("--kv-cache-gb", type=float, default=None, help="KV cache of a served worker, as `tandem serve "
                   "--kv-cache-gb` (default: serve's), which `tandem plan` simulates; on CPU the timed engines "
                   "hold what the grid needs")
    p.add_argument("--prefill-nice", type=int, default=0, help="niceness of the prefill pool (as `tandem serve`)")
    p.add_argument("--repeats", type=int, default=3, help="timed steps per grid point (medians are fitted)")
    p.add_argument("--skip-transfer", action="store_true", help="no KV transfer part (single-pool plans only)")
    p.add_argument("--burst-threads", type=int, default=None, help="CPU: also time the pools' steps with this many "
                   "threads, as a pool of one worker bursts on one host (default: the usable cores where they "
                   "exceed --threads-per-worker; 0: not timed)")
    p.add_argument("--out", default="profile.json", help="where the profile goes")
    add_config_flags(p, ClusterConfig, only=LAYOUT_FIELDS)  # as `tandem serve`


# the settings that choose each kind of worker's CPU weight layout
LAYOUT_FIELDS = ("cpu_weight_layout", "prefill_weight_layout", "decode_weight_layout")


def planned_points(grid: Grid, repeats: int, decode_mixed: bool, colocated_prefill: bool,
                   colocated_decode: bool, burst_local_prefill: bool | None, transfer: bool) -> int:
    """The points ``measure`` times (its progress bar's total): each grid run counts its
    timed steps; ``burst_local_prefill`` None: no bursts, else whether the decode pool's
    prompts are timed apart from the prefill pool's; transfer: one point per size."""
    mixed = {(b, n): sizes for b, n, sizes in grid.mixed_setups}
    prefill = repeats * (len(grid.prefill_tokens) + len(grid.prefill_batches))

    def decode(with_mixed: bool) -> int:
        return sum(repeats + (len(mixed.get(tuple(s), ())) if with_mixed else 0) for s in grid.decode_setups)

    total = prefill + decode(decode_mixed)
    total += prefill if colocated_prefill else 0
    total += decode(True) if colocated_decode else 0
    if burst_local_prefill is not None:
        total += prefill * (2 if burst_local_prefill else 1) + decode(False)
    return total + (len(grid.transfer_mb) if transfer else 0)


def pool_layouts(cluster: ClusterConfig) -> dict[str, str]:
    """The CPU weight layout of each kind of worker, as the cluster gives them."""
    return {role: cluster.pool_layout(role) for role in ("prefill", "decode", "colocated")}


def measure(model: str, threads: int, prefill_nice: int, repeats: int, transfer: bool,
            progress=print, grid: Grid = Grid(), device: str = "cpu", kv_cache_gb: float | None = None,
            layouts: dict[str, str] | None = None, burst_threads: int = 0) -> dict[str, Any]:
    """The profile dict (schema ``SCHEMA``); Ray must be running. ``layouts``: each kind of
    worker's CPU weight layout (``pool_layouts``; default: the cluster's defaults);
    ``burst_threads`` > ``threads``: the pools' steps timed again with that many (CPU)."""
    import ray

    from tandem.bench.cpu_load import BackgroundSampler

    gpu = 1 if device.startswith("cuda") else 0
    layouts = dict(layouts or pool_layouts(ClusterConfig()))
    colo = layouts["colocated"]
    # a GPU engine has no CPU weight layouts: one profile serves every kind of worker
    colo_prefill = not gpu and colo != layouts["prefill"]
    colo_decode = not gpu and colo != layouts["decode"]
    actor_cls = ray.remote(StepTimer)
    blocks = grid_blocks(list(grid.prefill_tokens), list(grid.prefill_batches), list(grid.decode_setups),
                         list(grid.mixed_setups), repeats, CacheConfig().block_size,
                         SchedulerConfig().max_num_batched_tokens)
    actor_pids: list[int] = []
    bursting = burst_threads > threads and not gpu
    total = planned_points(grid, repeats, not colo_decode, colo_prefill, colo_decode,
                           layouts["decode"] != layouts["prefill"] if bursting else None, transfer)
    sampler = BackgroundSampler(lambda: [os.getpid(), *actor_pids]).start()
    colocated: dict[str, list[dict]] = {}

    def start(niceness: int, layout: str, n_threads: int = threads):
        actor = actor_cls.options(num_cpus=0, num_gpus=gpu).remote(model, n_threads, niceness, device, kv_cache_gb,
                                                                   layout, blocks=blocks)
        actor_pids[:] = [ray.get(actor.pid.remote())]
        return actor

    def prefill_grid(actor) -> list[dict]:
        points: list[dict] = []
        for k in range(repeats):  # one call per pass over the grid, warm-ups in the first: the bar moves
            done = ray.get(actor.prefill.remote(list(grid.prefill_tokens), list(grid.prefill_batches), 1,
                                                warmup=k == 0))
            points += done
            shown.update(len(done))
        return points

    def decode_grid(actor, mixed: bool) -> tuple[list[dict], list[dict]]:
        points: list[dict] = []
        mixed_points: list[dict] = []
        for setup in grid.decode_setups:  # one call per setup (each starts and drains its own): the bar moves
            done, done_mixed = ray.get(actor.decode.remote([setup], list(grid.mixed_setups) if mixed else [],
                                                           repeats))
            points += done
            mixed_points += done_mixed
            shown.update(len(done) + len(done_mixed))
        return points, mixed_points

    with bar(total, desc="tandem profile", unit="point") as shown:  # timed points, on a terminal only
        try:
            progress(f"prefill steps ({threads} thread(s), niceness {prefill_nice}, {layouts['prefill']} weights)")
            pre = start(prefill_nice, layouts["prefill"])
            try:
                limits = ray.get(pre.limits.remote())
                prefill_points = prefill_grid(pre)
            finally:
                ray.kill(pre)
            progress(f"decode {'' if colo_decode else 'and mixed '}steps ({layouts['decode']} weights)")
            dec = start(0, layouts["decode"])
            try:
                decode_points, mixed_points = decode_grid(dec, mixed=not colo_decode)
                if colo_prefill and not colo_decode:
                    progress(f"prefill steps of colocated workers ({colo} weights)")
                    colocated["prefill"] = prefill_grid(dec)
            finally:
                ray.kill(dec)
            if colo_decode:
                progress(f"decode and mixed steps of colocated workers ({colo} weights)")
                both = start(0, colo)
                try:
                    colocated["decode"], mixed_points = decode_grid(both, mixed=True)
                    if colo_prefill:
                        colocated["prefill"] = prefill_grid(both)
                finally:
                    ray.kill(both)
            burst = burst_points(start, prefill_grid, decode_grid, layouts, prefill_nice, burst_threads, progress) \
                if bursting else None
        finally:
            background = sampler.stop()
        meta = runinfo.describe()
        out: dict[str, Any] = {
            "schema": SCHEMA, "meta": meta,
            "hardware": {"cpu": meta["machine"]["cpu"], "cores": meta["machine"]["cpus_usable"] or os.cpu_count(),
                         "device": limits.pop("device"), "gpu": limits.pop("gpu")},
            "model": limits.pop("model"), "engine": limits,
            "worker": {"threads_per_worker": threads, "prefill_nice": prefill_nice, "weight_layouts": layouts,
                       "kind": f"gpu-{limits.get('dtype')}" if gpu else f"cpu-{threads}t"},
            # mixed steps are a colocated worker's, on its layout
            "points": {"prefill": prefill_points, "decode": decode_points, "mixed": mixed_points,
                       "colocated": colocated, **({"burst": burst} if burst else {})},
            # cores other processes used meanwhile: `tandem plan` scales the steps back to a quiet machine
            "background": {"cores_mean": background, "samples": len(sampler.samples)},
        }
        if transfer:
            from tandem.bench.transfer import bandwidth

            progress(f"KV transfer ({'nccl' if gpu else 'gloo'}, two actors)")
            rows = bandwidth(model, list(grid.transfer_mb), max(3, repeats), "nccl" if gpu else "gloo")
            shown.update(len(rows))
            tpoints = [{"bytes": r["mb"] * 2**20, "seconds": r["mb"] * 2**20 / (r["kv_per_layer_gb_s"] * 1e9)}
                       for r in rows]
            out["points"]["transfer"] = tpoints
    return fit(out)


def burst_points(start, prefill_grid, decode_grid, layouts: dict[str, str], prefill_nice: int,
                 burst_threads: int, progress) -> dict[str, Any]:
    """The grids a bursting worker runs, with ``burst_threads``: a prefill worker's prompts
    (its layout and niceness), a decode worker's steps and its local prompts (its layout)."""
    import ray

    out: dict[str, Any] = {"threads": burst_threads}
    progress(f"bursts: prefill steps ({burst_threads} threads, {layouts['prefill']} weights)")
    pre = start(prefill_nice, layouts["prefill"], burst_threads)
    try:
        out["prefill"] = prefill_grid(pre)
    finally:
        ray.kill(pre)
    progress(f"bursts: decode steps and prompts ({burst_threads} threads, {layouts['decode']} weights)")
    dec = start(0, layouts["decode"], burst_threads)
    try:
        out["decode"] = decode_grid(dec, mixed=False)[0]
        out["local_prefill"] = out["prefill"] if layouts["decode"] == layouts["prefill"] else prefill_grid(dec)
    finally:
        ray.kill(dec)
    return out


def fit(prof: dict[str, Any]) -> dict[str, Any]:
    """Fit the models to a profile's points (``prof["fit"]``), and check the step model on
    the mixed steps it was not fitted on (``predicted_seconds`` on each)."""
    pts = prof["points"]
    pools = StepModel(PrefillModel.fit(pts["prefill"]), DecodeModel.fit(pts["decode"]))
    own = pts.get("colocated") or {}  # colocated workers' own grids (profiles before: none)
    colocated = StepModel(PrefillModel.fit(own["prefill"]) if own.get("prefill") else pools.prefill,
                          DecodeModel.fit(own["decode"]) if own.get("decode") else pools.decode)
    prof["fit"] = {"prefill": pools.prefill.to_json(), "decode": pools.decode.to_json(),
                   "colocated": {"prefill": colocated.prefill.to_json(), "decode": colocated.decode.to_json()}}
    for p in pts["mixed"]:
        p["predicted_seconds"] = colocated.step(p["prefill_tokens"], attention_pairs(p["prefill_tokens"]),
                                                p["batch"], p["context"])
    if pts.get("transfer"):
        prof["fit"]["transfer"] = TransferModel.fit(pts["transfer"]).to_json()
    if pts.get("burst"):
        b = pts["burst"]
        prof["fit"]["burst"] = {"threads": b["threads"], "prefill": PrefillModel.fit(b["prefill"]).to_json(),
                                "decode": DecodeModel.fit(b["decode"]).to_json(),
                                "local_prefill": PrefillModel.fit(b["local_prefill"]).to_json()}
    return prof


def background_cores(prof: dict[str, Any]) -> float | None:
    """The cores other processes used while the profile was taken (None: not measured)."""
    bg = prof.get("background") or {}
    # profiles before the CPU-time measurement counted runnable threads at sampling instants
    return bg.get("cores_mean", bg.get("runnable_threads_mean"))


def _print_steps(label: str, prefill: dict[str, float] | None, decode: dict[str, float] | None) -> None:
    if prefill is not None:
        pre = PrefillModel.from_json(prefill)
        print(f"{label}prefill step: {1e3 * pre.base:.2f} ms + {1e3 * pre.per_token:.3f} ms/token + "
              f"{1e6 * pre.per_pair:.4f} us per attention pair; one prompt of " +
              ", ".join(f"{n}: {1e3 * pre(n):.0f} ms" for n in (128, 512, 1024, 2048)))
    if decode is not None:
        print(f"{label}decode step: {1e3 * decode['base']:.2f} ms + {1e3 * decode['per_seq']:.3f} ms/seq + "
              f"{1e6 * decode['per_ctx']:.3f} us per context token")


def print_profile(prof: dict[str, Any]) -> None:
    f = prof["fit"]
    print(runinfo.machine_line())
    bg = background_cores(prof)
    if bg is not None:
        print(f"other processes kept {bg:.2f} cores busy on average while the steps were timed")
    print(f"model {prof['model']['path']} ({prof['engine']['dtype']}), {prof['worker']['threads_per_worker']} "
          f"thread(s) per worker; budget {prof['engine']['max_num_batched_tokens']} tokens per step")
    layouts = prof["worker"].get("weight_layouts")
    if layouts:
        print("weight layouts: " + ", ".join(f"{role} {layout}" for role, layout in layouts.items()))
    _print_steps("", f["prefill"], f["decode"])
    own = prof["points"].get("colocated") or {}
    if own:  # colocated workers' own layout
        _print_steps("colocated ", f["colocated"]["prefill"] if "prefill" in own else None,
                     f["colocated"]["decode"] if "decode" in own else None)
    mixed = prof["points"]["mixed"]
    if mixed:
        errs = [abs(p["predicted_seconds"] / p["seconds"] - 1) for p in mixed]
        print(f"mixed steps (decodes + a prefill chunk), additive model vs measured: mean |error| "
              f"{sum(errs) / len(errs):.0%}, max {max(errs):.0%} over {len(errs)} steps")
    if "burst" in f:
        b = f["burst"]
        _print_steps(f"bursts ({b['threads']} threads): ", b["prefill"], b["decode"])
    if "transfer" in f:
        t = f["transfer"]
        bw = TransferModel.from_json(t).bytes_per_s
        print(f"KV transfer: {1e3 * t['latency_s']:.2f} ms + bytes at {bw / 1e9:.2f} GB/s "
              f"({prof['engine']['kv_bytes_per_token']} bytes per token)")


def load(path: str | Path) -> dict[str, Any]:
    """A saved profile, its models fitted again from its points (the points are the record;
    the saved fits are for reading); ValueError when it is not one."""
    try:
        prof = json.loads(Path(path).read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not JSON: {e}") from None
    if not isinstance(prof, dict) or prof.get("schema") != SCHEMA:
        raise ValueError(f"{path} is not a tandem profile (schema {SCHEMA})")
    try:
        return fit(prof)
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{path}: a tandem profile without usable points ({e})") from None


def main(args: argparse.Namespace) -> int:
    import ray

    from tandem.cluster.ray_start import RayRuntime
    from tandem.common.config import check_device
    from tandem.engine.default_model import default_model_path
    from tandem.worker.threads import usable_cores

    if args.threads_per_worker < 1:
        raise ValueError("--threads-per-worker must be >= 1")
    if args.repeats < 1:
        raise ValueError("--repeats must be >= 1")
    if args.kv_cache_gb is not None and args.kv_cache_gb <= 0:
        raise ValueError("--kv-cache-gb must be > 0")
    if args.burst_threads is not None and args.burst_threads < 0:
        raise ValueError("--burst-threads must be >= 0")
    model = str(args.model or default_model_path("bench"))
    layouts = pool_layouts(ClusterConfig(
        engine=EngineConfig(cpu_weight_layout=args.cpu_weight_layout),
        prefill_weight_layout=args.prefill_weight_layout, decode_weight_layout=args.decode_weight_layout))
    t0 = time.perf_counter()
    runtime = RayRuntime() if not ray.is_initialized() else None
    if runtime is not None:
        runtime.start()
    try:
        prof = measure(model, args.threads_per_worker, args.prefill_nice, args.repeats, not args.skip_transfer,
                       progress=lambda m: print(f"[{time.perf_counter() - t0:5.1f}s] {m}", flush=True),
                       device=check_device(args.device), kv_cache_gb=args.kv_cache_gb, layouts=layouts,
                       burst_threads=usable_cores() if args.burst_threads is None else args.burst_threads)
    finally:
        if runtime is not None:
            runtime.stop()
    prof["meta"]["profile_seconds"] = time.perf_counter() - t0
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(prof, indent=1))
    print_profile(prof)
    print(f"profile: {args.out} ({prof['meta']['profile_seconds']:.0f} s)")
    return 0
