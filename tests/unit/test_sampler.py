"""Unit tests for tandem.engine.sampler (CPU, deterministic)."""

from __future__ import annotations

import math

import pytest
import torch

from tandem.common.sampling_params import SamplingParams
from tandem.engine.kernels import cpu_kernels
from tandem.engine.sampler import (
    Sampler,
    SamplingBatch,
    apply_logit_bias,
    apply_penalties,
    apply_sampling_masks,
    draw_from,
    noise_key,
    seeded_uniform,
)

P = SamplingParams


def batch(params, prompts=None, outputs=None, banned=None) -> SamplingBatch:
    n = len(params)
    return SamplingBatch(
        params=list(params),
        prompt_token_ids=list(prompts) if prompts is not None else [[] for _ in range(n)],
        output_token_ids=list(outputs) if outputs is not None else [[] for _ in range(n)],
        banned_token_ids=list(banned) if banned is not None else [[] for _ in range(n)],
    )


def log_probs(probs: list[float]) -> torch.Tensor:
    return torch.tensor(probs, dtype=torch.float64).log().float()  # [V]


def support(logits: torch.Tensor, params: SamplingParams, n: int = 4000, seed: int = 0) -> set[int]:
    """Tokens seen over ``n`` unseeded draws of one distribution (one batch)."""
    out = Sampler(seed=seed)(logits.expand(n, -1).clone(), batch([params] * n))
    return set(out.token_ids)


# --- greedy -----------------------------------------------------------------

def test_greedy_is_argmax_first_on_ties():
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0], [-5.0, -1.0, -2.0, -1.0], [0.0, 0.0, 0.0, 9.0]])
    out = Sampler(seed=0)(logits, batch([P(temperature=0.0)] * 3))
    assert out.token_ids == [1, 1, 3]
    assert out.logprobs == [None, None, None]


def test_greedy_consumes_no_randomness():
    torch.manual_seed(0)
    logits = torch.randn(2, 64)
    # Shared generator: greedy steps interleaved must not shift the random stream.
    rand_b = batch([P(temperature=1.0)] * 2)
    greedy_b = batch([P(temperature=0.0)] * 2)
    a, b = Sampler(seed=3), Sampler(seed=3)
    seq_a = [a(logits, rand_b).token_ids for _ in range(10)]
    seq_b = []
    for _ in range(10):
        b(logits, greedy_b)
        seq_b.append(b(logits, rand_b).token_ids)
    assert seq_a == seq_b


# --- seeds ------------------------------------------------------------------

def _seeded_run(seed: int, position: int, others: list[tuple[SamplingParams, int | None]],
                steps: int = 40, vocab: int = 50) -> list[int]:
    """Tokens of a seeded row placed at ``position`` among ``others`` over ``steps``."""
    logit_gen = torch.Generator().manual_seed(1234)
    sampler = Sampler(seed=99 + position)  # shared stream differs per layout on purpose
    rows = list(others)
    rows.insert(position, (P(temperature=1.0, seed=seed, top_p=0.95), seed))
    params = [p for p, _ in rows]
    got: list[int] = []
    other_outputs = [[] for _ in rows]
    for _ in range(steps):
        step_logits = torch.randn(vocab, generator=logit_gen)  # [V] same for the seeded row
        logits = torch.randn(len(rows), vocab)  # [B, V] noise elsewhere
        logits[position] = step_logits
        outputs = list(other_outputs)
        outputs[position] = got
        out = sampler(logits, batch(params, outputs=outputs))
        for j, t in enumerate(out.token_ids):
            other_outputs[j].append(t)
        got.append(out.token_ids[position])
    return got


def test_seed_reproducible_alone_or_in_any_batch():
    alone = _seeded_run(42, 0, [])
    assert len(set(alone)) > 5  # actually random, not degenerate
    others = [(P(temperature=1.0), None), (P(temperature=0.7, seed=7), 7),
              (P(temperature=0.0), None), (P(temperature=1.3, top_k=5), None)]
    for pos in range(len(others) + 1):
        assert _seeded_run(42, pos, others) == alone


def test_different_seeds_differ():
    assert _seeded_run(42, 0, []) != _seeded_run(43, 0, [])


def test_same_seed_rows_in_one_batch_agree():
    logits = torch.randn(1, 100).expand(3, -1).clone()
    params = [P(temperature=1.0, seed=11)] * 3
    out = Sampler()(logits, batch(params))
    assert len(set(out.token_ids)) == 1


