"""The offline API as users rely on it: ``LLM(...).generate/chat`` on the embedded default
model, finish reasons, logprobs, stop strings, seeds, validation, abort and context limits.

Every expected value is exact: tokens come from a first greedy run (or from HF transformers),
and the second run must reproduce them, cut at exactly the right place.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import torch

from tandem.common.sampling_params import FinishReason, SamplingParams
from tandem.engine.default_model import PRESETS
from tandem.engine.llm import LLM

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
PROMPTS = ["The cache block", "Alice and Bob walk to the river.", "def build_model(x, y=3):", "Hello"]


def assert_clean(llm: LLM) -> None:
    """Nothing queued, running or held, and every KV block back in the pool."""
    eng = llm.engine
    assert not eng.has_unfinished()
    assert eng.num_waiting == 0 and eng.num_running == 0
    assert eng.scheduler.seqs == {}
    assert eng.block_pool.num_free == eng.block_pool.num_blocks
    eng.block_pool.check_invariants()


def first(out) -> object:
    assert len(out.outputs) == 1
    return out.outputs[0]


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("tandem-cache")


@pytest.fixture(scope="module")
def llm(cache_dir) -> LLM:
    """The random ``small`` preset, written into the cache on first use."""
    from tandem.engine.default_model import default_model_path

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TANDEM_CACHE_DIR", str(cache_dir))
        return LLM(str(default_model_path("small")))


@pytest.fixture(scope="module")
def model_dir(llm) -> str:
    return llm.engine.model_path


@pytest.fixture(scope="module")
def short_llm(model_dir) -> LLM:
    """The same checkpoint with a 64-token context."""
    return LLM(model_dir, max_model_len=64, num_blocks=64)


# --------------------------------------------------------------------- default model
def test_default_model_is_written_into_the_cache(llm, cache_dir):
    path = Path(llm.engine.model_path)
    assert path.parent == cache_dir / "models"
    assert path.name.startswith("small-seed0-")
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "model.safetensors"):
        assert (path / name).is_file(), name
    p, mc = PRESETS["small"], llm.engine.model_config
    assert (mc.hidden_size, mc.num_layers, mc.num_heads, mc.num_kv_heads, mc.vocab_size) == (
        p.hidden_size, p.num_hidden_layers, p.num_attention_heads, p.num_key_value_heads, p.vocab_size)
    assert llm.engine.dtype == torch.float32
    assert llm.engine.max_model_len == p.max_position_embeddings
    # a second LLM() with the same cache reuses the folder
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TANDEM_CACHE_DIR", str(cache_dir))
        from tandem.engine.default_model import default_model_path
        assert default_model_path("small") == path


def test_default_model_greedy_matches_transformers(llm, model_dir):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=4)
    outs = llm.generate(PROMPTS[:2], params)
    for out in outs:
        ids = list(out.prompt_token_ids)
        comp = first(out)
        with torch.no_grad():
            for step in range(12):
                row = hf(torch.tensor([ids])).logits[0, -1].float().log_softmax(-1)
                tok = int(row.argmax())
                assert comp.token_ids[step] == tok, f"step {step}"
                lp = comp.logprobs[step]
                assert lp.logprob == pytest.approx(float(row[tok]), abs=2e-4)
                assert [t for t, _ in lp.top] == row.topk(4).indices.tolist()
                ids.append(tok)


# --------------------------------------------------------------------- prompts
def test_string_token_id_and_mixed_prompts(llm):
    tok = llm.tokenizer
    s1, s2 = PROMPTS[0], PROMPTS[1]
    ids1, ids2 = tok.encode(s1), tok.encode(s2)
    by_str = llm.generate([s1, s2], GREEDY)
    by_ids = llm.generate([ids1, ids2], GREEDY)
    mixed = llm.generate([ids1, s2], GREEDY)
    single_ids = llm.generate(ids1, GREEDY)  # one prompt given as a flat list of ids
    single_str = llm.generate(s2, GREEDY)
    assert len(by_str) == len(by_ids) == len(mixed) == 2
    assert len(single_ids) == len(single_str) == 1

    assert [o.prompt for o in by_str] == [s1, s2]
    assert [o.prompt for o in by_ids] == [None, None]
    assert [o.prompt for o in mixed] == [None, s2]
    for batch in (by_str, by_ids, mixed):
        assert [o.prompt_token_ids for o in batch] == [ids1, ids2]
    assert single_ids[0].prompt_token_ids == ids1 and single_str[0].prompt_token_ids == ids2

    expected = [first(by_str[0]).token_ids, first(by_str[1]).token_ids]
    assert expected[0] != expected[1]
    for batch in (by_ids, mixed):
        assert [first(o).token_ids for o in batch] == expected
    assert first(single_ids[0]).token_ids == expected[0]
    assert first(single_str[0]).token_ids == expected[1]

    all_outs = by_str + by_ids + mixed + single_ids + single_str
    assert len({o.request_id for o in all_outs}) == len(all_outs)
    for o in all_outs:
        c = first(o)
        assert c.index == 0
        assert len(c.token_ids) == 16
        assert c.finish_reason == FinishReason.LENGTH
        assert c.text == tok.decode(c.token_ids)
        assert c.logprobs is None
    assert_clean(llm)


def test_n_completions_are_distinct_and_indexed(llm):
    tok = llm.tokenizer
    p = SamplingParams(n=4, temperature=1.0, max_tokens=12, ignore_eos=True)
    outs = llm.generate([PROMPTS[0], PROMPTS[3]], [p, dataclasses.replace(p, n=1)])
    assert [len(o.outputs) for o in outs] == [4, 1]
    comps = outs[0].outputs
    assert [c.index for c in comps] == [0, 1, 2, 3]
    assert len({tuple(c.token_ids) for c in comps}) == 4
    for c in comps + outs[1].outputs:
        assert len(c.token_ids) == 12
        assert c.finish_reason == FinishReason.LENGTH
        assert c.text == tok.decode(c.token_ids)

    seeded = dataclasses.replace(p, n=3, seed=77)
    a = [c.token_ids for c in llm.generate(PROMPTS[0], seeded)[0].outputs]
    b = [c.token_ids for c in llm.generate(PROMPTS[0], seeded)[0].outputs]
    assert a == b and len({tuple(t) for t in a}) == 3

    greedy_n = llm.generate(PROMPTS[0], dataclasses.replace(GREEDY, n=2))[0].outputs
    greedy_1 = first(llm.generate(PROMPTS[0], GREEDY)[0]).token_ids
    assert [c.index for c in greedy_n] == [0, 1]
    assert greedy_n[0].token_ids == greedy_n[1].token_ids == greedy_1
    assert_clean(llm)


def test_chat_applies_the_template(llm):
    tok = llm.tokenizer
    conv1 = [{"role": "system", "content": "You are brief."},
             {"role": "user", "content": "Hello there"}]
    conv2 = [{"role": "user", "content": "Tell me about the river."}]
    rendered = ("<|im_start|>system\nYou are brief.<|im_end|>\n"
                "<|im_start|>user\nHello there<|im_end|>\n<|im_start|>assistant\n")
    ids = tok.encode(rendered, add_special_tokens=False)
    assert ids[0] == tok.backend.token_to_id("<|im_start|>")

    out = llm.chat(conv1, GREEDY)
    assert len(out) == 1
    assert out[0].prompt_token_ids == ids
    direct = first(llm.generate(ids, GREEDY)[0])
    assert first(out[0]).token_ids == direct.token_ids
    assert first(out[0]).text == tok.decode(direct.token_ids)

    both = llm.chat([conv1, conv2], GREEDY)
    assert len(both) == 2
    assert first(both[0]).token_ids == direct.token_ids
    assert first(both[1]).token_ids == first(llm.chat(conv2, GREEDY)[0]).token_ids
    assert both[1].prompt_token_ids == tok.encode(
        "<|im_start|>user\nTell me about the river.<|im_end|>\n<|im_start|>assistant\n",
        add_special_tokens=False)
    assert_clean(llm)


# --------------------------------------------------------------------- finish reasons
def test_finish_length_and_stop_token_id(llm):
    tok = llm.tokenizer
    base = SamplingParams(temperature=0.0, max_tokens=16, logprobs=2)
    ref = first(llm.generate(PROMPTS[1], base)[0])
    assert ref.finish_reason == FinishReason.LENGTH and len(ref.token_ids) == 16
    toks = ref.token_ids
    k = next(i for i in range(4, 12) if toks[i] not in toks[:i])

    out = first(llm.generate(PROMPTS[1], dataclasses.replace(base, stop_token_ids=(toks[k],)))[0])
    assert out.finish_reason == FinishReason.STOP
    assert out.token_ids == toks[:k + 1]  # the stop token is the last token
    assert out.text == tok.decode(toks[:k])  # ... but its text is not in the output
    assert len(out.logprobs) == k + 1
    assert [lp.token_id for lp in out.logprobs] == toks[:k + 1]

    # min_tokens bans the stop token until then: the run goes past step k
    late = first(llm.generate(PROMPTS[1], dataclasses.replace(
        base, stop_token_ids=(toks[k],), min_tokens=k + 1))[0])
    assert late.token_ids[:k] == toks[:k]
    assert toks[k] not in late.token_ids[:k + 1]
    assert len(late.token_ids) > k + 1
    assert_clean(llm)


def test_logprobs_shape_and_values(llm):
    outs = llm.generate(PROMPTS[:2], [SamplingParams(temperature=0.0, max_tokens=10, logprobs=5),
                                      SamplingParams(temperature=1.0, seed=3, max_tokens=10,
                                                     ignore_eos=True, logprobs=20)])
    greedy, rand = first(outs[0]), first(outs[1])
    for comp, n in ((greedy, 5), (rand, 20)):
        assert len(comp.logprobs) == len(comp.token_ids) == 10
        for tok_id, lp in zip(comp.token_ids, comp.logprobs):
            assert lp.token_id == tok_id
            assert len(lp.top) == n
            assert len({t for t, _ in lp.top}) == n
            values = [v for _, v in lp.top]
            assert values == sorted(values, reverse=True)
            assert all(v <= 0 for v in values) and lp.logprob <= 0
            assert sum(math.exp(v) for v in values) <= 1 + 1e-5
            if tok_id in dict(lp.top):
                assert dict(lp.top)[tok_id] == pytest.approx(lp.logprob, abs=1e-6)
    for tok_id, lp in zip(greedy.token_ids, greedy.logprobs):
        assert lp.top[0][0] == tok_id  # greedy takes the most likely token
    zero = first(llm.generate(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=4, logprobs=0))[0])
    assert len(zero.logprobs) == 4 and all(lp.top == [] for lp in zero.logprobs)
    assert [lp.token_id for lp in zero.logprobs] == zero.token_ids
    assert_clean(llm)


# --------------------------------------------------------------------- stop strings
def _pick_stop_string(tok, ids: list[int]) -> tuple[int, int, int, str]:
    """A printable-ASCII substring of the decoded text that starts inside token k and ends
    inside token k+2 (so it spans two token boundaries) and occurs first there.
    Returns (k, start, end, substring)."""
    full = tok.decode(ids)
    offs = [len(tok.decode(ids[:j])) for j in range(len(ids) + 1)]
    for k in range(2, len(ids) - 3):
        if any(tok.decode(ids[:j]) != full[:offs[j]] for j in range(k + 4)):
            continue
        if offs[k + 1] - offs[k] < 2 or offs[k + 3] - offs[k + 2] < 2:
            continue
        a, b = offs[k] + 1, offs[k + 2] + 1
        sub = full[a:b]
        if all(c.isascii() and c.isprintable() for c in sub) and sub.strip() and full.find(sub) == a:
            return k, a, b, sub
    raise AssertionError(f"no usable stop string in {full!r}")


@pytest.mark.parametrize("prompt", PROMPTS[:3])
def test_stop_string_spanning_tokens(llm, prompt):
    tok = llm.tokenizer
    base = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    ref = first(llm.generate(prompt, base)[0])
    full = ref.text
    assert full == tok.decode(ref.token_ids)
    k, a, b, stop = _pick_stop_string(tok, ref.token_ids)

    out = first(llm.generate(prompt, dataclasses.replace(base, stop=[stop]))[0])
    assert out.finish_reason == FinishReason.STOP
    assert out.text == full[:a]  # ends exactly before the stop string
    assert out.token_ids == ref.token_ids[:k + 3]  # stops at the token completing it

    inc = first(llm.generate(prompt, dataclasses.replace(
        base, stop=[stop], include_stop_str_in_output=True))[0])
    assert inc.finish_reason == FinishReason.STOP
    assert inc.text == full[:b] and inc.text.endswith(stop)
    assert inc.token_ids == ref.token_ids[:k + 3]

    # several stop strings: the one completing first wins, wherever it is in the list
    later = next(full[j:j + 4] for j in range(b + 1, len(full) - 4) if full.find(full[j:j + 4]) > b)
    for stops in (["zqzqzq", later, stop], [stop, later]):
        two = first(llm.generate(prompt, dataclasses.replace(base, stop=stops))[0])
        assert two.text == full[:a] and two.token_ids == ref.token_ids[:k + 3]
    unseen = first(llm.generate(prompt, dataclasses.replace(base, stop=["zqzqzq§"]))[0])
    assert unseen.finish_reason == FinishReason.LENGTH
    assert unseen.token_ids == ref.token_ids and unseen.text == full
    assert_clean(llm)


# --------------------------------------------------------------------- seeds
def test_seeded_request_is_independent_of_its_batch(llm):
    seeded = SamplingParams(temperature=1.0, seed=1234, max_tokens=16, ignore_eos=True)
    target = PROMPTS[3]
    alone = first(llm.generate(target, seeded)[0]).token_ids
    assert first(llm.generate(target, seeded)[0]).token_ids == alone

    batch1 = llm.generate(
        [PROMPTS[0], PROMPTS[1], target, PROMPTS[2]],
        [SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True),
         GREEDY, seeded,
         SamplingParams(temperature=0.7, top_k=50, top_p=0.9, seed=99, max_tokens=8, ignore_eos=True)])
    assert first(batch1[2]).token_ids == alone
    batch2 = llm.generate(
        [target, "A much longer prompt that keeps the prefill busy for a while " * 3, PROMPTS[0]],
        [seeded, SamplingParams(temperature=1.2, min_p=0.05, max_tokens=5, ignore_eos=True),
         SamplingParams(temperature=0.0, max_tokens=30, logprobs=3, ignore_eos=True)])
    assert first(batch2[0]).token_ids == alone

    # arriving mid-stream, after other requests have been decoding for a few steps
    eng = llm.engine
    tok = llm.tokenizer
    eng.add_request("seed-bg0", tok.encode(PROMPTS[0]),
                    SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True))
    eng.add_request("seed-bg1", tok.encode(PROMPTS[2]), GREEDY)
    got: list[int] = []
    for _ in range(3):
        eng.step()
    eng.add_request("seed-target", tok.encode(target), seeded)
    while eng.has_unfinished():
        for o in eng.step():
            if o.request_id == "seed-target":
                got += o.new_token_ids
    assert got == alone

    other = first(llm.generate(target, dataclasses.replace(seeded, seed=1235))[0]).token_ids
    assert other != alone
    assert_clean(llm)


# --------------------------------------------------------------------- validation
BAD_PROMPTS = {
    "empty string": ("", "empty"),
    "empty ids in a batch": ([[5, 6, 7], []], "empty"),
    "id == vocab": ([5, 1024], "outside the vocabulary"),
    "id > vocab in a batch": ([[3, 4], [7, 50000]], "outside the vocabulary"),
    "negative id": ([-1, 5], "outside the vocabulary"),
    "bool id": ([[5, True]], "outside the vocabulary"),
    "float id": ([[5, 6.0]], "outside the vocabulary"),
    "one bad among good": (["The cache block", [10, 11, 12], "Hello", [4, 2000]],
                           "outside the vocabulary"),
    "empty string among good": (["The cache block", "", "Hello"], "empty"),
}


@pytest.mark.parametrize("name", sorted(BAD_PROMPTS))
def test_bad_prompts_raise_before_queueing(llm, name):
    prompts, match = BAD_PROMPTS[name]
    steps = llm.engine.num_steps
    with pytest.raises(ValueError, match=match):
        llm.generate(prompts, GREEDY)
    assert llm.engine.num_steps == steps  # nothing ran
    assert_clean(llm)


def test_engine_still_serves_after_rejections(llm):
    expected = first(llm.generate(PROMPTS[0], GREEDY)[0]).token_ids
    with pytest.raises(ValueError):
        llm.generate([PROMPTS[0], [1, 2, 3], ""], GREEDY)
    with pytest.raises(ValueError, match="3 prompts but 2 sampling params"):
        llm.generate(PROMPTS[:3], [GREEDY, GREEDY])
    assert_clean(llm)
    assert first(llm.generate(PROMPTS[0], GREEDY)[0]).token_ids == expected


BAD_PARAMS = [
    (dict(temperature=-1), "temperature"),
    (dict(temperature=True), "temperature"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(top_p=0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=-5), "top_k"),
    (dict(top_k=2.5), "top_k"),
    (dict(min_p=1.5), "min_p"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(max_tokens=-3), "max_tokens"),
    (dict(logprobs=21), "logprobs"),
    (dict(logprobs=-1), "logprobs"),
    (dict(n=0), "n must"),
    (dict(n=1.0), "n must"),
    (dict(presence_penalty=3), "presence_penalty"),
    (dict(frequency_penalty=-2.5), "frequency_penalty"),
    (dict(repetition_penalty=0), "repetition_penalty"),
    (dict(seed=-1), "seed"),
    (dict(min_tokens=20, max_tokens=10), "min_tokens"),
    (dict(stop=[""]), "stop strings"),
    (dict(stop=["ok", 5]), "stop strings"),
    (dict(stop_token_ids=[-2]), "stop_token_ids"),
    (dict(logit_bias={5: 100.5}), "logit_bias values"),
    (dict(logit_bias={5: float("nan")}), "logit_bias values"),
    (dict(logit_bias={-1: 1.0}), "logit_bias token ids"),
    (dict(logit_bias={"5": 1.0}), "logit_bias token ids"),
    (dict(logit_bias=[(5, 1.0), (5, 2.0)]), "more than once"),
    (dict(logit_bias=[5]), "must map"),
    (dict(logit_bias={t: 1.0 for t in range(1025)}), "at most 1024"),
]


@pytest.mark.parametrize("kwargs,match", BAD_PARAMS, ids=[str(k) for k, _ in BAD_PARAMS])
def test_invalid_sampling_params_raise(llm, kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)
    with pytest.raises(ValueError, match=match):  # as users write it: nothing reaches the engine
        llm.generate(PROMPTS[0], SamplingParams(**kwargs))
    assert_clean(llm)


def test_valid_sampling_param_spellings():
    assert SamplingParams(stop="abc").stop == ("abc",)
    assert SamplingParams(stop=["a", "b"]).stop == ("a", "b")
    assert SamplingParams(stop=None).stop == ()
    assert SamplingParams(top_k=0).top_k is None and SamplingParams(top_k=-1).top_k is None
    assert SamplingParams(stop_token_ids=[5, 6]).stop_token_ids == (5, 6)
    assert SamplingParams(temperature=0).greedy and not SamplingParams().greedy
    assert SamplingParams(max_tokens=None).max_tokens is None
    assert SamplingParams(logit_bias={5: 1, 2: -1.5}).logit_bias == ((2, -1.5), (5, 1))
    assert SamplingParams(logit_bias=[(5, 1), (2, -1.5)]) == SamplingParams(logit_bias={2: -1.5, 5: 1})
    assert SamplingParams(logit_bias=None).logit_bias == ()


def test_logit_bias_bans_and_forces_tokens(llm):
    plain = first(llm.generate(PROMPTS[0], GREEDY)[0]).token_ids
    banned = first(llm.generate(PROMPTS[0], dataclasses.replace(
        GREEDY, logit_bias={t: -100.0 for t in plain[:3]}))[0]).token_ids
    assert not set(plain[:3]) & set(banned)
    forced = first(llm.generate(PROMPTS[0], dataclasses.replace(GREEDY, logit_bias={77: 100.0}))[0])
    assert set(forced.token_ids) == {77}
    assert_clean(llm)


def test_logit_bias_outside_the_vocabulary_is_refused_before_queueing(llm):
    steps = llm.engine.num_steps
    with pytest.raises(ValueError, match="logit_bias token id 1024 is outside the vocabulary"):
        llm.generate(PROMPTS[0], dataclasses.replace(GREEDY, logit_bias=((3, 1.0), (1024, 5.0))))
    assert llm.engine.num_steps == steps
    assert_clean(llm)


def test_stop_strings_work_end_to_end(llm):
    """A valid stop string list that never matches is accepted and changes nothing."""
    plain = first(llm.generate(PROMPTS[2], GREEDY)[0])
    with_stop = first(llm.generate(PROMPTS[2], dataclasses.replace(GREEDY, stop=("\x01\x02",)))[0])
    assert with_stop.token_ids == plain.token_ids and with_stop.text == plain.text


def test_n_with_largest_seed_leaves_engine_clean(model_dir):
    llm = LLM(model_dir, num_blocks=64)
    p = SamplingParams(n=2, seed=2**63 - 1, temperature=1.0, max_tokens=4, ignore_eos=True)
    try:
        out = llm.generate(PROMPTS[0], p)
        assert [c.index for c in out[0].outputs] == [0, 1]
    except ValueError:
        pass  # rejecting is fine too, if nothing was queued
    assert_clean(llm)
    assert len(first(llm.generate(PROMPTS[0], GREEDY)[0]).token_ids) == 16


# --------------------------------------------------------------------- context limit
def test_prompt_longer_than_context_is_rejected(short_llm):
    assert short_llm.engine.max_model_len == 64
    for n in (64, 65, 200):
        with pytest.raises(ValueError, match="context"):
            short_llm.generate([list(range(3, 3 + n))], GREEDY)
        assert_clean(short_llm)
    with pytest.raises(ValueError, match="context"):
        short_llm.generate([[5, 6, 7], list(range(3, 67))], GREEDY)
    assert_clean(short_llm)
    # 63 prompt tokens leave room for exactly one output token
    out = first(short_llm.generate([list(range(3, 66))], GREEDY)[0])
    assert len(out.token_ids) == 1 and out.finish_reason == FinishReason.LENGTH
    assert_clean(short_llm)


def test_context_limit_stops_with_length(llm, short_llm):
    prompt = list(range(100, 150))  # 50 tokens
    unlimited = first(llm.generate([prompt], dataclasses.replace(GREEDY, max_tokens=20))[0])
    for max_tokens in (100, None):
        out = first(short_llm.generate([prompt], dataclasses.replace(GREEDY, max_tokens=max_tokens))[0])
        assert out.finish_reason == FinishReason.LENGTH
        assert len(prompt) + len(out.token_ids) == 64
        assert out.token_ids == unlimited.token_ids[:14]
        assert out.text == short_llm.tokenizer.decode(out.token_ids)
    # max_tokens reached exactly at the limit: still length
    out = first(short_llm.generate([prompt], dataclasses.replace(GREEDY, max_tokens=14))[0])
    assert len(out.token_ids) == 14 and out.finish_reason == FinishReason.LENGTH
    assert_clean(short_llm)


# --------------------------------------------------------------------- abort
def _run_engine(eng, requests: dict[str, list[int]], params) -> dict[str, list[int]]:
    for rid, ids in requests.items():
        eng.add_request(rid, ids, params)
    got: dict[str, list[int]] = {rid: [] for rid in requests}
    while eng.has_unfinished():
        for o in eng.step():
            got[o.request_id] += o.new_token_ids
    return got


@pytest.mark.parametrize("steps_before_abort", [0, 1, 3])
def test_abort_isolates_the_other_requests(model_dir, steps_before_abort):
    # a small token budget: the 40-token prompt is prefilled in chunks, so aborting after
    # one step catches it mid-prefill holding blocks, after three steps mid-decode
    llm = LLM(model_dir, enable_prefix_caching=False, max_num_batched_tokens=24, block_size=8,
              num_blocks=128)
    eng = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompts = {f"r{i}": list(range(10 + 7 * i, 10 + 7 * i + n)) for i, n in enumerate((5, 40, 9, 17))}
    keep = {rid: p for rid, p in prompts.items() if rid != "r1"}
    reference = _run_engine(eng, {f"ref-{rid}": p for rid, p in keep.items()}, params)
    assert_clean(llm)

    for rid, ids in prompts.items():
        eng.add_request(rid, ids, params)
    got: dict[str, list[int]] = {rid: [] for rid in prompts}
    finished: dict[str, FinishReason] = {}
    for _ in range(steps_before_abort):
        for o in eng.step():
            got[o.request_id] += o.new_token_ids
    r1 = eng.scheduler.get("r1")
    if steps_before_abort == 0:
        assert r1.block_ids == []  # still waiting
    elif steps_before_abort == 1:
        assert 0 < r1.num_computed_tokens < 40 and r1.block_ids  # mid-prefill
    else:
        assert got["r1"] and r1.num_computed_tokens >= 40  # decoding
    held = len(r1.block_ids)
    free_before = eng.block_pool.num_free
    aborted = eng.abort("r1")
    assert aborted is not None and aborted.request_id == "r1"
    assert aborted.finished and aborted.finish_reason == FinishReason.ABORT
    assert aborted.new_token_ids == [] and aborted.num_output_tokens == len(got["r1"])
    assert eng.block_pool.num_free == free_before + held
    assert eng.abort("r1") is None
    assert eng.abort("no-such-request") is None
    while eng.has_unfinished():
        for o in eng.step():
            assert o.request_id != "r1", "an aborted request produced output"
            got[o.request_id] += o.new_token_ids
            if o.finished:
                finished[o.request_id] = o.finish_reason
    for rid in keep:
        assert got[rid] == reference[f"ref-{rid}"], rid
        assert finished[rid] == FinishReason.LENGTH
    assert_clean(llm)
