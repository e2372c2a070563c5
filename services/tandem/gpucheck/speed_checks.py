"""Speed against floors measured in the same run: HBM bandwidth and bf16 matmul peak.

Decode steps are timed through ``LLMEngine.step`` (scheduler, runner, sampling:
what a user waits for), medians of ``timed_steps``; graphs on and off are
timed interleaved (A B A B) on two engines holding the same model.
"""

from __future__ import annotations

import gc

import torch

from tandem.gpucheck.checkpoints import speed_checkpoint
from tandem.gpucheck.context import CheckContext
from tandem.gpucheck.report import Result, Status

DECODE_B1_TARGET = 0.70  # of the HBM floor
PREFILL_TARGET = 0.50  # of the measured bf16 peak


def _judged(ctx: CheckContext, ok: bool) -> Status:
    if ctx.dry_run:
        return Status.DRY
    return Status.PASS if ok else Status.MISS


def _copy_s(ctx: CheckContext, n: int) -> float:
    src = torch.empty(n, dtype=torch.uint8, device=ctx.device)
    dst = torch.empty_like(src)
    return ctx.median_s(lambda: dst.copy_(src), repeats=10)


def _matmul_s(ctx: CheckContext, m: int, dtype: torch.dtype) -> float:
    a = torch.randn(m, m, device=ctx.device, dtype=dtype)
    b = torch.randn(m, m, device=ctx.device, dtype=dtype)
    return ctx.median_s(lambda: a @ b, repeats=10, warmup=3)


def check_floors(ctx: CheckContext) -> list[Result]:
    n, m = ctx.sizes.copy_bytes, ctx.sizes.matmul_n
    ctx.hbm_bytes_per_s = 2 * n / _copy_s(ctx, n)  # read + write
    dtype = torch.bfloat16 if ctx.device.type == "cuda" else torch.float32
    ctx.peak_flops = 2 * m ** 3 / _matmul_s(ctx, m, dtype)
    status = Status.DRY if ctx.dry_run else Status.INFO
    return [Result("floor: HBM bandwidth", status, f"device-to-device copy of {n / 2**30:.2f} GiB",
                   f"{ctx.hbm_bytes_per_s / 1e12:.2f} TB/s", "H200 spec 4.8"),
            Result("floor: matmul peak", status, f"{m}^3 {str(dtype).removeprefix('torch.')} "
                   "matmul, random data", f"{ctx.peak_flops / 1e12:.0f} TFLOP/s",
                   "H200 spec 989 (bf16 dense)")]


def _engine(ctx: CheckContext, **kw):
    from tandem.engine.llm import LLM

    path = speed_checkpoint(ctx)
    return LLM(str(path), device=str(ctx.device), dtype=ctx.speed_dtype,
               attention_backend=ctx.attention, **kw).engine


def _free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _decoding(eng, batch: int, context: int, tag: str) -> None:
    """``batch`` sequences prefilled and decoding."""
    from tandem.common.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=100_000, ignore_eos=True)
    gen = torch.Generator().manual_seed(batch)
    for i in range(batch):
        prompt = torch.randint(3, eng.model_config.vocab_size, (context,), generator=gen).tolist()
        eng.add_request(f"{tag}-{i}", prompt, params)
    while eng.scheduler.waiting or any(s.num_uncomputed_tokens > 1 for s in eng.scheduler.running):
        eng.step()


def _stop(eng, batch: int, tag: str) -> None:
    for i in range(batch):
        eng.abort(f"{tag}-{i}")


def _weight_bytes(eng) -> int:
    """Bytes a decode step reads of the weights: all but the (untied) embedding table."""
    model = eng.runner.model
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    embed = model.embed_tokens.weight
    return total - (embed.numel() * embed.element_size() if model.lm_head is not None else 0)