def test_seeded_draw_depends_only_on_seed_and_output_index():
    """Counter-based noise: token i of a seeded request is the same whatever ran before
    (another worker, a preemption, a re-drive), and differs between indices."""
    torch.manual_seed(0)
    logits = torch.randn(1, 1000)
    p = P(temperature=1.0, seed=5)
    history_a, history_b = [1, 2, 3], [9, 9, 9]  # same length, other tokens
    a = Sampler(seed=1)(logits, batch([p], outputs=[history_a])).token_ids
    b = Sampler(seed=2)(logits, batch([p], outputs=[history_b])).token_ids
    assert a == b
    draws = {Sampler()(logits, batch([p], outputs=[[0] * i])).token_ids[0] for i in range(30)}
    assert len(draws) > 10  # a fresh draw per output index


def test_noise_key_is_a_stable_hash():
    assert noise_key(0, 0) != noise_key(0, 1) != noise_key(1, 0)
    assert noise_key(2**63 - 1, 10**9) < 2**63
    assert noise_key(123, 4) == noise_key(123, 4)


# --- masks ------------------------------------------------------------------

def test_top_k_1_equals_greedy():
    torch.manual_seed(0)
    logits = torch.randn(16, 200)
    greedy = Sampler(seed=0)(logits, batch([P(temperature=0.0)] * 16)).token_ids
    topk1 = Sampler(seed=0)(logits, batch([P(temperature=1.5, top_k=1)] * 16)).token_ids
    assert topk1 == greedy == logits.argmax(-1).tolist()


def test_top_k_restricts_support():
    logits = torch.tensor([0.0, 2.0, 1.9, -1.0, 1.8, 1.7, 0.5])
    assert support(logits, P(temperature=1.0, top_k=3)) == {1, 2, 4}
    assert support(logits, P(temperature=1.0)) == set(range(7))


PROBS = [0.5, 0.3, 0.15, 0.05]


@pytest.mark.parametrize("top_p, expected", [
    (0.8, {0, 1}), (0.81, {0, 1, 2}), (0.5, {0}), (0.01, {0}), (0.96, {0, 1, 2, 3}), (1.0, {0, 1, 2, 3}),
])
def test_top_p_exact_set(top_p, expected):
    logits = log_probs(PROBS)
    masked = apply_sampling_masks(logits[None], top_p=torch.tensor([top_p]))[0]
    assert set(torch.isfinite(masked).nonzero().flatten().tolist()) == expected
    assert support(logits, P(temperature=1.0, top_p=top_p)) == expected


@pytest.mark.parametrize("parts, top_p, kept", [
    ([9, 8, 6, 2, 2], 9 / 27, 1), ([6, 5, 4, 2, 2], 17 / 19, 4), ([10, 9, 6, 5, 4, 3], 19 / 37, 2),
])
def test_top_p_mass_exactly_reached_despite_float_noise(parts, top_p, kept):
    # The top `kept` tokens hold exactly top_p; float32 sums land just below it.
    logits = log_probs([x / sum(parts) for x in parts])
    masked = apply_sampling_masks(logits[None], top_p=torch.tensor([top_p]))[0]
    assert torch.isfinite(masked).nonzero().flatten().tolist() == list(range(kept))


def test_top_p_after_top_k_renormalises():
    # top_k=2 leaves [0.625, 0.375]; top_p=0.6 then keeps only token 0.
    logits = log_probs(PROBS)
    assert support(logits, P(temperature=1.0, top_k=2, top_p=0.6)) == {0}
    assert support(logits, P(temperature=1.0, top_k=3, top_p=0.6)) == {0, 1}


@pytest.mark.parametrize("min_p, expected", [
    (0.25, {0, 1, 2}), (0.7, {0}), (0.05, {0, 1, 2, 3}), (1.0, {0}),
])
def test_min_p_exact_set(min_p, expected):
    logits = log_probs(PROBS)
    masked = apply_sampling_masks(logits[None], min_p=torch.tensor([min_p]))[0]
    assert set(torch.isfinite(masked).nonzero().flatten().tolist()) == expected
    assert support(logits, P(temperature=1.0, min_p=min_p)) == expected


