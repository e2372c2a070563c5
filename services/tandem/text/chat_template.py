"""Chat templates: compiled in jinja2's immutable sandbox with the helpers transformers
gives templates, and the masking that keeps special-token text typed inside a message
from becoming a control token (see ``Tokenizer.encode_chat``)."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` (HF's assistant-mask tag), rendered as its body."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys: bool = False
) -> str:
    # HF's override: no HTML escaping, exposes json.dumps options
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=16)
def compile_template(source: str) -> jinja2.Template:
    """A chat template compiled the way transformers does, in jinja2's immutable sandbox."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


def render_template(source: str, **context: Any) -> str:
    """Render chat template ``source``; a template that fails (or does not compile) raises
    ``ValueError``."""
    try:
        return compile_template(source).render(**context)
    except jinja2.exceptions.TemplateError as e:
        raise ValueError(f"chat template failed: {e}") from e


def mentions_pattern(value: Any, pattern: re.Pattern[str]) -> bool:
    """Whether any string inside ``value`` (dicts, lists) contains a match of ``pattern``."""
    if isinstance(value, str):
        return pattern.search(value) is not None
    if isinstance(value, Mapping):
        return any(mentions_pattern(v, pattern) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(mentions_pattern(v, pattern) for v in value)
    return False


def mask_pattern(value: Any, pattern: re.Pattern[str]) -> Any:
    """``value`` with each match of ``pattern`` in its strings replaced by as many U+FFFC."""
    if isinstance(value, str):
        return pattern.sub(lambda m: "\ufffc" * len(m.group()), value)
    if isinstance(value, Mapping):
        return {k: mask_pattern(v, pattern) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [mask_pattern(v, pattern) for v in value]
    return value
