"""The NCCL path through cupy: a 1-rank communicator sending to itself inside a group call
(NCCL refuses two ranks on one GPU), the KV staging layout on CUDA, and a real pair of
Ray actors over ``ray.util.collective`` nccl where two GPUs exist."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu
cupy = pytest.importorskip("cupy")


def _self_send(payload: torch.Tensor) -> torch.Tensor:
    from cupy.cuda import nccl

    comm = nccl.NcclCommunicator(1, nccl.get_unique_id(), 0)
    out = torch.zeros_like(payload)
    stream = torch.cuda.current_stream().cuda_stream
    nccl.groupStart()
    comm.send(payload.data_ptr(), payload.numel(), nccl.NCCL_UINT8, 0, stream)
    comm.recv(out.data_ptr(), out.numel(), nccl.NCCL_UINT8, 0, stream)
    nccl.groupEnd()
    torch.cuda.synchronize()
    return out


def test_one_rank_self_send_moves_bytes_exactly():
    payload = torch.randint(0, 256, (8 << 20,), dtype=torch.uint8, device="cuda")
    assert torch.equal(_self_send(payload), payload)


def test_kv_blocks_survive_gather_send_scatter_on_cuda():
    from services.engine.kv_cache.paged_cache import PagedKVCache

    src = PagedKVCache(4, 64, 16, 2, 64, torch.bfloat16, torch.device("cuda"))
    dst = PagedKVCache(4, 64, 16, 2, 64, torch.bfloat16, torch.device("cuda"))
    src.kv.normal_()
    blocks_src, blocks_dst = [3, 9, 10, 41], [0, 1, 2, 63]
    for layers in (range(0, 2), range(2, 4)):
        data = src.gather(blocks_src, layers)
        received = _self_send(data.view(-1).view(torch.uint8))
        dst.scatter(blocks_dst, layers, received.view(torch.bfloat16).view(data.shape))
    assert torch.equal(dst.kv[:, :, blocks_dst], src.kv[:, :, blocks_src])


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="a real NCCL pair needs two GPUs")
def test_cluster_over_nccl_matches_offline(tiny_model_dir):
    import asyncio

    import ray

    from services.cluster.cluster import Cluster
    from services.common.config import CacheConfig, ClusterConfig, EngineConfig
    from services.common.sampling_params import SamplingParams
    from services.engine import LLM

    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    prompts = [[5 + i] * n for i, n in enumerate((3, 40, 130))]
    reference = [o.outputs[0].token_ids
                 for o in LLM(str(tiny_model_dir), device="cuda").generate(prompts, params)]
    ray.init(num_gpus=2, include_dashboard=False)
    cluster = Cluster(ClusterConfig(
        engine=EngineConfig(model=str(tiny_model_dir), device="cuda", cache=CacheConfig(num_blocks=64)),
        gpus_per_worker=1, transfer_backend="nccl")).start()
    try:
        async def one(p):
            return [t async for d in cluster.generate(p, params) for t in d.token_ids]

        async def main():
            return await asyncio.gather(*(one(p) for p in prompts))
        assert asyncio.run(main()) == reference
    finally:
        cluster.shutdown()
        ray.shutdown()