def test_masks_are_per_row():
    logits = log_probs(PROBS).expand(3, -1)
    masked = apply_sampling_masks(logits, top_k=torch.tensor([1, 4, 4]),
                                  top_p=torch.tensor([1.0, 0.8, 1.0]),
                                  min_p=torch.tensor([0.0, 0.0, 0.25]))
    assert torch.isfinite(masked).tolist() == [
        [True, False, False, False], [True, True, False, False], [True, True, True, False]]


# --- distribution -----------------------------------------------------------

@pytest.mark.parametrize("temperature", [1.0, 2.0, 0.5])
def test_empirical_frequencies_match_softmax(temperature):
    probs = torch.tensor([0.4, 0.3, 0.2, 0.1])
    n = 40000
    logits = probs.log().expand(n, -1).clone()
    out = Sampler(seed=1)(logits, batch([P(temperature=temperature)] * n))
    freq = torch.bincount(torch.tensor(out.token_ids), minlength=4).float() / n
    expected = torch.softmax(probs.log() / temperature, dim=-1)
    assert torch.allclose(freq, expected, atol=0.01), (freq, expected)


def test_seeded_rows_follow_the_distribution_too():
    probs = torch.tensor([0.6, 0.3, 0.1])
    logits = probs.log()[None]
    s = Sampler()
    toks = [s(logits, batch([P(seed=2024)], outputs=[range(i)])).token_ids[0] for i in range(6000)]
    freq = torch.bincount(torch.tensor(toks), minlength=3).float() / len(toks)
    assert torch.allclose(freq, probs, atol=0.02), freq


# --- penalties and bans -----------------------------------------------------

def test_apply_penalties_exact_values():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0]] * 2)
    params = [P(repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25), P()]
    b = batch(params, prompts=[[0], [0]], outputs=[[1, 1, 3], [1, 1, 3]])
    out = apply_penalties(logits, b)
    # rep on {0,1,3}: 2/2=1, -1*2=-2, 3/2=1.5; then token1: -2-0.5-2*0.25, token3: 1.5-0.5-0.25
    assert out[0].tolist() == [1.0, -3.0, 0.5, 0.75, -2.0]
    assert out[1].tolist() == logits[1].tolist()  # row without penalties untouched
    assert logits[0].tolist() == [2.0, -1.0, 0.5, 3.0, -2.0]  # input not modified


def test_presence_frequency_ignore_prompt_repetition_uses_it():
    logits = torch.tensor([[1.0, 1.0, 1.0, -1.0]] * 3)
    params = [P(presence_penalty=1.0), P(frequency_penalty=-0.5), P(repetition_penalty=2.0)]
    b = batch(params, prompts=[[0, 3]] * 3, outputs=[[1, 1, 1]] * 3)
    out = apply_penalties(logits, b)
    assert out[0].tolist() == [1.0, 0.0, 1.0, -1.0]
    assert out[1].tolist() == [1.0, 2.5, 1.0, -1.0]
    assert out[2].tolist() == [0.5, 0.5, 1.0, -2.0]


def test_no_penalties_is_the_same_tensor():
    logits = torch.randn(2, 8)
    assert apply_penalties(logits, batch([P(), P(temperature=0.0)], outputs=[[1], [2]])) is logits


def test_penalties_steer_greedy():
    logits = torch.tensor([[3.0, 2.0, 1.0]])
    s = Sampler(seed=0)
    assert s(logits, batch([P(temperature=0.0)], outputs=[[0]])).token_ids == [0]
    b = batch([P(temperature=0.0, repetition_penalty=2.0)], outputs=[[0]])
    assert s(logits, b).token_ids == [1]  # 3/2 = 1.5 < 2
    b = batch([P(temperature=0.0, frequency_penalty=0.6)], outputs=[[0, 0]])
    assert s(logits, b).token_ids == [1]  # 3 - 1.2 = 1.8 < 2


def test_banned_ids_never_sampled():
    logits = torch.tensor([[5.0, 4.0, 0.0, 0.0]])
    s = Sampler(seed=0)
    assert s(logits, batch([P(temperature=0.0)], banned=[[0]])).token_ids == [1]
    n = 3000
    many = torch.zeros(n, 6)
    out = s(many, batch([P(temperature=1.0)] * n, banned=[[2, 5]] * n))
    assert set(out.token_ids) == {0, 1, 3, 4}
    assert s(logits, batch([P(temperature=0.0)], banned=[[99, -1]])).token_ids == [0]  # out of range ignored


