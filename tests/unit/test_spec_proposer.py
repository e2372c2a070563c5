"""The n-gram (prompt lookup) proposer and the per-sequence draft-length policy."""

from __future__ import annotations

import random

import pytest

from tandem.common.config import SpeculativeConfig
from tandem.common.sampling_params import SamplingParams
from tandem.engine.sequence import Sequence, SequenceStatus
from tandem.engine.spec.proposer import NgramProposer
from tandem.engine.spec.speculator import SequenceTokens, Speculator, best_k


def _brute_force(tokens: list[int], k: int, ns: range) -> list[int]:
    """Reference prompt lookup: longest n first, most recent earlier occurrence."""
    total = len(tokens)
    for n in ns:
        if n >= total:
            continue
        suffix = tokens[total - n:]
        for start in range(total - 1, n - 1, -1):  # continuation start, before the suffix's own
            if tokens[start - n:start] == suffix:
                out = tokens[start:]
                while len(out) < k:  # the stream repeats with period total - start
                    out += tokens[start:]
                return out[:k]
    return []


def test_copies_what_followed_the_latest_match():
    p = NgramProposer(2, 3)
    #         0  1  2  3  4  5  6  7  8  9
    tokens = [1, 2, 3, 9, 1, 2, 3, 8, 5, 1, 2, 3]
    assert p.propose("a", tokens, 2) == [8, 5]  # the later "1 2 3" wins over the first
    # "3 8 5 1" ends at index 9; what followed runs to the end, then repeats
    assert p.propose("b", tokens + [8, 5, 1], 7) == [2, 3, 8, 5, 1, 2, 3]


def test_prefers_the_longest_ngram():
    p = NgramProposer(1, 3)
    tokens = [4, 5, 6, 70, 9, 6, 71, 4, 5, 6]
    assert p.propose("a", tokens, 1) == [70]  # "4 5 6" beats the more recent "6"


def test_no_match_no_draft_and_never_its_own_suffix():
    p = NgramProposer(2, 2)
    assert p.propose("a", [1, 2, 3, 4], 3) == []
    assert p.propose("b", [7, 7], 3) == []  # the suffix itself is no earlier occurrence
    assert p.propose("c", [7, 7, 7], 3) == [7, 7, 7]  # "7 7" at 0..1, then the loop
    assert p.propose("d", [1, 2, 3, 1, 2], 0) == []


def test_incremental_index_matches_a_fresh_scan():
    rng = random.Random(0)
    p = NgramProposer(1, 4)
    tokens: list[int] = []
    for step in range(400):
        tokens.extend(rng.randrange(6) for _ in range(rng.choice((1, 1, 3))))
        k = rng.randrange(1, 6)
        assert p.propose("s", tokens, k) == _brute_force(tokens, k, p.ns), step
    p.drop("s")
    assert p.propose("s", tokens[:50], 3) == _brute_force(tokens[:50], 3, p.ns)  # rebuilt


def test_a_stream_that_shrinks_is_reindexed():
    p = NgramProposer(2, 2)
    assert p.propose("s", [1, 2, 3, 1, 2], 2) == [3, 1]
    assert p.propose("s", [5, 6, 7, 5], 2) == []  # "1 2" no longer in the stream
    assert p.propose("s", [5, 6, 7, 5, 6], 4) == [7, 5, 6, 7]


def test_sequence_tokens_view_reads_prompt_and_output():
    seq = Sequence("s", [1, 2, 3], SamplingParams(), output_token_ids=[4, 5])
    view = SequenceTokens(seq)
    assert len(view) == 5 and list(view) == [1, 2, 3, 4, 5]
    assert view[1:4] == [2, 3, 4] and view[-1] == 5 and view[3:] == [4, 5] and view[4:2] == []


def test_best_k_follows_the_acceptance_rate():
    assert best_k(0.0, 5, 0.15) == 0
    assert best_k(0.99, 5, 0.15) == 5
    ks = [best_k(r / 20, 8, 0.15) for r in range(20)]
    assert ks == sorted(ks) and ks[0] == 0 and ks[-1] >= 4
    assert best_k(0.9, 5, 0.0) == 5  # free verification: always the most


def _decoding(i: int, max_tokens: int | None = 100) -> Sequence:
    seq = Sequence(f"s{i}", [1, 2, 3, 1, 2, 3, 1, 2], SamplingParams(max_tokens=max_tokens),
                   output_token_ids=[3, 1, 2])
    seq.status, seq.num_computed_tokens = SequenceStatus.RUNNING, seq.num_tokens - 1
    return seq


def test_speculator_limits_batch_size_max_tokens_and_context():
    spec = Speculator(SpeculativeConfig(method="ngram", num_speculative_tokens=4, adaptive=False,
                                        max_batch_size=2))
    assert spec.propose([_decoding(0)], 1000) == {"s0": [3, 1, 2, 3]}
    assert spec.propose([_decoding(0), _decoding(1), _decoding(2)], 1000) == {}  # over the cap
    assert spec.propose([_decoding(0, max_tokens=5)], 1000) == {"s0": [3]}  # 2 left: 1 draft
    assert spec.propose([_decoding(0, max_tokens=4)], 1000) == {}  # last token: nothing to gain
    assert spec.propose([_decoding(0)], 13) == {"s0": [3]}  # 11 tokens, context 13
    prefilling = _decoding(3)
    prefilling.num_computed_tokens = 2
    assert spec.propose([prefilling], 1000) == {}


def test_speculator_adapts_k_and_probes_again():
    spec = Speculator(SpeculativeConfig(method="ngram", num_speculative_tokens=4))
    assert spec.draft_length("s", 64) == 1  # no history: one token probes, whatever the batch
    for _ in range(20):
        spec.observe("s", 4, 4)
    assert spec.draft_length("s") == 4
    for _ in range(20):
        spec.observe("s", 4, 0)
    assert spec.draft_length("s") == 0
    spec.observe("s", 4, 1)  # some success again
    ks = [spec.draft_length("s", batch) for batch in (1, 4, 8, 16, 32)]
    assert ks == sorted(ks, reverse=True) and ks[0] > ks[-1], "a larger batch drafts less"
    seq = _decoding(0)
    seq.seq_id = "s"
    for _ in range(100):  # not drafting: the rate drifts back until it probes again
        if spec.propose([seq], 1000):
            break
    else:
        pytest.fail("a sequence that stopped drafting never drafts again")
    assert (spec.num_proposed, spec.num_accepted, spec.num_drafts) == (164, 81, 41)
    spec.drop("s")
    assert spec.draft_length("s") == 1


def test_config_rejects_nonsense():
    with pytest.raises(ValueError, match="method"):
        SpeculativeConfig(method="medusa")
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        SpeculativeConfig(method="ngram", num_speculative_tokens=0)
    with pytest.raises(ValueError, match="ngram_min"):
        SpeculativeConfig(method="ngram", ngram_min=3, ngram_max=2)
    with pytest.raises(ValueError, match="draft_model"):
        SpeculativeConfig(method="draft")
    with pytest.raises(ValueError, match="draft_model"):
        SpeculativeConfig(method="ngram", draft_model="/m")
    with pytest.raises(ValueError, match="off"):
        Speculator(SpeculativeConfig())