def check_decode(ctx: CheckContext) -> list[Result]:
    s = ctx.sizes
    top = max(s.decode_batches)
    kw = dict(max_num_seqs=top, max_model_len=s.decode_context + 4 * s.timed_steps + 64,
              kv_cache_memory_gb=4.0 if ctx.device.type == "cuda" else 0.05)
    on = _engine(ctx, cuda_graphs=True, **kw)
    off = _engine(ctx, cuda_graphs=False, **kw)
    results = []
    mc = on.model_config
    kv_per_token = 2 * mc.num_layers * mc.num_kv_heads * mc.head_dim * on.kv_cache.kv.element_size()
    for batch in s.decode_batches:
        _decoding(on, batch, s.decode_context, "on")
        _decoding(off, batch, s.decode_context, "off")
        t_on, t_off = [], []
        for _ in range(max(1, s.timed_steps // 5)):  # interleaved rounds, A B A B
            t_on.append(ctx.median_s(on.step, repeats=min(5, s.timed_steps), warmup=1))
            t_off.append(ctx.median_s(off.step, repeats=min(5, s.timed_steps), warmup=1))
        t_on.sort()
        t_off.sort()
        t_graph, t_eager = t_on[len(t_on) // 2], t_off[len(t_off) // 2]
        _stop(on, batch, "on")
        _stop(off, batch, "off")
        read = _weight_bytes(on) + batch * (s.decode_context + 2 * s.timed_steps) * kv_per_token
        floor = read / ctx.hbm_bytes_per_s
        share = floor / t_graph
        if batch == 1:
            status, target = _judged(ctx, share >= DECODE_B1_TARGET), f">= {DECODE_B1_TARGET:.0%}"
        else:
            status, target = (Status.DRY if ctx.dry_run else Status.INFO), "(reported)"
        results.append(Result(
            f"decode b{batch} vs HBM floor", status,
            f"graphs {t_graph * 1e3:.3f} ms/step, floor {floor * 1e3:.3f} ms "
            f"({read / 1e9:.2f} GB read)", f"{share:.0%} of floor", target))
        results.append(Result(
            f"cuda graphs b{batch} on/off", Status.DRY if ctx.dry_run else Status.INFO,
            f"{t_graph * 1e3:.3f} vs {t_eager * 1e3:.3f} ms/step, "
            f"{on.runner.graphs.replays if on.runner.graphs else 0} replays",
            f"{t_eager / t_graph:.2f}x", "(reported)"))
    results.insert(0, _graphs_agree(on, off, s.decode_context, s.agree_tokens))
    del on, off
    _free()
    return results


def _graphs_agree(on, off, context: int, n: int) -> Result:
    """Graph replay and eager steps choose the same greedy tokens (batch 1: no padding)."""
    from tandem.common.sampling_params import SamplingParams

    prompt = list(range(3, 3 + context))
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    got = []
    for eng in (on, off):
        eng.add_request("agree", prompt, params)
        tokens = []
        while eng.scheduler.get("agree") is not None:
            for out in eng.step():
                tokens += out.new_token_ids
        got.append(tokens)
    same = got[0] == got[1] and len(got[0]) == n
    return Result("cuda graphs vs eager tokens", Status.PASS if same else Status.FAIL,
                  "same greedy tokens" if same else f"differ: {got[0][:6]} vs {got[1][:6]}",
                  f"{n} tokens", "identical")


def _prefill(ctx: CheckContext) -> tuple[float, float]:
    """(median seconds, FLOPs) of prefilling one ``prefill_tokens`` prompt in one step."""
    from tandem.common.sampling_params import SamplingParams

    t = ctx.sizes.prefill_tokens
    eng = _engine(ctx, max_num_seqs=4, max_num_batched_tokens=t, max_model_len=t + 64,
                  enable_prefix_caching=False, cuda_graphs=False,
                  kv_cache_memory_gb=0.05 if ctx.dry_run else 4.0)
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    prompt = torch.randint(3, eng.model_config.vocab_size, (t,),
                           generator=torch.Generator().manual_seed(1)).tolist()
    count = [0]

    def one() -> None:
        count[0] += 1
        eng.add_request(f"p{count[0]}", prompt, params)
        eng.step()  # the whole prompt in one step, token #1 sampled: the request ends

    seconds = ctx.median_s(one, repeats=max(1, ctx.sizes.timed_steps // 6),
                           warmup=1 if ctx.dry_run else 2)
    mc = eng.model_config
    # every projection on every token (the LM head on one row only), causal attention
    linear = _weight_bytes(eng) // eng.kv_cache.kv.element_size() - mc.vocab_size * mc.hidden_size
    flops = 2 * linear * t + 2 * mc.num_layers * t * t * mc.num_heads * mc.head_dim
    return seconds, flops


def check_prefill(ctx: CheckContext) -> list[Result]:
    seconds, flops = _prefill(ctx)
    _free()
    share = flops / seconds / ctx.peak_flops
    return [Result(f"prefill {ctx.sizes.prefill_tokens} tokens vs peak",
                   _judged(ctx, share >= PREFILL_TARGET),
                   f"{seconds * 1e3:.1f} ms, {flops / seconds / 1e12:.0f} TFLOP/s",
                   f"{share:.0%} of peak", f">= {PREFILL_TARGET:.0%}")]
