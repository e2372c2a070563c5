"""Reduced precision on the real cluster: a bf16 or int8 engine serves, in every mode, the
tokens the offline engine with the same precision gives, and for seeded sampling its
logprobs to the bit, again when the prompts hit the prefix cache (int8 on the native
kernels, bf16 on AMX; real Ray actors; in disaggregated mode the KV crosses gloo in the
engine's dtype)."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest
import torch

from tandem.cluster.cluster import Cluster
from tandem.common.sampling_params import SamplingParams
from tandem.engine import LLM
from tandem.engine.kernels import onednn, quantized
from tests.integration.test_cluster import (GREEDY, LENGTHS, _config, block_bytes, prompts,  # noqa: F401
                                           run_all, wait_all_free)

PRECISIONS = {"bf16": {"dtype": "bfloat16"}, "int8": {"quantization": "int8"}}
KV_BYTES_PER_FP32 = {"bf16": 0.5, "int8": 1.0}  # int8 quantizes weights only


LOCAL_BELOW = 20  # conditional mode: shorter prompts prefill on the decode worker
# where each precision's kernels compute a row alike in any batch
def _native_bf16() -> bool:
    """bf16 weights packed for a native kernel (AMX, or AVX-512 without it), not oneDNN's."""
    return onednn.storage_layout("packed", torch.bfloat16, True) in onednn.PAIR_PACKED


BIT_EXACT = {"bf16": _native_bf16, "int8": lambda: quantized.load() is not None}
SEEDED = SamplingParams(temperature=0.8, top_p=0.9, seed=11, max_tokens=6, ignore_eos=True, logprobs=2)


def _bits(tokens, logprobs) -> tuple:
    return tuple(tokens), tuple((lp.logprob, tuple(lp.top)) for lp in logprobs)


def _run_seeded(cluster, prompts) -> list[tuple]:
    async def one(prompt):
        tokens, logprobs = [], []
        async for delta in cluster.generate(prompt, SEEDED):
            tokens += delta.token_ids
            logprobs += delta.logprobs
        return _bits(tokens, logprobs)

    async def main():
        return await asyncio.gather(*(one(p) for p in prompts))
    return asyncio.run(main())


@pytest.mark.parametrize("mode", ["disaggregated", "conditional", "colocated"])
@pytest.mark.parametrize("precision", sorted(PRECISIONS))
def test_cluster_serves_the_offline_tokens(ray_session, checkpoint, prompts, mode,  # noqa: F811
                                           precision):
    options = PRECISIONS[precision]
    llm = LLM(checkpoint, **options)
    reference = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
    seeded = [_bits(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in llm.generate(prompts, SEEDED)]
    cfg = _config(checkpoint, mode=mode, prefill_workers=0 if mode == "colocated" else 1,
                  decode_workers=1, local_prefill_threshold=LOCAL_BELOW)
    cfg = replace(cfg, engine=replace(cfg.engine, **options))
    cluster = Cluster(cfg).start()
    try:
        assert run_all(cluster, prompts) == reference
        stats = wait_all_free(cluster)
        assert all(s["free_blocks"] == s["total_blocks"] for s in stats)
        if mode != "colocated":  # the remote prompts' KV crossed in the engine's own dtype
            remote = [n for n in LENGTHS if mode == "disaggregated" or n >= LOCAL_BELOW]
            received = sum(s.get("kv_bytes_received", 0) for s in stats)
            fp32 = sum(-(-n // 16) for n in remote) * block_bytes(checkpoint)
            assert received == fp32 * KV_BYTES_PER_FP32[precision]
        if mode == "conditional":  # both paths served some of them
            assert cluster.router.decisions["local_short_prompt"] == sum(n < LOCAL_BELOW for n in LENGTHS) > 0
        # the pools compute a prompt as the offline engine does, in any chunks and batches:
        # the prompts' blocks are in the prefix cache now, so this run computes fewer rows of
        # each (bf16 without a native bf16 kernel runs on oneDNN, whose sums can follow the batch's rows)
        if BIT_EXACT[precision]():
            assert _run_seeded(cluster, prompts) == seeded
    finally:
        cluster.shutdown()


@pytest.fixture(scope="module")
def wider_model(tmp_path_factory) -> str:
    from tandem.engine.default_model import write_model

    return str(write_model("small", tmp_path_factory.mktemp("small") / "model"))  # 256 wide, heads of 32


@pytest.mark.skipif(not _native_bf16(), reason="no AMX-BF16 or AVX-512 BF16 on this machine")
@pytest.mark.parametrize("mode", ["disaggregated", "conditional"])
def test_bf16_pools_serve_the_offline_bits(ray_session, wider_model, prompts, mode):  # noqa: F811
    """Heads of 32, so prompt attention runs on AMX where the CPU has it (else the native
    prompt kernel): the prefill pool computes what the decode pool and the offline engine
    do, in any batch, on either native bf16 kernel. (On oneDNN's
    blocked bf16 layout a row's sums can follow its batch's row count: a one-token prompt,
    a cache hit's few rows; this failed on 2 of 7 runs with the prefill pool blocked.)"""
    seeded = [_bits(o.outputs[0].token_ids, o.outputs[0].logprobs)
              for o in LLM(wider_model, dtype="bfloat16").generate(prompts, SEEDED)]
    cfg = _config(wider_model, mode=mode, prefill_workers=1, decode_workers=1,
                  local_prefill_threshold=LOCAL_BELOW)
    cluster = Cluster(replace(cfg, engine=replace(cfg.engine, dtype="bfloat16"))).start()
    try:
        assert _run_seeded(cluster, prompts) == seeded
        assert _run_seeded(cluster, prompts) == seeded  # on prefix-cache hits
    finally:
        cluster.shutdown()
