"""Tokenizer: loading, encode/decode and chat templates agree with transformers' AutoTokenizer."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest

from tandem.engine.default_model import write_model
from tandem.text.tokenizer import Tokenizer

TEXTS = [
    "Hello world",
    "héllo wörld 日本語 🎉",
    "def foo(x):\n    return x * 2  # comment\n",
    "  leading and trailing spaces  ",
    "<|im_start|>user\nhi<|im_end|>\n<|endoftext|>",
    "tabs\tand\r\nnewlines\n\n",
    "Привет мир, 中文字符, α β γ, €100",
    "",
]
CHATS = [
    [{"role": "user", "content": "Hello!"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "héllo 🎉"},
        {"role": "assistant", "content": "Hi."},
        {"role": "user", "content": "Again?"},
    ],
    [{"role": "user", "content": [{"type": "text", "text": "part one, "}, {"type": "text", "text": "part two"}]}],
    [{"role": "user", "content": "x", "name": None}],
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model("tiny", tmp_path_factory.mktemp("tok") / "tiny")


@pytest.fixture(scope="module")
def tok(model_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(model_dir)


@pytest.fixture(scope="module")
def hf(model_dir: Path):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(model_dir))


def _copy(model_dir: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "copy"
    shutil.copytree(model_dir, dst)
    return dst


def test_missing_files_name_the_path(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=str(tmp_path / "nope")):
        Tokenizer.from_dir(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer.from_dir(tmp_path)


def test_properties(tok: Tokenizer) -> None:
    ids = {t: tok.backend.token_to_id(t) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")}
    assert tok.eos_token_ids == frozenset({ids["<|im_end|>"], ids["<|endoftext|>"]})
    assert tok.bos_token_id == ids["<|endoftext|>"]
    assert tok.vocab_size == 1024
    assert tok.all_special_ids == frozenset(ids.values())
    assert tok.is_byte_level


def test_encode_decode_match_hf(tok: Tokenizer, hf) -> None:
    for text in TEXTS:
        for add in (True, False):
            assert tok.encode(text, add_special_tokens=add) == hf.encode(text, add_special_tokens=add), text
        ids = tok.encode(text)
        for skip in (True, False):
            assert tok.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)
    assert tok.decode(tok.encode("héllo wörld 日本語 🎉")) == "héllo wörld 日本語 🎉"
    assert tok.encode("hi")[0] != tok.bos_token_id  # no BOS prepended


def test_decode_random_ids_matches_hf(tok: Tokenizer, hf) -> None:
    rng = random.Random(0)
    for _ in range(200):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randint(1, 12))]
        for skip in (True, False):
            assert tok.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip), ids


def test_chat_template_matches_hf(tok: Tokenizer, hf) -> None:
    for chat in CHATS:
        for gen in (True, False):
            ours = tok.apply_chat_template(chat, add_generation_prompt=gen)
            assert ours == hf.apply_chat_template(chat, tokenize=False, add_generation_prompt=gen)
    text = tok.apply_chat_template(CHATS[0])
    assert text == "<|im_start|>user\nHello!<|im_end|>\n<|im_start|>assistant\n"
    assert tok.encode(text, add_special_tokens=False)[0] == tok.backend.token_to_id("<|im_start|>")


def test_chat_template_jinja_file_takes_precedence(model_dir: Path, tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    d = _copy(model_dir, tmp_path)
    (d / "chat_template.jinja").write_text(
        "{{ bos_token }}{% for m in messages %}[{{ m.role | upper }}] {{ m | tojson }} {{ eos_token }}\n{% endfor %}"
        "{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}",
        encoding="utf-8",
    )
    chat = [{"role": "user", "content": "<é & \"q\">"}]
    ours = Tokenizer.from_dir(d).apply_chat_template(chat)
    assert ours.startswith("<|endoftext|>[USER] {") and ours.endswith("<|im_end|>\nASSISTANT:")
    assert '"<é & \\"q\\">"' in ours  # tojson: no ASCII or HTML escaping
    hf = transformers.AutoTokenizer.from_pretrained(str(d))
    assert ours == hf.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)


def test_template_globals_and_errors(model_dir: Path, tmp_path: Path) -> None:
    d = _copy(model_dir, tmp_path)
    tpl = d / "chat_template.jinja"
    tpl.write_text("{% if messages[0].role != 'user' %}{{ raise_exception('first must be user') }}{% endif %}"
                   "{{ strftime_now('%Y') }}|{{ extra }}", encoding="utf-8")
    t = Tokenizer.from_dir(d)
    out = t.apply_chat_template([{"role": "user", "content": "x"}], extra="kw")
    assert out[:4].isdigit() and out.endswith("|kw")
    with pytest.raises(ValueError, match="first must be user"):
        t.apply_chat_template([{"role": "system", "content": "x"}])
    with pytest.raises(ValueError, match="empty"):
        t.apply_chat_template([])
    tpl.write_text("{% for %}", encoding="utf-8")
    with pytest.raises(ValueError, match="chat template"):
        Tokenizer.from_dir(d).apply_chat_template([{"role": "user", "content": "x"}])


def test_no_chat_template(model_dir: Path, tmp_path: Path) -> None:
    d = _copy(model_dir, tmp_path)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    del cfg["chat_template"]
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    t = Tokenizer.from_dir(d)
    assert t.chat_template is None
    with pytest.raises(ValueError, match="no chat template"):
        t.apply_chat_template([{"role": "user", "content": "x"}])


def test_eos_fallbacks(model_dir: Path, tmp_path: Path) -> None:
    d = _copy(model_dir, tmp_path)
    eos = d / "config.json"
    cfg = json.loads(eos.read_text())
    (d / "generation_config.json").unlink()
    cfg["eos_token_id"] = 0
    eos.write_text(json.dumps(cfg))
    assert Tokenizer.from_dir(d).eos_token_ids == {0}  # from config.json
    del cfg["eos_token_id"]
    eos.write_text(json.dumps(cfg))
    t = Tokenizer.from_dir(d)  # from tokenizer_config's eos_token
    assert t.eos_token_ids == {t.backend.token_to_id("<|im_end|>")}


def test_only_tokenizer_json(model_dir: Path, tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").write_bytes((model_dir / "tokenizer.json").read_bytes())
    t = Tokenizer.from_dir(tmp_path)
    assert t.eos_token_ids == frozenset() and t.bos_token_id is None and t.chat_template is None
    assert t.all_special_ids == {0, 1, 2}  # added special tokens live in tokenizer.json
    assert t.decode(t.encode("héllo")) == "héllo"


def test_token_bytes(tok: Tokenizer) -> None:
    for special in tok.all_special_ids:
        assert tok.token_bytes(special) is None
    rng = random.Random(1)
    for _ in range(100):
        ids = [rng.randrange(3, tok.vocab_size) for _ in range(rng.randint(1, 10))]
        data = b"".join(tok.token_bytes(i) for i in ids)
        assert data.decode("utf-8", errors="replace") == tok.decode(ids)
    # every single byte is a token of its own
    singles = {tok.token_bytes(i) for i in range(3, tok.vocab_size)}
    assert all(bytes([b]) in singles for b in range(256))
    assert tok.token_bytes(tok.encode(" the")[0]) == b" the"
