"""Speculative decoding in the engine: outputs token-identical with it on and off.

The drafts come from an oracle proposer that knows the non-speculative output and
corrupts a share of its guesses, so every step mixes full acceptances, early
rejections and bonus tokens; the n-gram proposer runs on its own at the end.
"""

from __future__ import annotations

import random

import pytest

from tandem.common.config import CacheConfig, EngineConfig, SchedulerConfig, SpeculativeConfig
from tandem.common.sampling_params import SamplingParams
from tandem.engine import LLM
from tandem.engine.engine import LLMEngine
from tests.hf_models import VOCAB, write_hf_checkpoint

K = 4


def _prompts() -> list[list[int]]:
    rng = random.Random(3)
    lengths = [3, 17, 40, 9, 70, 5]
    return [[rng.randrange(2, VOCAB) for _ in range(n)] for n in lengths]


class OracleProposer:
    """Proposes the known continuation with every third-ish token corrupted."""

    def __init__(self, reference: dict[str, list[int]], prompt_lens: dict[str, int]) -> None:
        self.reference, self.prompt_lens = reference, prompt_lens
        self.rng = random.Random(0)

    def propose(self, seq_id: str, token_ids, k: int) -> list[int]:
        done = len(token_ids) - self.prompt_lens[seq_id]
        ref = self.reference[seq_id][done:done + k]
        return [t if self.rng.random() < 0.7 else (t + 1) % VOCAB for t in ref]

    def drop(self, seq_id: str) -> None:
        pass


def _engine(path, spec: bool, block_size: int = 4, num_blocks: int = 256,
            max_num_batched_tokens: int = 2048, adaptive: bool = False) -> LLMEngine:
    return LLMEngine(EngineConfig(
        model=str(path), cache=CacheConfig(block_size=block_size, num_blocks=num_blocks),
        scheduler=SchedulerConfig(max_num_batched_tokens=max_num_batched_tokens),
        speculative=SpeculativeConfig(method="ngram" if spec else None, num_speculative_tokens=K,
                                      adaptive=adaptive, max_batch_size=64)))


def _run(eng: LLMEngine, prompts, params) -> dict[str, tuple[list[int], list, object]]:
    ps = params if isinstance(params, list) else [params] * len(prompts)
    for i, (p, sp) in enumerate(zip(prompts, ps)):
        eng.add_request(str(i), p, sp)
    out = {str(i): ([], [], None) for i in range(len(prompts))}
    while eng.has_unfinished():
        for o in eng.step():
            toks, lps, _ = out[o.request_id]
            toks += o.new_token_ids
            lps += o.new_logprobs
            out[o.request_id] = (toks, lps, o.finish_reason)
    assert eng.block_pool.num_free == eng.block_pool.num_blocks
    return out


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, tiny_model_dir):
    return write_hf_checkpoint("llama3", tmp_path_factory.mktemp("spec") / "ckpt", tiny_model_dir)


def _compare(path, params, **engine_kw):
    prompts = _prompts()
    plain = _run(_engine(path, False, **engine_kw), prompts, params)
    eng = _engine(path, True, **engine_kw)
    eng.speculator.proposer = OracleProposer({k: v[0] for k, v in plain.items()},
                                             {str(i): len(p) for i, p in enumerate(prompts)})
    spec = _run(eng, prompts, params)
    for rid in plain:
        assert spec[rid][0] == plain[rid][0], rid
        assert spec[rid][2] == plain[rid][2], rid
        for a, b in zip(spec[rid][1], plain[rid][1]):
            assert a.token_id == b.token_id
            assert a.logprob == pytest.approx(b.logprob, abs=2e-4)
            assert [t for t, _ in a.top] == [t for t, _ in b.top]
    sp = eng.speculator
    assert sp.num_accepted > 0 and sp.num_proposed > sp.num_accepted, "drafts both kept and rejected"
    total = sum(len(v[0]) for v in spec.values())
    return eng, total


