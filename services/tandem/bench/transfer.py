"""``tandem bench transfer``: the KV protocol's bandwidth against raw collective send/recv,
and the TTFT / second-token latency disaggregation adds over colocated serving.

Part 1 runs two Ray actors in one gloo (or nccl) group. Each holds a paged KV
cache shaped like the checkpoint's; the protocol moves the same bytes as a raw
send/recv into a preallocated buffer, in the same run (raw first: a receiver
thread parked on a peer must be that peer's only reader): in place where the
blocks are consecutive on both sides (header, then one message per layer, K|V
and run, straight from and into the caches), and gathered (gather into
staging, header, send; receive, scatter into the reserved blocks) as when
blocks are scattered.
Part 2 starts a disaggregated cluster (layer-wise streaming on, then off) and a
colocated one with the same worker count, and times single requests.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import statistics
import time

from tandem.bench import runinfo


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="local HF folder (default: the bench preset)")
    p.add_argument("--sizes-mb", default="1,16,128", help="transfer sizes for part 1")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--prompt-lens", default="128,1024,2048", help="prompt lengths for part 2")
    p.add_argument("--ttft-repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    p.add_argument("--skip-ttft", action="store_true")
    p.add_argument("--json", default=None)


class _Peer:
    """One end of the bandwidth test (a Ray actor)."""

    def __init__(self, model: str, num_blocks: int, rank: int, group: str, backend: str) -> None:
        import torch

        from tandem.engine.kv_cache.paged_cache import PagedKVCache
        from tandem.engine.model.config import ModelConfig
        from tandem.transfer.channel import CollectiveChannel

        mc = ModelConfig.from_dir(model)
        dev = torch.device("cuda" if backend == "nccl" else "cpu")
        self.cache = PagedKVCache(mc.num_layers, num_blocks, 16, mc.num_kv_heads, mc.head_dim,
                                  torch.float32, dev)
        self.cache.kv.normal_()
        self.rank, self.group, self.backend = rank, group, backend
        peer = 1 - rank
        if backend == "nccl":
            from tandem.transfer.endpoint import open_channel
            from tandem.transfer.device_sync import make_sync

            self.channel = open_channel({peer: "nccl"}, 2, rank, group, make_sync(dev),
                                        senders=[0] if rank == 1 else [])
        else:
            self.channel = CollectiveChannel(2, rank, group, [peer])
        self.torch = torch
        self.reports = []
        self.sender = self.receiver = None  # one each for the actor's life: a receiver's
        # thread blocks in recv, so a second one on the same peer would steal its messages

    def _done(self, op: str, tensor, peer: int) -> None:
        """A send or receive, returned once it completed on the device (NCCL queues them)."""
        ch = self.channel
        with ch.sync.use(ch.stream(peer)):
            getattr(ch, op)(tensor, peer)
            ch.wait(ch.sync.record_event(ch.stream(peer)), f"{op} with rank {peer}")

    def raw(self, num_bytes: int, repeats: int) -> list[float]:
        buf = self.torch.ones(num_bytes, dtype=self.torch.uint8, device=self.channel.device)
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            if self.rank == 0:
                self._done("send", buf, 1)
                self._done("recv", buf[:1], 1)  # ack: the receiver has it all
            else:
                self._done("recv", buf, 0)
                self._done("send", buf[:1], 0)
            times.append(time.perf_counter() - t0)
        return times

    def protocol(self, num_blocks: int, groups: int, repeats: int,
                 in_place: bool = True) -> list[float]:
        from tandem.protocol.messages import layer_groups
        from tandem.transfer.receiver import KVReceiver
        from tandem.transfer.sender import KVSender, SendJob

        blocks = list(range(num_blocks))
        layer_ranges = [g.layers for g in layer_groups(self.cache.num_layers,
                                                       -(-self.cache.num_layers // groups))]
        ack = self.torch.zeros(1, dtype=self.torch.uint8, device=self.channel.device)
        times = []
        if self.rank == 0:
            if self.sender is None:
                self.sender = KVSender(self.channel, self.cache.gather, self.cache.block_shape,
                                       self.cache.dtype, self.reports.append, self.cache.plane,
                                       self.cache.plane_block_bytes)
            self.reports.clear()
            self._done("recv", ack, 1)  # the receiver expects the first transfer
            for r in range(repeats):
                t0 = time.perf_counter()
                for g, layers in enumerate(layer_ranges):
                    self.sender.submit(SendJob(f"t{groups}{'p' if in_place else 'g'}-{r}", 1,
                                               blocks, layers, g,
                                               g == len(layer_ranges) - 1,
                                               dst_block_ids=blocks if in_place else ()))
                while len(self.reports) <= r:
                    time.sleep(0.0005)
                self._done("recv", ack, 1)
                times.append(time.perf_counter() - t0)
        else:
            if self.receiver is None:
                self.receiver = KVReceiver(self.channel, [0], self.cache.scatter,
                                           self.cache.block_shape, self.cache.dtype,
                                           self.cache.plane, self.cache.plane_block_bytes)
            tag = f"t{groups}{'p' if in_place else 'g'}"
            self.receiver.expect(f"{tag}-0", 0, blocks, layer_ranges)
            self._done("send", ack, 0)
            for r in range(repeats):
                pt = self.receiver.wait(f"{tag}-{r}", 60.0)
                assert pt.status.name == "DONE", pt.error
                self.receiver.forget(f"{tag}-{r}")
                if r + 1 < repeats:  # expected before the ack lets the sender go on
                    self.receiver.expect(f"{tag}-{r + 1}", 0, blocks, layer_ranges)
                self._done("send", ack, 0)
        return times


def bandwidth(model: str, sizes_mb: list[float], repeats: int, backend: str = "gloo") -> list[dict]:
    import ray

    from tandem.engine.kv_cache.paged_cache import PagedKVCache
    from tandem.engine.model.config import ModelConfig

    mc = ModelConfig.from_dir(model)
    block = PagedKVCache.bytes_per_block(mc.num_layers, 16, mc.num_kv_heads, mc.head_dim,
                                         __import__("torch").float32)
    max_blocks = max(1, int(max(sizes_mb) * 2**20 // block))
    group = f"bench-kv-{time.time_ns()}"
    peers = [ray.remote(_Peer).options(num_cpus=0).remote(model, max_blocks, r, group, backend)
             for r in range(2)]
    rows = []
    sizes = [max(1, int(mb * 2**20 // block)) for mb in sizes_mb]
    try:
        # Raw first: once a receiver thread is parked in recv on a peer, no other
        # thread may receive from that peer.
        raw = [ray.get([p.raw.remote(n * block, repeats) for p in peers])[0] for n in sizes]
        for n_blocks, raw_times in zip(sizes, raw):
            nbytes = n_blocks * block
            kv = ray.get([p.protocol.remote(n_blocks, mc.num_layers, repeats) for p in peers])[0]
            kv1 = ray.get([p.protocol.remote(n_blocks, 1, repeats) for p in peers])[0]
            kvg = ray.get([p.protocol.remote(n_blocks, 1, repeats, False) for p in peers])[0]
            r, k, k1, kg = (statistics.median(x) for x in (raw_times, kv, kv1, kvg))
            rows.append(dict(mb=nbytes / 2**20, raw_gb_s=nbytes / r / 1e9,
                             kv_per_layer_gb_s=nbytes / k / 1e9, kv_one_group_gb_s=nbytes / k1 / 1e9,
                             kv_gathered_gb_s=nbytes / kg / 1e9, ratio_per_layer=r / k,
                             ratio_one_group=r / k1, ratio_gathered=r / kg))
    finally:
        for p in peers:
            ray.kill(p)
    return rows


def ttft(model: str, prompt_lens: list[int], repeats: int, threads: int) -> list[dict]:
    from tandem.cluster.cluster import Cluster
    from tandem.common.config import CacheConfig, ClusterConfig, EngineConfig
    from tandem.common.sampling_params import SamplingParams

    engine = EngineConfig(model=model, cache=CacheConfig(memory_gb=0.5),
                          scheduler=dataclasses.replace(EngineConfig().scheduler,
                                                        max_num_batched_tokens=4096))
    setups = {"colocated": dict(mode="colocated"),
              "disagg_layerwise": dict(layer_group_size=1),
              "disagg_one_group": dict(layer_group_size=None)}
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    out = []
    for name, kw in setups.items():
        cluster = Cluster(ClusterConfig(engine=engine, threads_per_worker=threads,
                                        decode_burst_threads=0, prefill_burst_threads=0,
                                        **kw)).start()
        try:
            for n in prompt_lens:
                firsts, seconds = [], []
                for r in range(repeats + 1):
                    prompt = [(7 * i + r * 13) % 900 + 3 for i in range(n)]  # no prefix hits

                    async def one():
                        t0 = time.perf_counter()
                        stamps = []
                        async for d in cluster.generate(prompt, params):
                            stamps += [time.perf_counter() - t0] * len(d.token_ids)
                        return stamps
                    stamps = asyncio.run(one())
                    if r:  # the first run warms up
                        firsts.append(stamps[0])
                        seconds.append(stamps[1])
                out.append(dict(setup=name, prompt_len=n, ttft_ms=1e3 * statistics.median(firsts),
                                second_token_ms=1e3 * statistics.median(seconds)))
        finally:
            cluster.shutdown()
    return out


def main(args: argparse.Namespace) -> int:
    import ray

    from tandem.engine.default_model import default_model_path

    model = str(args.model or default_model_path("bench"))
    if not ray.is_initialized():
        ray.init(include_dashboard=False, log_to_driver=False, configure_logging=False)
    result: dict = {"model": model}
    rows = bandwidth(model, [float(s) for s in args.sizes_mb.split(",")], args.repeats)
    result["bandwidth"] = rows
    print(runinfo.machine_line())
    print(f"KV transfer vs raw gloo send/recv, same bytes, same run ({model}):")
    print("(KV/layer, KV/1grp: runs sent in place where they pay off, per-layer groups or one "
          "group; gathered: one group through the gather/scatter copies)")
    print(f"{'MB':>8} {'raw GB/s':>9} {'KV/layer':>9} {'ratio':>6} {'KV/1grp':>9} {'ratio':>6} "
          f"{'gathered':>9} {'ratio':>6}")
    for r in rows:
        print(f"{r['mb']:8.1f} {r['raw_gb_s']:9.2f} {r['kv_per_layer_gb_s']:9.2f} "
              f"{r['ratio_per_layer']:6.2f} {r['kv_one_group_gb_s']:9.2f} {r['ratio_one_group']:6.2f} "
              f"{r['kv_gathered_gb_s']:9.2f} {r['ratio_gathered']:6.2f}")
    if not args.skip_ttft:
        lens = [int(x) for x in args.prompt_lens.split(",")]
        rows = ttft(model, lens, args.ttft_repeats, args.threads)
        result["ttft"] = rows
        print("\nsingle requests at low load (median ms):")
        print(f"{'setup':>18} {'prompt':>7} {'TTFT':>8} {'token 2':>8}")
        for r in rows:
            print(f"{r['setup']:>18} {r['prompt_len']:7d} {r['ttft_ms']:8.1f} {r['second_token_ms']:8.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0
