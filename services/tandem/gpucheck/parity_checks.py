"""The engine on the device against transformers: fp32 token-exact, bf16 greedy and logprobs."""

from __future__ import annotations

import torch

from tandem.gpucheck.checkpoints import parity_checkpoint
from tandem.gpucheck.context import CheckContext
from tandem.gpucheck.report import Result, Status

FP32_LOGPROB_ATOL = 1e-3  # other kernels, other summation orders
BF16_LOGPROB_ATOL = 0.2  # |ours - transformers'| on the tokens both chose
BF16_MIN_AGREEMENT = 0.5  # mean share of leading greedy tokens equal to transformers'


def prompts(ctx: CheckContext, vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in ctx.sizes.parity_prompts]


def hf_greedy(hf, prompt: list[int], steps: int, device: torch.device
              ) -> tuple[list[int], list[float]]:
    """transformers' greedy tokens (full forward each step) and their float32 logprobs."""
    ids, tokens, logprobs = list(prompt), [], []
    with torch.no_grad():
        for _ in range(steps):
            logits = hf(torch.tensor([ids], device=device)).logits[0, -1].float()
            tok = int(logits.argmax())
            tokens.append(tok)
            logprobs.append(float(torch.log_softmax(logits, -1)[tok]))
            ids.append(tok)
    return tokens, logprobs


def _run(ctx: CheckContext, dtype: str):
    """(our tokens and logprobs, transformers' tokens and logprobs) per prompt."""
    from transformers import AutoModelForCausalLM

    from tandem.engine import LLM, SamplingParams

    path = parity_checkpoint(ctx)
    llm = LLM(str(path), device=str(ctx.device), dtype=dtype, attention_backend=ctx.attention,
              num_blocks=256, max_num_seqs=8)
    vocab = llm.engine.model_config.vocab_size
    ps = prompts(ctx, vocab)
    n = ctx.sizes.parity_new_tokens
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=1)
    ours = [(o.outputs[0].token_ids, [lp.logprob for lp in o.outputs[0].logprobs])
            for o in llm.generate(ps, params)]
    graphs = llm.engine.runner.graphs
    replays = graphs.replays if graphs is not None else 0
    del llm
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).to(ctx.device)
    ref = [hf_greedy(hf.eval(), p, n, ctx.device) for p in ps]
    return ours, ref, replays


def check_fp32(ctx: CheckContext) -> list[Result]:
    ours, ref, replays = _run(ctx, "float32")
    exact = all(o[0] == r[0] for o, r in zip(ours, ref))
    err = max(abs(a - b) for o, r in zip(ours, ref) for a, b in zip(o[1], r[1]))
    ok = exact and err <= FP32_LOGPROB_ATOL
    what = "tokens identical to transformers" if exact else "tokens differ from transformers"
    return [Result("engine fp32 vs transformers", Status.PASS if ok else Status.FAIL,
                   f"{what}; {len(ours)} prompts, {replays} graph-path decode steps",
                   f"max |dlogprob| {err:.1e}", f"identical, <= {FP32_LOGPROB_ATOL:g}")]


def check_bf16(ctx: CheckContext) -> list[Result]:
    ours, ref, _ = _run(ctx, ctx.half_dtype)
    n = ctx.sizes.parity_new_tokens
    leading = [next((i for i in range(n) if o[0][i] != r[0][i]), n) for o, r in zip(ours, ref)]
    first_ok = all(k > 0 for k in leading)
    agreement = sum(leading) / (n * len(leading))
    diffs = [abs(o[1][i] - r[1][i]) for o, r, k in zip(ours, ref, leading) for i in range(k)]
    err = max(diffs, default=0.0)
    ok = first_ok and agreement >= BF16_MIN_AGREEMENT and err <= BF16_LOGPROB_ATOL
    name = {"bfloat16": "bf16", "float16": "fp16"}[ctx.half_dtype]
    return [Result(f"engine {name} vs transformers", Status.PASS if ok else Status.FAIL,
                   f"first tokens {'all equal' if first_ok else 'DIFFER'}; leading tokens "
                   f"agreeing {leading} of {n}",
                   f"agree {agreement:.0%}, max |dlogprob| {err:.3f}",
                   f"first equal, >= {BF16_MIN_AGREEMENT:.0%}, <= {BF16_LOGPROB_ATOL:g}")]