def test_logit_bias_adds_to_its_own_row_before_the_penalties():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0]] * 3)
    params = [P(logit_bias={3: -4.0, 1: 2.5}), P(), P(logit_bias={0: 1.0}, repetition_penalty=2.0)]
    out = apply_logit_bias(logits, params)
    assert out[0].tolist() == [2.0, 1.5, 0.5, -1.0]
    assert out[1].tolist() == logits[1].tolist() and out[2].tolist() == [3.0, -1.0, 0.5, 3.0]
    assert logits[0].tolist() == [2.0, -1.0, 0.5, 3.0]  # input not modified
    assert apply_logit_bias(logits, [P(), P(), P()]) is logits
    # biased first, then penalised: (2 + 1) / 2 for the seen token 0
    s = Sampler(seed=0)
    b = batch([P(temperature=0.0, logit_bias={0: 1.0}, repetition_penalty=2.0)], prompts=[[0]])
    assert s(logits[:1], b).token_ids == [3]  # 1.5 < 3


def test_logit_bias_forces_and_bans_tokens_greedy_seeded_and_random():
    torch.manual_seed(1)
    logits = torch.randn(1, 50)
    top = int(logits.argmax())
    s = Sampler(seed=0)
    assert s(logits, batch([P(temperature=0.0, logit_bias={7: 100.0})])).token_ids == [7]
    assert s(logits, batch([P(temperature=0.0, logit_bias={top: -100.0})])).token_ids != [top]
    n = 2000
    many = logits.expand(n, -1).clone()
    banned = {top: -100.0, 3: -100.0}
    assert not {top, 3} & set(s(many, batch([P(temperature=1.0, logit_bias=banned)] * n)).token_ids)
    seeded = [P(temperature=1.0, seed=i, logit_bias={9: 100.0}) for i in range(20)]
    assert set(s(logits.expand(20, -1).clone(), batch(seeded)).token_ids) == {9}
    # a seeded row draws the same token alone or beside other rows
    row = P(temperature=1.0, seed=5, logit_bias={2: 3.0, 4: 3.0})
    alone = s(logits, batch([row])).token_ids
    assert s(logits.expand(3, -1).clone(), batch([P(), row, P(temperature=0.0)])).token_ids[1] == alone[0]


def test_logit_bias_leaves_logprobs_raw():
    logits = torch.tensor([[0.0, 1.0, 2.0]])
    out = Sampler(seed=0)(logits, batch([P(temperature=0.0, logprobs=1, logit_bias={0: 100.0})]))
    assert out.token_ids == [0]
    assert out.logprobs[0].logprob == pytest.approx(torch.log_softmax(logits, -1)[0, 0].item())


# --- logprobs ---------------------------------------------------------------

def test_logprobs_are_raw_log_softmax():
    torch.manual_seed(0)
    logits = torch.randn(4, 30)
    params = [P(temperature=0.0, logprobs=5, repetition_penalty=3.0),
              P(temperature=0.7, top_k=3, logprobs=0),
              P(temperature=1.0),
              P(temperature=1.0, logprobs=2, seed=1)]
    out = Sampler(seed=0)(logits, batch(params, outputs=[[int(logits[0].argmax())], [], [], []]))
    ref = torch.log_softmax(logits, dim=-1)
    assert out.logprobs[2] is None
    for i, n in ((0, 5), (1, 0), (3, 2)):
        lp = out.logprobs[i]
        assert lp is not None and lp.token_id == out.token_ids[i]
        assert lp.logprob == pytest.approx(ref[i, lp.token_id].item(), abs=1e-6)
        assert len(lp.top) == n
        expected = torch.topk(ref[i], n) if n else None
        if n:
            assert [t for t, _ in lp.top] == expected.indices.tolist()
            assert [v for _, v in lp.top] == pytest.approx(expected.values.tolist(), abs=1e-6)
            assert all(a[1] >= b[1] for a, b in zip(lp.top, lp.top[1:]))
    # The penalty moved greedy off the raw argmax, logprob still raw.
    assert out.token_ids[0] != int(logits[0].argmax())
    assert out.logprobs[0].top[0][0] == int(logits[0].argmax())


def test_logprobs_probabilities_sum_to_one():
    logits = torch.tensor([[0.0, 1.0, 2.0]])
    lp = Sampler(seed=0)(logits, batch([P(temperature=0.0, logprobs=3)])).logprobs[0]
    assert math.isclose(sum(math.exp(v) for _, v in lp.top), 1.0, rel_tol=1e-6)


# --- misc -------------------------------------------------------------------

