"""KV cache sizing: fixed blocks, a size in GiB, or what --gpu-memory-utilization leaves on CUDA."""

from __future__ import annotations

import pytest
import torch

from tandem.common.config import CacheConfig
from tandem.engine.kv_cache import sizing
from tandem.engine.kv_cache.sizing import (GIB, kv_bytes_from_memory, num_kv_blocks,
                                             working_memory_bytes)
from tandem.engine.model.config import ModelConfig

CUDA = torch.device("cuda")
CPU = torch.device("cpu")


def test_utilization_share_minus_weights_and_working_memory():
    # 80 GiB device, 70 free; this engine holds 10 (weights), a step needs 2:
    # 0.9 * 80 - 10 - 2 = 60 GiB of KV, under the 70 - 2 free.
    assert kv_bytes_from_memory(80 * GIB, 70 * GIB, 10 * GIB, 0.9, 2 * GIB) == 60 * GIB


def test_free_memory_caps_the_share_when_another_process_holds_some():
    # another process took 30 GiB: only 40 are free, 38 after the step's working memory
    assert kv_bytes_from_memory(80 * GIB, 40 * GIB, 10 * GIB, 0.9, 2 * GIB) == 38 * GIB


def test_nothing_left_is_negative():
    assert kv_bytes_from_memory(80 * GIB, 70 * GIB, 10 * GIB, 0.1, 2 * GIB) < 0


def test_num_blocks_wins_then_memory_gb_then_the_cpu_default():
    per_block = 2 ** 20
    assert num_kv_blocks(CacheConfig(num_blocks=7, memory_gb=3.0), per_block, CUDA, 0) == 7
    assert num_kv_blocks(CacheConfig(memory_gb=0.5), per_block, CUDA, 0) == 512
    assert num_kv_blocks(CacheConfig(), per_block, CPU, 0) == 1024  # CPU_KV_CACHE_GB = 1
    assert num_kv_blocks(CacheConfig(memory_gb=1e-9), per_block, CPU, 0) == 2  # at least 2


def _device(monkeypatch, total: int, free: int, held: int) -> None:
    monkeypatch.setattr(sizing.torch.cuda, "mem_get_info", lambda device: (free, total))
    monkeypatch.setattr(sizing.torch.cuda, "memory_reserved", lambda device: held)


def test_cuda_default_sizes_from_free_memory(monkeypatch):
    _device(monkeypatch, total=80 * GIB, free=70 * GIB, held=10 * GIB)
    blocks = num_kv_blocks(CacheConfig(gpu_memory_utilization=0.5), 2 ** 20, CUDA, GIB)
    assert blocks == (40 - 10 - 1) * 1024


def test_cuda_with_no_room_says_what_to_change(monkeypatch):
    _device(monkeypatch, total=16 * GIB, free=2 * GIB, held=14 * GIB)
    with pytest.raises(ValueError, match="no room for a KV cache.*--gpu-memory-utilization"):
        num_kv_blocks(CacheConfig(), 2 ** 20, CUDA, GIB)


@pytest.mark.parametrize("value", [0.0, -0.1, 1.5])
def test_utilization_outside_0_1_is_refused(value):
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        CacheConfig(gpu_memory_utilization=value)


def test_working_memory_grows_with_the_token_budget_and_counts_logits():
    mc = ModelConfig.from_dict({  # Llama-3-8B's shapes
        "architectures": ["LlamaForCausalLM"], "vocab_size": 32000, "hidden_size": 4096,
        "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
        "num_key_value_heads": 8})
    small = working_memory_bytes(mc, 512, 64, torch.bfloat16)
    large = working_memory_bytes(mc, 8192, 64, torch.bfloat16)
    assert large > small > sizing.FIXED_HEADROOM_BYTES
    # 256 sampling rows of float32 logits, three times over, are part of it
    assert small - sizing.FIXED_HEADROOM_BYTES > 256 * 32000 * 4 * 3
