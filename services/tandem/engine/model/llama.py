"""Llama-family decoder (Llama 2/3, Mistral, Qwen2, Qwen3) over a paged KV cache.

Projections are fused (q|k|v and gate|up) for fewer, larger matmuls; the loader
splices the checkpoint's separate tensors into them. Numerics follow HF
transformers (RMSNorm in fp32, RoPE tables in fp32 cast to the model dtype).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from tandem.engine import huge_pages
from tandem.engine.kernels import amx_linear, cpu_kernels, onednn, packed_linear, quantized
from tandem.engine.model.attention import AttentionBackend, AttentionMetadata, TorchPagedAttention
from tandem.engine.model.config import ModelConfig
from tandem.engine.model.decode_stack import DecodeStack
from tandem.engine.model.layer_ops import NativeLayerOps, TorchLayerOps
from tandem.engine.model.rope import RotaryEmbedding


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.split = (q_size, kv_size, kv_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.qkv_proj = nn.Linear(cfg.hidden_size, q_size + 2 * kv_size, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(q_size, cfg.hidden_size, bias=cfg.o_bias)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor, delta: torch.Tensor | None, positions: torch.Tensor,
                ops: TorchLayerOps, rope: RotaryEmbedding, attn: AttentionBackend,
                k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """Residual stream ``x [T, hidden]`` plus the previous layer's pending ``delta``
        in; the updated stream and this layer's MLP output (still to be added) out."""
        t = x.shape[0]
        x, h = ops.add_norm(x, delta, self.input_layernorm)
        q, k, v = self.qkv_proj(h).split(self.split, dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = ops.rope(rope, q, k, positions)
        o = attn(q, k, v, k_cache, v_cache, meta)  # [T, H, D]
        x, h = ops.add_norm(x, self.o_proj(o.reshape(t, -1)), self.post_attention_layernorm)
        return x, ops.mlp(h, self.gate_up_proj, self.down_proj)


class LlamaModel(nn.Module):
    """Token ids in, last hidden states out; ``compute_logits`` on the rows that sample."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(
            cfg.hidden_size, cfg.vocab_size, bias=False)
        self.attn: AttentionBackend = TorchPagedAttention(cfg.head_dim ** -0.5, cfg.sliding_window)
        self.rope: RotaryEmbedding | None = None  # built on the real device by the loader
        self.ops: TorchLayerOps = TorchLayerOps()
        self.decode_stack: DecodeStack | None = None  # CPU kernels, where it fits: ModelRunner's decode steps

    @property
    def act_dtype(self) -> torch.dtype:
        """The residual stream's dtype (the norms'; fp32 on CPU whatever the weights')."""
        return self.norm.weight.dtype

    def use_onednn(self, weight_dtype: torch.dtype = torch.float32, native: bool = True,
                   layout: str = "blocked") -> None:
        """CPU: every projection and the LM head as a ``CpuLinear`` with ``weight_dtype`` (fp32
        or bf16) weights, each stored once in ``layout`` (see onednn.py): packed for the
        native kernel; blocked for oneDNN; plain for oneDNN and the native GEMV for
        decode-sized inputs. The LM head takes ``onednn.head_layout`` (bf16 on AMX or AVX-512
        BF16: packed, its logits unrounded). The embedding table takes ``weight_dtype`` too
        (rows are widened on lookup). A tied head packed (fp32, or bf16 in AMX's blocks), the table is looked
        up in the packed head (``PackedEmbedding``, ``AmxEmbedding``); in another layout the
        head shares the table, plain.
        ``native=False``: no native kernel (oneDNN for every input)."""
        head_layout = onednn.head_layout(layout, weight_dtype, native)
        if self.lm_head is not None:
            self.lm_head = onednn.CpuLinear(self.lm_head.weight, self.lm_head.bias, weight_dtype,
                                            native, head_layout, logits=True)
        onednn.replace_linears(self, weight_dtype, native, layout)
        table = self.embed_tokens.weight
        table.data = table.data.to(weight_dtype)
        if not self.config.tie_word_embeddings:
            return
        stored = onednn.storage_layout(head_layout, weight_dtype, native)
        if stored == "packed" or stored in onednn.PAIR_PACKED:
            self.lm_head = onednn.CpuLinear(table, None, weight_dtype, native, "packed", logits=True)
            # the plain table is dropped: stored once, packed
            self.embed_tokens = packed_linear.PackedEmbedding(self.lm_head.weight, table.shape[0]) \
                if stored == "packed" else amx_linear.AmxEmbedding(self.lm_head.weight, *table.shape)
        else:  # every decode step reads all of it: huge pages (huge_pages.py)
            table.data = huge_pages.copy_of(table.data)
            self.lm_head = onednn.CpuLinear(table, None, weight_dtype, native, head_layout,
                                            shared=True, logits=True)

    def use_int8(self, native: bool = True) -> int:
        """Weight-only int8 (per output channel) projections and LM head; returns how many.
        ``native=False``: no native kernel (each call dequantizes for one fp32 product)."""
        n = quantized.quantize_linears(self, native)
        if self.lm_head is None:
            self.lm_head = quantized.Int8Linear(self.embed_tokens.weight, None, native)
            n += 1
        return n

    def weight_bytes(self, include_embedding: bool = True) -> int:
        """Bytes of the weights as stored (dense or quantized; a tensor two layers share
        counts once). Without the embedding table: what one decode step reads (the lookup
        reads one row of it; a tied head reads all of it)."""
        tensors = list(self.parameters())
        tensors += [t for m in self.modules() if hasattr(m, "weight_tensors") for t in m.weight_tensors()]
        table = self.embed_tokens.weight
        head = getattr(self.lm_head, "weight", None)
        # no head of its own (a tied one on torch's path): the table is the head
        tied = self.lm_head is None or (head is not None and _storage_key(head) == _storage_key(table))
        skip = set() if include_embedding or tied else {_storage_key(table)}
        stored = {_storage_key(t): t.numel() * t.element_size() for t in tensors}
        return sum(n for ptr, n in stored.items() if ptr not in skip)

    def use_cpu_kernels(self) -> bool:
        """CPU with fp32 activations: attention and the elementwise steps through native
        kernels (KV fp32 or bf16).

        Returns False (the torch path stays) elsewhere or where they cannot be built;
        once installed, the attention backend and layer ops use them unconditionally.
        """
        weight = self.norm.weight
        if weight.device.type != "cpu" or weight.dtype != torch.float32:
            return False
        kernels = cpu_kernels.load()
        if kernels is None:
            return False
        if isinstance(self.attn, TorchPagedAttention):
            self.attn.kernels = kernels
        self.ops = NativeLayerOps(kernels)
        self.decode_stack = DecodeStack.build(self, kernels)
        return True

    def init_rope(self, max_positions: int) -> None:
        cfg = self.config
        dtype, device = self.act_dtype, self.norm.weight.device
        with torch.device(device):
            self.rope = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta,
                                        cfg.rope_scaling, dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata,
                on_layer_done: Callable[[int], None] | None = None) -> torch.Tensor:
        """``input_ids, positions [T]``; ``kv_cache [L, 2, blocks, block_size, KVH, D]``.

        ``on_layer_done(i)`` runs after layer ``i`` wrote its KV (layer-wise transfer).
        Returns final-normed hidden states ``[T, hidden]``.
        """
        x, delta = self.embed_tokens(input_ids).to(self.act_dtype), None
        for i, layer in enumerate(self.layers):
            x, delta = layer(x, delta, positions, self.ops, self.rope, self.attn,
                             kv_cache[i, 0], kv_cache[i, 1], meta)
            if on_layer_done is not None:
                on_layer_done(i)
        return self.ops.add_norm(x, delta, self.norm)[1]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[R, hidden]`` -> float32 logits ``[R, vocab]``."""
        if self.lm_head is not None:
            return self.lm_head(hidden).float()
        return F.linear(hidden, self.embed_tokens.weight).float()


def _storage_key(t: torch.Tensor) -> int:
    """What identifies ``t``'s memory: its data pointer, or the tensor itself for an opaque
    (oneDNN blocked) one, which no other tensor shares."""
    return id(t) if t.is_mkldnn else t.data_ptr()