def test_seeded_uniform_reproducible_and_in_range():
    draws = [seeded_uniform(7, i) for i in range(2000)]
    assert draws == [seeded_uniform(7, i) for i in range(2000)]
    assert len(set(draws)) == 2000 and all(0.0 <= u < 1.0 for u in draws)
    assert abs(sum(draws) / len(draws) - 0.5) < 0.03
    assert seeded_uniform(2**64 - 1, 2**40) < 1.0


@pytest.mark.parametrize("scale", [1.0, 3.0])  # rows need not sum to 1
def test_draw_from_takes_the_interval_u_falls_in_never_an_empty_one(scale, sampling_kernels):
    probs = torch.tensor([0.0, 0.25, 0.0, 0.0, 0.75, 0.0]) * scale  # [V]
    cases = {0.0: 1, 0.2499: 1, 0.25: 4, 0.9999999: 4, float(1 - 2.0 ** -53): 4}
    u = torch.tensor(list(cases), dtype=torch.float64)
    got = draw_from(probs.expand(len(cases), -1).contiguous(), u, sampling_kernels).tolist()
    assert got == list(cases.values())


@pytest.mark.parametrize("seed", range(4))
def test_native_draws_are_torchs_draws(seed):
    """The native inverse CDF sums in torch's order and skips only zeros: the same token
    for every row, masked or flat, tiny or huge masses, u anywhere in [0, 1); rows with no
    finite positive total are drawn by torch."""
    kernels = cpu_kernels.load()
    if kernels is None:
        pytest.skip("no C compiler on this machine")
    g = torch.Generator().manual_seed(seed)
    probs = torch.softmax(torch.randn(64, 5000, generator=g) * 3, dim=-1)  # [R, V]
    probs[0::4] *= torch.rand(16, 5000, generator=g) < 0.02  # masked: mostly zeros
    probs[1::8] = probs[1::8] * 1e-30  # subnormal-scale masses
    probs[2::8] = (probs[2::8] * 64).round() / 64  # ties, and zeros
    probs[3::16] = 1e30  # huge and flat
    probs[5] = 0.0  # nothing to draw
    probs[7, 100] = float("nan")
    probs[11, 7] = float("inf")
    u = torch.rand(64, generator=g, dtype=torch.float64)
    u[::9] = 0.0
    u[1::9] = 1 - 2.0 ** -53
    want = draw_from(probs, u)
    assert torch.equal(kernels.inverse_cdf(probs[[0, 1, 2]], u[[0, 1, 2]]), want[[0, 1, 2]])
    assert kernels.inverse_cdf(probs[[5, 7, 11]], u[[5, 7, 11]]).tolist() == [-1, -1, -1]
    assert torch.equal(draw_from(probs, u, kernels), want)


def test_shared_seed_reproducible_and_half_precision_input():
    logits = torch.randn(8, 40).to(torch.bfloat16)
    b = batch([P(temperature=1.0)] * 8)
    assert Sampler(seed=5)(logits, b).token_ids == Sampler(seed=5)(logits, b).token_ids


def test_mismatched_batch_raises():
    with pytest.raises(ValueError, match="prompt_token_ids"):
        Sampler()(torch.zeros(2, 4), SamplingBatch([P(), P()], [[]], [[], []], [[], []]))
    with pytest.raises(ValueError, match="batch, vocab"):
        Sampler()(torch.zeros(4), batch([P()]))


def test_the_native_argmax_changes_no_token():
    from tandem.engine.kernels import cpu_kernels

    kernels = cpu_kernels.load()
    if kernels is None:
        pytest.skip("no C compiler on this machine")
    logits = torch.randn(8, 3000)
    logits[0, 5] = logits[0, 9] = 40.0  # a greedy tie
    params = [P(temperature=0.0), P(temperature=0.0), P(temperature=0.8, seed=3),
              P(temperature=1.0, top_k=50, seed=4), P(temperature=0.0, repetition_penalty=1.3),
              P(temperature=0.7), P(temperature=0.0, logprobs=2), P(temperature=1.2, top_p=0.9)]
    plain = Sampler(seed=5)(logits, batch(params, outputs=[[1, 2]] * 8))
    native = Sampler(seed=5, kernels=kernels)(logits, batch(params, outputs=[[1, 2]] * 8))
    assert native.token_ids == plain.token_ids and native.token_ids[0] == 5
    assert native.logprobs == plain.logprobs
