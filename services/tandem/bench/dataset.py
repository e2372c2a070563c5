"""Prompts from a local JSON or JSONL file (nothing is downloaded).

Accepted entries (a JSON list of them, or one per JSONL line):
- a string: the prompt;
- ``{"prompt": str, "output_len"|"max_tokens": int?}``;
- ShareGPT style ``{"conversations": [{"from": "human", "value": ...}, {"from": "gpt", ...}]}``
  or ``{"messages": [{"role": "user", "content": ...}, {"role": "assistant", ...}]}``: the
  first user turn is the prompt, and the first reply's token count (with a tokenizer) is
  the output length, as in vLLM's ShareGPT benchmark.

With a tokenizer the prompts are sent as token ids (exact prompt lengths); without one as
text (the server's usage reports their lengths). An entry without an output length takes
one from the ``--output-len`` distribution. The entries are shuffled with the seed (and
the rate's index) and cycled if the run wants more than the file holds.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from tandem.bench.workload import BenchRequest, LengthDist

USER_ROLES = {"human", "user"}
REPLY_ROLES = {"gpt", "assistant", "chatgpt", "bard", "model"}


def _entries(path: Path) -> list[Any]:
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".jsonl":
        return [json.loads(line) for line in text.splitlines() if line.strip()]
    data = json.loads(text)
    if not isinstance(data, list):
        raise ValueError(f"{path}: expected a JSON list of prompts")
    return data


def _turns(entry: dict) -> tuple[str | None, str | None]:
    """(first user turn, the reply after it) of a conversation entry."""
    turns = entry.get("conversations") or entry.get("messages") or []
    prompt = reply = None
    for t in turns:
        role = str(t.get("from") or t.get("role") or "").lower()
        value = t.get("value", t.get("content"))
        if not isinstance(value, str):
            continue
        if prompt is None and role in USER_ROLES:
            prompt = value
        elif prompt is not None and role in REPLY_ROLES:
            reply = value
            break
    return prompt, reply


def _parse(entry: Any, tokenizer: Any | None) -> tuple[str, int | None] | None:
    """(prompt text, output length or None) of one entry; None to skip it."""
    if isinstance(entry, str):
        return (entry, None) if entry else None
    if not isinstance(entry, dict):
        return None
    if isinstance(entry.get("prompt"), str):
        out = entry.get("output_len", entry.get("max_tokens"))
        return (entry["prompt"], int(out) if out else None) if entry["prompt"] else None
    prompt, reply = _turns(entry)
    if not prompt:
        return None
    out_len = len(tokenizer.encode(reply, add_special_tokens=False)) if tokenizer and reply else None
    return prompt, (out_len or None)


def load(path: str | Path, n: int, seed: int, output_len: LengthDist, tokenizer: Any | None = None,
         max_prompt_len: int | None = None, salt: int = 0) -> list[BenchRequest]:
    """``n`` requests from the file at ``path`` (see the module docstring); each ``salt``
    (a sweep's rate index) draws its own order, so rates share prompts only when the file
    holds fewer than rates x ``n`` of them."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"dataset not found: {path}")
    parsed = []
    for e in _entries(path):
        item = _parse(e, tokenizer)
        if item is None:
            continue
        ids = tokenizer.encode(item[0]) if tokenizer is not None else None
        if ids is not None and max_prompt_len is not None and len(ids) > max_prompt_len:
            continue
        parsed.append((item[0], ids, item[1]))
    if not parsed:
        raise ValueError(f"{path}: no usable prompts")
    rng = np.random.default_rng([seed, salt])
    order = rng.permutation(len(parsed)).tolist()
    fallback = output_len.sample(rng, n)
    out = []
    for i in range(n):
        text, ids, out_len = parsed[order[i % len(order)]]
        prompt: list[int] | str = ids if ids is not None else text
        out.append(BenchRequest(i, prompt, len(ids) if ids is not None else None,
                                out_len or fallback[i], "dataset"))
    return out
