"""``tandem profile``: what an engine step and a KV transfer cost on this hardware.

Measured on real engines in Ray actors set up as the cluster's workers are (torch and
OpenMP threads per worker, the prefill pool's niceness; one actor at a time, so the
figures are the worker alone on its cores):

- prefill: steps of one prompt of 16..2048 tokens, and of several prompts at once;
- decode: steps of batch 1..48 at several contexts, and mixed steps (decodes plus a
  prefill chunk, as chunked prefill schedules them) to check the additive model;
- KV transfer: the KV protocol between two actors over gloo (nccl with ``--device cuda``)
  (``services.bench.transfer.bandwidth``), 0.25..16 MB.

Writes one JSON (schema ``SCHEMA``) with every timed point, the fitted models
(``services.bench.perf_model``), the hardware, the model and the engine's batching
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

from services.bench import runinfo
from services.bench.perf_model import DecodeModel, PrefillModel, StepModel, TransferModel, attention_pairs

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
    p.add_argument("--kv-cache-gb", type=float, default=0.25, help="KV cache of the timed engines (the grid needs "
                   "~0.2 GB on the bench model; as `tandem serve --kv-cache-gb` otherwise)")
    p.add_argument("--prefill-nice", type=int, default=0, help="niceness of the prefill pool (as `tandem serve`)")
    p.add_argument("--repeats", type=int, default=3, help="timed steps per grid point (medians are fitted)")
    p.add_argument("--skip-transfer", action="store_true", help="no KV transfer part (single-pool plans only)")
    p.add_argument("--out", default="profile.json", help="where the profile goes")


class _Profiler:
    """One engine in a Ray actor, configured as a worker of the cluster."""

    def __init__(self, model: str, threads: int, niceness: int, device: str = "cpu", kv_cache_gb: float = 0.25,
                 seed: int = 0) -> None:
        import numpy as np
        import torch

        from services.common.config import CacheConfig, EngineConfig
        from services.engine.engine import LLMEngine

        if niceness:
            os.nice(niceness)
        os.environ["OMP_NUM_THREADS"] = str(threads)  # as EngineWorker does
        torch.set_num_threads(threads)
        self.config = EngineConfig(model=model, num_threads=threads, device=device,
                                   cache=CacheConfig(memory_gb=kv_cache_gb, enable_prefix_caching=False))
        self.engine = LLMEngine(self.config)
        self.rng = np.random.default_rng(seed)
        self.n = 0

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


def measure(model: str, threads: int, prefill_nice: int, repeats: int, transfer: bool,
            progress=print, grid: Grid = Grid(), device: str = "cpu", kv_cache_gb: float = 0.25) -> dict[str, Any]:
    """The profile dict (schema ``SCHEMA``); Ray must be running."""
    import ray

    from services.bench.cpu_load import BackgroundSampler

    gpu = 1 if device.startswith("cuda") else 0
    actor_cls = ray.remote(_Profiler)
    actor_pids: list[int] = []
    sampler = BackgroundSampler(lambda: [os.getpid(), *actor_pids]).start()
    try:
        progress(f"prefill steps ({threads} thread(s), niceness {prefill_nice})")
        pre = actor_cls.options(num_cpus=0, num_gpus=gpu).remote(model, threads, prefill_nice, device, kv_cache_gb)
        try:
            actor_pids[:] = [ray.get(pre.pid.remote())]
            limits = ray.get(pre.limits.remote())
            prefill_points = ray.get(pre.prefill.remote(list(grid.prefill_tokens), list(grid.prefill_batches),
                                                        repeats))
        finally:
            ray.kill(pre)
        progress("decode and mixed steps")
        dec = actor_cls.options(num_cpus=0, num_gpus=gpu).remote(model, threads, 0, device, kv_cache_gb)
        try:
            actor_pids[:] = [ray.get(dec.pid.remote())]
            decode_points, mixed_points = ray.get(dec.decode.remote(list(grid.decode_setups),
                                                                     list(grid.mixed_setups), repeats))
        finally:
            ray.kill(dec)
    finally:
        background = sampler.stop()
    out: dict[str, Any] = {
        "schema": SCHEMA, "meta": runinfo.describe(),
        "hardware": {"cpu": runinfo.machine()["cpu"], "cores": len(os.sched_getaffinity(0)),
                     "device": limits.pop("device"), "gpu": limits.pop("gpu")},
        "model": limits.pop("model"), "engine": limits,
        "worker": {"threads_per_worker": threads, "prefill_nice": prefill_nice,
                   "kind": f"gpu-{limits.get('dtype')}" if gpu else f"cpu-{threads}t"},
        "points": {"prefill": prefill_points, "decode": decode_points, "mixed": mixed_points},
        # cores other processes used meanwhile: `tandem plan` scales the steps back to a quiet machine
        "background": {"cores_mean": background, "samples": len(sampler.samples)},
    }
    if transfer:
        from services.bench.transfer import bandwidth

        progress(f"KV transfer ({'nccl' if gpu else 'gloo'}, two actors)")
        rows = bandwidth(model, list(grid.transfer_mb), max(3, repeats), "nccl" if gpu else "gloo")
        tpoints = [{"bytes": r["mb"] * 2**20, "seconds": r["mb"] * 2**20 / (r["kv_per_layer_gb_s"] * 1e9)}
                   for r in rows]
        out["points"]["transfer"] = tpoints
    return fit(out)


def fit(prof: dict[str, Any]) -> dict[str, Any]:
    """Fit the models to a profile's points (``prof["fit"]``), and check the step model on
    the mixed steps it was not fitted on (``predicted_seconds`` on each)."""
    pts = prof["points"]
    steps = StepModel(PrefillModel.fit(pts["prefill"]), DecodeModel.fit(pts["decode"]))
    prof["fit"] = {"prefill": steps.prefill.to_json(), "decode": steps.decode.to_json()}
    for p in pts["mixed"]:
        p["predicted_seconds"] = steps.step(p["prefill_tokens"], attention_pairs(p["prefill_tokens"]),
                                            p["batch"], p["context"])
    if pts.get("transfer"):
        prof["fit"]["transfer"] = TransferModel.fit(pts["transfer"]).to_json()
    return prof


def background_cores(prof: dict[str, Any]) -> float | None:
    """The cores other processes used while the profile was taken (None: not measured)."""
    bg = prof.get("background") or {}
    # profiles before the CPU-time measurement counted runnable threads at sampling instants
    return bg.get("cores_mean", bg.get("runnable_threads_mean"))


def print_profile(prof: dict[str, Any]) -> None:
    f = prof["fit"]
    print(runinfo.machine_line())
    bg = background_cores(prof)
    if bg is not None:
        print(f"other processes kept {bg:.2f} cores busy on average while the steps were timed")
    print(f"model {prof['model']['path']} ({prof['engine']['dtype']}), {prof['worker']['threads_per_worker']} "
          f"thread(s) per worker; budget {prof['engine']['max_num_batched_tokens']} tokens per step")
    pre = PrefillModel.from_json(f["prefill"])
    print(f"prefill step: {1e3 * pre.base:.2f} ms + {1e3 * pre.per_token:.3f} ms/token + "
          f"{1e6 * pre.per_pair:.4f} us per attention pair; one prompt of " +
          ", ".join(f"{n}: {1e3 * pre(n):.0f} ms" for n in (128, 512, 1024, 2048)))
    d = f["decode"]
    print(f"decode step: {1e3 * d['base']:.2f} ms + {1e3 * d['per_seq']:.3f} ms/seq + "
          f"{1e6 * d['per_ctx']:.3f} us per context token")
    mixed = prof["points"]["mixed"]
    if mixed:
        errs = [abs(p["predicted_seconds"] / p["seconds"] - 1) for p in mixed]
        print(f"mixed steps (decodes + a prefill chunk), additive model vs measured: mean |error| "
              f"{sum(errs) / len(errs):.0%}, max {max(errs):.0%} over {len(errs)} steps")
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

    from services.cluster.ray_start import RayRuntime
    from services.common.config import check_device
    from services.engine.default_model import default_model_path

    if args.threads_per_worker < 1:
        raise ValueError("--threads-per-worker must be >= 1")
    if args.repeats < 1:
        raise ValueError("--repeats must be >= 1")
    if args.kv_cache_gb <= 0:
        raise ValueError("--kv-cache-gb must be > 0")
    model = str(args.model or default_model_path("bench"))
    t0 = time.perf_counter()
    runtime = RayRuntime() if not ray.is_initialized() else None
    if runtime is not None:
        runtime.start()
    try:
        prof = measure(model, args.threads_per_worker, args.prefill_nice, args.repeats, not args.skip_transfer,
                       progress=lambda m: print(f"[{time.perf_counter() - t0:5.1f}s] {m}", flush=True),
                       device=check_device(args.device), kv_cache_gb=args.kv_cache_gb)
    finally:
        if runtime is not None:
            runtime.stop()
    prof["meta"]["profile_seconds"] = time.perf_counter() - t0
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(prof, indent=1))
    print_profile(prof)
    print(f"profile: {args.out} ({prof['meta']['profile_seconds']:.0f} s)")
    return 0