GREEDY = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, logprobs=2)
VARIANTS = {
    "batched": dict(),
    "chunked": dict(max_num_batched_tokens=12),
    "preempting": dict(num_blocks=40, max_num_batched_tokens=64),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_greedy_identical_with_speculation(checkpoint, variant):
    eng, total = _compare(checkpoint, GREEDY, **VARIANTS[variant])
    assert eng.num_steps < total, "speculation must save steps"
    if variant == "preempting":
        assert eng.scheduler.num_preemptions > 0


SEEDED = [
    SamplingParams(temperature=1.0, seed=11, max_tokens=30, ignore_eos=True, logprobs=1),
    SamplingParams(temperature=0.8, top_p=0.9, top_k=40, min_p=0.02, seed=7, max_tokens=30,
                   ignore_eos=True, presence_penalty=0.7, frequency_penalty=0.4,
                   repetition_penalty=1.3),
    SamplingParams(temperature=1.0, seed=5, max_tokens=30, min_tokens=20, logprobs=0),
    SamplingParams(temperature=0.0, max_tokens=30, repetition_penalty=1.5, min_tokens=10),
    SamplingParams(temperature=0.9, seed=3, max_tokens=30, ignore_eos=True,
                   logit_bias={5: 3.0, 17: -100.0, 40: 2.0}),
]


def test_seeded_and_penalised_identical_with_speculation(checkpoint):
    """Seeds, penalties, logit bias, masks, min_tokens and logprobs: the same stream, token for token."""
    prompts = _prompts()
    _compare(checkpoint, [SEEDED[i % len(SEEDED)] for i in range(len(prompts))])


def test_stop_tokens_and_max_tokens_cut_a_draft(checkpoint):
    """A stop id or max_tokens inside an accepted draft ends the output exactly there."""
    prompts = _prompts()
    plain = _run(_engine(checkpoint, False), prompts, GREEDY)
    stops = tuple({v[0][7] for v in plain.values()})  # each output's 8th token stops it
    params = [SamplingParams(temperature=0.0, max_tokens=13 + i, stop_token_ids=stops)
              for i in range(len(prompts))]
    _compare(checkpoint, params)


def test_ngram_proposer_on_a_repetitive_prompt(checkpoint):
    """``LLM(speculative="ngram")``: prompt lookup drafts from the repeated text; the
    output still equals the plain one."""
    rng = random.Random(9)
    unit = [rng.randrange(2, VOCAB) for _ in range(12)]
    prompts = [unit * 6, (unit[3:] + unit[:3]) * 5]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    plain = LLM(str(checkpoint)).generate(prompts, params)
    llm = LLM(str(checkpoint), speculative="ngram", num_speculative_tokens=3)
    spec = llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in spec] == [o.outputs[0].token_ids for o in plain]
    assert llm.engine.speculator.num_proposed > 0
    assert llm.engine.speculator.config.num_speculative_tokens == 3


# -- the draft-model proposer ------------------------------------------------------


@pytest.fixture(scope="module")
def other_checkpoint(tmp_path_factory, tiny_model_dir):
    """Another random model of the same vocabulary: a draft that is mostly wrong."""
    return write_hf_checkpoint("qwen2", tmp_path_factory.mktemp("draft") / "ckpt", tiny_model_dir,
                               seed=1)


def _draft_engine(path, draft, **kw) -> LLMEngine:
    cache = CacheConfig(block_size=4, num_blocks=kw.pop("num_blocks", 256))
    return LLMEngine(EngineConfig(
        model=str(path), cache=cache, scheduler=SchedulerConfig(**kw),
        speculative=SpeculativeConfig(method="draft", draft_model=str(draft), adaptive=False,
                                      num_speculative_tokens=K, max_batch_size=64)))


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_draft_model_outputs_identical(checkpoint, other_checkpoint, variant):
    prompts = _prompts()
    params = [SEEDED[i % len(SEEDED)] for i in range(len(prompts))]
    kw = VARIANTS[variant]
    plain = _run(_engine(checkpoint, False, **kw), prompts, params)
    eng = _draft_engine(checkpoint, other_checkpoint, **kw)
    spec = _run(eng, prompts, params)
    assert {k: v[0] for k, v in spec.items()} == {k: v[0] for k, v in plain.items()}
    assert eng.speculator.num_proposed > 0
    if variant == "preempting":
        assert eng.scheduler.num_preemptions > 0


