"""The GPU transfer path: a 1-rank communicator sending to itself inside a group call
(NCCL refuses two ranks on one GPU), the KV staging layout on CUDA, streams that do not
wait for each other, the two-process KV pair check over CUDA IPC on one GPU and over NCCL
where two GPUs exist, and a real cluster of Ray actors over NCCL on two GPUs."""

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
    from tandem.engine.kv_cache.paged_cache import PagedKVCache

    src = PagedKVCache(4, 64, 16, 2, 64, torch.bfloat16, torch.device("cuda"))
    dst = PagedKVCache(4, 64, 16, 2, 64, torch.bfloat16, torch.device("cuda"))
    src.kv.normal_()
    blocks_src, blocks_dst = [3, 9, 10, 41], [0, 1, 2, 63]
    for layers in (range(0, 2), range(2, 4)):
        data = src.gather(blocks_src, layers)
        received = _self_send(data.view(-1).view(torch.uint8))
        dst.scatter(blocks_dst, layers, received.view(torch.bfloat16).view(data.shape))
    assert torch.equal(dst.kv[:, :, blocks_dst], src.kv[:, :, blocks_src])


def test_a_busy_transfer_stream_never_holds_up_compute():
    """The stream-ordering probe: work pending on a transfer stream (as a receive posted
    for an idle peer) does not delay compute on the worker's compute stream."""
    from tandem.transfer.device_sync import CudaSync, wait_until_done

    sync = CudaSync(torch.device("cuda", torch.cuda.current_device()))
    transfer, compute = sync.new_stream("kv"), sync.new_stream("compute")
    with sync.use(transfer):
        torch.cuda._sleep(int(5e9))  # seconds of a busy kernel: a receive nobody answers
    transfer_done = sync.record_event(transfer)
    with sync.use(compute):
        x = torch.randn(512, 512, device=sync.device)
        y = x @ x
    compute_done = sync.record_event(compute, timing=True)
    wait_until_done(sync, compute_done, 30.0)
    assert not sync.event_done(transfer_done), "compute waited for the transfer stream"
    assert torch.isfinite(y).all()
    torch.cuda.synchronize()


def _pair_check(devices):
    from tandem.transfer.pair_check import check_pair

    return check_pair("auto", devices, num_blocks=64, repeats=4, timeout_s=120)


def test_kv_pair_over_cuda_ipc_on_one_gpu():
    result = _pair_check(("cuda:0", "cuda:0"))
    assert result.error is None, result.error
    assert result.kind == "ipc" and result.intact
    print(f"\n[ipc] {result.num_bytes / 1e6:.1f} MB per transfer, median "
          f"{result.gbps:.1f} GB/s, seconds {[round(x, 5) for x in result.seconds]}")


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="a real NCCL pair needs two GPUs")
def test_kv_pair_over_nccl_between_two_gpus():
    result = _pair_check(("cuda:0", "cuda:1"))
    assert result.error is None, result.error
    assert result.kind == "nccl" and result.intact
    print(f"\n[nccl] {result.num_bytes / 1e6:.1f} MB per transfer, median "
          f"{result.gbps:.1f} GB/s")


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="a real NCCL pair needs two GPUs")
def test_cluster_over_nccl_matches_offline(tiny_model_dir):
    import asyncio

    import ray

    from tandem.cluster.cluster import Cluster
    from tandem.common.config import CacheConfig, ClusterConfig, EngineConfig
    from tandem.common.sampling_params import SamplingParams
    from tandem.engine import LLM

    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    prompts = [[5 + i] * n for i, n in enumerate((3, 40, 130))]
    reference = [o.outputs[0].token_ids
                 for o in LLM(str(tiny_model_dir), device="cuda").generate(prompts, params)]
    ray.init(num_gpus=2, include_dashboard=False)
    cluster = Cluster(ClusterConfig(
        engine=EngineConfig(model=str(tiny_model_dir), device="cuda", cache=CacheConfig(num_blocks=64)),
        transfer_backend="nccl")).start()  # one GPU per worker by default on CUDA
    try:
        async def one(p):
            return [t async for d in cluster.generate(p, params) for t in d.token_ids]

        async def main():
            return await asyncio.gather(*(one(p) for p in prompts))
        assert asyncio.run(main()) == reference
    finally:
        cluster.shutdown()
        ray.shutdown()
