"""Reduced precision on the real cluster: a bf16 or int8 engine serves, in every mode, the
tokens the offline engine with the same precision gives (real Ray actors; in
disaggregated mode the KV crosses gloo in the engine's dtype)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from services.cluster.cluster import Cluster
from services.engine import LLM
from tests.integration.test_cluster import (GREEDY, LENGTHS, _config, block_bytes, prompts,  # noqa: F401
                                           run_all, wait_all_free)

PRECISIONS = {"bf16": {"dtype": "bfloat16"}, "int8": {"quantization": "int8"}}
KV_BYTES_PER_FP32 = {"bf16": 0.5, "int8": 1.0}  # int8 quantizes weights only


LOCAL_BELOW = 20  # conditional mode: shorter prompts prefill on the decode worker


@pytest.mark.parametrize("mode", ["disaggregated", "conditional", "colocated"])
@pytest.mark.parametrize("precision", sorted(PRECISIONS))
def test_cluster_serves_the_offline_tokens(ray_session, checkpoint, prompts, mode,  # noqa: F811
                                           precision):
    options = PRECISIONS[precision]
    offline = LLM(checkpoint, **options).generate(prompts, GREEDY)
    reference = [o.outputs[0].token_ids for o in offline]
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
    finally:
        cluster.shutdown()
