"""Tokenizer loaded from a local Hugging Face model folder.

Wraps a ``tokenizers.Tokenizer`` (``tokenizer.json``) and reads the special
tokens, eos ids and chat template the way ``transformers`` does, so that
encode/decode and chat rendering agree with ``AutoTokenizer`` on the same folder.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from functools import lru_cache
from pathlib import Path
from typing import Any

import tokenizers
import tokenizers.decoders

from tandem.text.chat_template import mask_pattern, mentions_pattern, render_template

# Named special tokens HF passes to chat templates (its SPECIAL_TOKENS_ATTRIBUTES).
_NAMED_SPECIAL = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
_ADDED_FLAGS = {"single_word": False, "lstrip": False, "rstrip": False, "normalized": False, "special": True}


@lru_cache(maxsize=1)
def byte_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: byte -> printable unicode char."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


@lru_cache(maxsize=1)
def _unicode_to_byte() -> dict[str, int]:
    """GPT-2's byte-level table, inverted: printable unicode char -> byte."""
    return {c: b for b, c in byte_to_unicode().items()}


def _read_json(path: Path) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    try:
        with path.open(encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read {path}: {e}") from e
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _token_content(value: Any) -> str | None:
    """A special token entry of tokenizer_config: a string or an AddedToken dict."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _as_id_list(value: Any) -> list[int] | None:
    """``eos_token_id`` as a list: an int or a non-empty list of ints, else None."""
    items = value if isinstance(value, list) else [value]
    if items and all(isinstance(v, int) and not isinstance(v, bool) for v in items):
        return list(items)
    return None


def _add_config_tokens(tok: tokenizers.Tokenizer, cfg: Mapping[str, Any]) -> dict[str, str]:
    """Register tokenizer_config's added and named special tokens as HF does; return the named ones."""
    known = {t.content for t in tok.get_added_tokens_decoder().values()}
    new: list[tokenizers.AddedToken] = []

    def add(content: str, entry: Mapping[str, Any]) -> None:
        if content in known:
            return
        known.add(content)
        new.append(tokenizers.AddedToken(content, **{k: bool(entry.get(k, d)) for k, d in _ADDED_FLAGS.items()}))

    for entry in (cfg.get("added_tokens_decoder") or {}).values():
        if (content := _token_content(entry)) is not None:
            add(content, entry)
    named: dict[str, str] = {}
    extra = cfg.get("additional_special_tokens") or cfg.get("extra_special_tokens") or []
    extra = list(extra.values()) if isinstance(extra, Mapping) else list(extra)
    for key, value in [*((k, cfg.get(k)) for k in _NAMED_SPECIAL), *((None, v) for v in extra)]:
        if (content := _token_content(value)) is not None:
            add(content, value if isinstance(value, Mapping) else {})
            if key is not None:
                named[key] = content
    if new:
        tok.add_tokens(new)
    return named


class Tokenizer:
    """A checkpoint's tokenizer: encode/decode, special ids, chat template."""

    def __init__(
        self,
        tokenizer: tokenizers.Tokenizer,
        *,
        special_tokens: Mapping[str, str] | None = None,
        eos_token_ids: Iterable[int] = (),
        chat_template: str | None = None,
        byte_level: bool = False,
    ) -> None:
        """Prefer :meth:`from_dir`; this takes already-parsed parts."""
        self._tok = tokenizer
        self._special_tokens = {k: v for k, v in (special_tokens or {}).items() if v is not None}
        self._eos_ids = frozenset(int(i) for i in eos_token_ids)
        self.chat_template = chat_template
        self.is_byte_level = byte_level
        added = tokenizer.get_added_tokens_decoder()
        self._special_ids = frozenset(i for i, t in added.items() if t.special)
        self._vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        self._bytes_cache: dict[int, bytes] = {}
        specials = sorted({t.content for t in added.values() if t.special}, key=len, reverse=True)
        self._special_re = re.compile("|".join(map(re.escape, specials))) if specials else None
        self._plain: tokenizers.Tokenizer | None = None  # a twin that reads special-token text as text

    # ------------------------------------------------------------------ loading
    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        """Load ``tokenizer.json`` (+ optional configs) from a local model folder."""
        root = Path(path)
        if not root.is_dir():
            raise FileNotFoundError(f"model folder not found: {root}")
        tok_file = root / "tokenizer.json"
        if not tok_file.is_file():
            raise FileNotFoundError(f"tokenizer.json not found in {root} (expected {tok_file})")
        try:
            tok = tokenizers.Tokenizer.from_file(str(tok_file))
        except Exception as e:  # tokenizers raises plain Exception
            raise ValueError(f"cannot load {tok_file}: {e}") from e
        byte_level = isinstance(tok.decoder, tokenizers.decoders.ByteLevel)

        cfg = _read_json(root / "tokenizer_config.json") or {}
        special_tokens = _add_config_tokens(tok, cfg)

        template_file = root / "chat_template.jinja"  # transformers 5 writes the template here
        chat_template = cfg.get("chat_template")
        if template_file.is_file():
            chat_template = template_file.read_text(encoding="utf-8")
        elif isinstance(chat_template, list):  # [{"name": ..., "template": ...}, ...]: take "default"
            chat_template = next((t.get("template") for t in chat_template if t.get("name") == "default"), None)
        if chat_template is not None and not isinstance(chat_template, str):
            raise ValueError(f"{root / 'tokenizer_config.json'}: chat_template must be a string or a list")

        eos_ids: list[int] | None = None
        for name in ("generation_config.json", "config.json"):
            data = _read_json(root / name)
            if data is not None and (eos_ids := _as_id_list(data.get("eos_token_id"))) is not None:
                break
        if eos_ids is None:
            eos_tok = special_tokens.get("eos_token")
            eos_id = tok.token_to_id(eos_tok) if eos_tok is not None else None
            eos_ids = [eos_id] if eos_id is not None else []
        return cls(tok, special_tokens=special_tokens, eos_token_ids=eos_ids, chat_template=chat_template,
                   byte_level=byte_level)

    # --------------------------------------------------------------- properties
    @property
    def backend(self) -> tokenizers.Tokenizer:
        """The underlying ``tokenizers.Tokenizer``."""
        return self._tok

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """Token ids that end generation."""
        return self._eos_ids

    @property
    def bos_token_id(self) -> int | None:
        """The BOS token's id, or None if the checkpoint names none."""
        bos = self._special_tokens.get("bos_token")
        return self._tok.token_to_id(bos) if bos is not None else None

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included."""
        return self._vocab_size

    @property
    def all_special_ids(self) -> frozenset[int]:
        """Ids of the special added tokens (those ``decode(skip_special_tokens=True)`` drops)."""
        return self._special_ids

    @property
    def special_tokens_map(self) -> dict[str, str]:
        """Named special tokens (bos_token, eos_token, ...) as strings."""
        return dict(self._special_tokens)

    # ------------------------------------------------------------ encode/decode
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text`` (the post-processor adds BOS etc. if ``add_special_tokens``)."""
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``."""
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        """The vocabulary string of ``token_id`` (None if out of range)."""
        return self._tok.id_to_token(token_id)

    def is_special(self, token_id: int) -> bool:
        """Whether ``token_id`` is skipped by ``decode(skip_special_tokens=True)``."""
        return token_id in self._special_ids

    def token_bytes(self, token_id: int) -> bytes | None:
        """Exact bytes a token contributes to decoded text (byte-level tokenizers only).

        None for special tokens, unknown ids, or non-byte-level tokenizers.
        """
        if not self.is_byte_level or token_id in self._special_ids:
            return None
        return self.raw_token_bytes(token_id)

    def raw_token_bytes(self, token_id: int) -> bytes | None:
        """Like :meth:`token_bytes` but also for special tokens (as decode without skipping emits them)."""
        if not self.is_byte_level:
            return None
        cached = self._bytes_cache.get(token_id)
        if cached is not None:
            return cached
        token = self._tok.id_to_token(token_id)
        if token is None:
            return None
        table = _unicode_to_byte()
        try:
            data = bytes(table[c] for c in token)
        except KeyError:  # same fallback as the ByteLevel decoder: raw utf-8 of the token
            data = token.encode("utf-8")
        self._bytes_cache[token_id] = data
        return data

    # ------------------------------------------------------------ chat template
    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        """Render ``messages`` with the checkpoint's Jinja chat template (as HF's ``tokenize=False``).

        Extra ``kwargs`` (``tools``, ``documents``, template variables) reach the template.
        Raises ValueError if there is no template or rendering fails.
        """
        if self.chat_template is None:
            raise ValueError(
                "this checkpoint has no chat template (no chat_template in tokenizer_config.json and no "
                "chat_template.jinja); use a completion prompt instead"
            )
        if not messages:
            raise ValueError("cannot apply the chat template to an empty list of messages")
        chat = []
        for m in messages:
            if not isinstance(m, Mapping):
                raise ValueError(f"chat messages must be dicts, got {type(m).__name__}")
            chat.append({k: v for k, v in m.items() if v is not None})  # HF drops None values
        params: dict[str, Any] = {"tools": None, "documents": None, **self._special_tokens, **kwargs}
        return render_template(self.chat_template, messages=chat,
                               add_generation_prompt=add_generation_prompt, **params)

    def encode_chat(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> list[int]:
        """Token ids of the rendered chat, safe against special-token text in the messages.

        The template's own markers (``<|im_start|>`` ...) become their special ids; the same
        text inside a message (a user typing ``<|im_start|>system``) is tokenized as plain
        text, so no message can open a turn of its own. Raises ValueError like
        :meth:`apply_chat_template`, and when a template rewrites such content in a way that
        hides where it went.
        """
        text = self.apply_chat_template(messages, add_generation_prompt, **kwargs)
        if self._special_re is None or not mentions_pattern(messages, self._special_re):
            return self.encode(text, add_special_tokens=False)
        # Render again with every special-token string in the messages masked by a same-length
        # run of U+FFFC: what is still special there is the template's own.
        masked = self.apply_chat_template(mask_pattern(messages, self._special_re), add_generation_prompt, **kwargs)
        if len(masked) != len(text):
            raise ValueError("a message contains special-token text that this chat template "
                             "transforms; remove it from the message")
        ids: list[int] = []
        pos = 0
        for m in self._special_re.finditer(masked):
            if text[m.start():m.end()] != m.group():
                raise ValueError("a message contains special-token text that this chat template "
                                 "transforms; remove it from the message")
            ids.extend(self._encode_plain(text[pos:m.start()]))
            ids.append(self._tok.token_to_id(m.group()))
            pos = m.end()
        ids.extend(self._encode_plain(text[pos:]))
        return ids

    def _encode_plain(self, text: str) -> list[int]:
        """``text``'s ids with special-token strings in it split like any other text."""
        if not text:
            return []
        if self._plain is None:
            plain = tokenizers.Tokenizer.from_str(self._tok.to_str())
            plain.encode_special_tokens = True
            self._plain = plain
        return self._plain.encode(text, add_special_tokens=False).ids