def test_the_target_as_its_own_draft_is_always_accepted(checkpoint):
    """Greedy drafts of the target itself: every draft token accepted, k + 1 tokens a step."""
    prompts = _prompts()
    plain = _run(_engine(checkpoint, False), prompts, GREEDY)
    eng = _draft_engine(checkpoint, checkpoint)
    spec = _run(eng, prompts, GREEDY)
    assert {k: v[0] for k, v in spec.items()} == {k: v[0] for k, v in plain.items()}
    sp = eng.speculator
    assert sp.num_accepted == sp.num_proposed > 0
    assert eng.num_steps <= 2 + -(-GREEDY.max_tokens // (K + 1)) + 2


def test_a_draft_model_of_another_vocabulary_is_refused(checkpoint, tmp_path):
    import json
    import shutil

    draft = tmp_path / "draft"
    shutil.copytree(checkpoint, draft)
    cfg = json.loads((draft / "config.json").read_text())
    cfg["vocab_size"] = 2 * cfg["vocab_size"]
    (draft / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="vocabulary"):
        _draft_engine(checkpoint, draft)


def test_the_drafts_prompt_catch_up_is_bounded_per_step(checkpoint):
    """A long prompt joining running streams: the draft catches up on it at most
    ``draft_prefill_chunk`` tokens a step (beyond the running drafts' own few), the
    long sequence drafts once caught up, and outputs stay the plain ones."""
    prompts = _prompts()
    long_prompt = prompts[4] * 3  # 210 tokens
    chunk = 16
    plain = _run(_engine(checkpoint, False), prompts + [long_prompt], GREEDY)
    eng = LLMEngine(EngineConfig(
        model=str(checkpoint), cache=CacheConfig(block_size=4, num_blocks=256),
        speculative=SpeculativeConfig(method="draft", draft_model=str(checkpoint), adaptive=False,
                                      num_speculative_tokens=K, max_batch_size=64,
                                      draft_prefill_chunk=chunk)))
    runner = eng.speculator.proposer.runner
    first_forwards: list[list[int]] = []  # tokens per sequence of each step's first draft forward
    execute = runner.execute

    def recording(items, *a):
        if any(it.num_new_tokens > 1 for it in items) or not first_forwards or \
                first_forwards[-1] is None:
            first_forwards.append([it.num_new_tokens for it in items])
        return execute(items, *a)

    runner.execute = recording
    spec = _run(eng, prompts + [long_prompt], GREEDY)
    assert {k: v[0] for k, v in spec.items()} == {k: v[0] for k, v in plain.items()}
    steady = K + 1  # a drafting sequence's own lag: its last draft plus one token
    for sizes in first_forwards:
        assert sum(n for n in sizes if n > steady) <= chunk, sizes
    assert max(max(s) for s in first_forwards) == chunk  # the long prompt did come in chunks
    sp = eng.speculator
    assert sp.num_accepted == sp.num_proposed > 0
    assert eng.num_steps < sum(len(v[0]) for v in spec.values())


def _histogram(eng: LLMEngine, prompt: list[int], params: SamplingParams, n: int, position: int):
    from collections import Counter

    counts: Counter = Counter()
    for start in range(0, n, 250):
        ids = [f"r{i}" for i in range(start, min(n, start + 250))]
        for rid in ids:
            eng.add_request(rid, prompt, params)
        out = {rid: [] for rid in ids}
        while eng.has_unfinished():
            for o in eng.step():
                out[o.request_id] += o.new_token_ids
        counts.update(tuple(v[:position + 1]) for v in out.values())
    return counts


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0, top_k=3, max_tokens=3, ignore_eos=True),
    # the random model's law is flat: top_k bounds the outcomes, top_p cuts within them
    SamplingParams(temperature=1.0, top_k=8, top_p=0.5, max_tokens=3, ignore_eos=True),
], ids=["top_k", "top_p"])
def test_draft_model_sampling_keeps_the_target_distribution(checkpoint, params):
    """Unseeded sampling with the target drafting for itself (greedy drafts: often
    accepted, often not): the joint law of tokens 1-3 equals the one without
    speculation (two-sample chi-square, fixed seeds, p = 0.001)."""
    prompt = _prompts()[1]
    n = 1000

    def engine(spec: bool) -> LLMEngine:
        return LLMEngine(EngineConfig(
            model=str(checkpoint), seed=3, cache=CacheConfig(block_size=4, num_blocks=1024),
            speculative=SpeculativeConfig(method="draft", draft_model=str(checkpoint), adaptive=False,
                                          num_speculative_tokens=2, max_batch_size=1024,
                                          draft_prefill_chunk=4096)
            if spec else SpeculativeConfig()))
    with_spec = engine(True)
    a = _histogram(with_spec, prompt, params, n, 2)
    b = _histogram(engine(False), prompt, params, n, 2)
    sp = with_spec.speculator
    assert 0 < sp.num_accepted < sp.num_proposed
    # Pool outcomes seen fewer than 10 times in both samples into one cell.
    keys = sorted(set(a) | set(b))
    big = [k for k in keys if a[k] + b[k] >= 10]
    cells = [(a[k], b[k]) for k in big] + [(sum(a[k] for k in keys if k not in big),
                                            sum(b[k] for k in keys if k not in big))]
    cells = [c for c in cells if sum(c) > 0]
    stat = sum((x - y) ** 2 / (x + y) for x, y in cells)  # equal sample sizes
    dof = len(cells) - 1
    assert dof >= 3
    # chi-square critical value at p = 0.001 (Wilson-Hilferty approximation)
    z = 3.09
    crit = dof * (1 - 2 / (9 * dof) + z * (2 / (9 * dof)) ** 0.5) ** 3
    assert stat < crit, f"chi2 {stat:.1f} over {dof} dof (critical {crit:.1f})"
