"""Sampled decoding on the device: the masks and the seeded draw the CPU tests check.

Top-k/top-p masks decided among candidates must equal the full sort's on the
device too (its ``topk`` and stable sort are other kernels), and a seeded
request must give the same tokens on the device twice and on the CPU.
"""

from __future__ import annotations

import torch

from tandem.gpucheck.context import CheckContext
from tandem.gpucheck.report import Result, Status

MASK_VOCAB = 49152  # SmolLM2's: above the candidates, as real vocabularies are
ENGINE_PRESET = "bench"  # the seeded random preset whose vocabulary (32,000) takes the candidate path


def _status(ctx: CheckContext, ok: bool) -> Status:
    """FAIL when wrong, even in a dry run (the CPU side is real there too)."""
    return Status.FAIL if not ok else Status.DRY if ctx.dry_run else Status.PASS


def _mask_rows(bsz: int, vocab: int, device: torch.device) -> torch.Tensor:
    """Peaked rows, rows full of ties and flat rows, [bsz, vocab]."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(bsz, vocab, generator=g)
    x[0::3] *= 8.0
    x[1::3] = (x[1::3] * 2).round() / 2
    return x.to(device)


def check_masks(ctx: CheckContext) -> Result:
    from tandem.engine import sampling_masks

    bsz = 24
    x = _mask_rows(bsz, MASK_VOCAB if not ctx.dry_run else 3000, ctx.device)
    g = torch.Generator().manual_seed(1)
    top_k = torch.randint(1, 200, (bsz,), generator=g)
    top_k[::4] = x.shape[1]  # off
    top_k[2::4] = torch.randint(sampling_masks.CANDIDATES + 1, x.shape[1], (len(top_k[2::4]),),
                                generator=g)  # beyond the candidates
    top_p = torch.rand(bsz, generator=g) * 0.9 + 0.05
    top_p[1::5] = 1.0
    cases = ((top_k, None), (None, top_p), (top_k, top_p))
    differing, decided = 0, 0
    for k, p in cases:
        got = sampling_masks.apply_sampling_masks(x, k, p)
        kk = None if k is None else k.to(ctx.device).clamp(1, x.shape[1])
        pp = None if p is None else p.to(ctx.device)
        full = x.masked_fill(~sampling_masks._full_sort_mask(x, kk, pp), float("-inf"))
        on_cpu = sampling_masks.apply_sampling_masks(x.cpu(), k, p)
        differing += int((torch.isinf(got) != torch.isinf(full)).any(dim=-1).sum())
        differing += int((torch.isinf(got).cpu() != torch.isinf(on_cpu)).any(dim=-1).sum())
        decided += int((~sampling_masks._decide_among_candidates(x, kk, pp)[-1]).sum())
    ok = differing == 0 and decided > 0
    return Result("sampling masks", _status(ctx, ok),
                  f"{bsz} rows x {len(cases)} cases, vocab {x.shape[1]}: {decided} decided among "
                  f"candidates; against the device's full sort and the CPU",
                  f"{differing} rows differ", "0")


def _seeded_tokens(path: str, device: str, ctx: CheckContext, prompts: list[list[int]]
                   ) -> list[list[int]]:
    from tandem.engine import LLM, SamplingParams

    kwargs = {"attention_backend": ctx.attention} if device != "cpu" else {}
    llm = LLM(path, device=device, dtype="float32", num_blocks=256, max_num_seqs=8, **kwargs)
    params = [SamplingParams(temperature=0.8, top_p=0.95, seed=11 + i,
                             max_tokens=ctx.sizes.parity_new_tokens, ignore_eos=True)
              for i in range(len(prompts))]
    out = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    del llm
    return out


def check_seeded(ctx: CheckContext) -> Result:
    from tandem.gpucheck.parity_checks import prompts
    from tandem.engine.default_model import get_preset, write_model

    preset = ENGINE_PRESET if not ctx.dry_run else "tiny"
    path = str(write_model(preset, ctx.workdir / f"seeded-{preset}"))
    ps = prompts(ctx, get_preset(preset).vocab_size)
    first = _seeded_tokens(path, str(ctx.device), ctx, ps)
    again = _seeded_tokens(path, str(ctx.device), ctx, ps)
    cpu = _seeded_tokens(path, "cpu", ctx, ps)
    n = ctx.sizes.parity_new_tokens
    leading = [next((i for i in range(n) if a[i] != c[i]), n) for a, c in zip(first, cpu)]
    ok = first == again and first == cpu
    return Result("seeded sampling fp32", _status(ctx, ok),
                  f"temperature 0.8, top-p 0.95, {len(ps)} prompts: repeat "
                  f"{'identical' if first == again else 'DIFFERS'}; leading tokens equal to "
                  f"the CPU's {leading} of {n}", "", "identical, identical")


def check_sampling(ctx: CheckContext) -> list[Result]:
    return [check_masks(ctx), check_seeded(ctx)]
