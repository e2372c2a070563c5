"""The settings of a config dataclass, flattened: what the CLI and ``LLM(...)`` expose.

Every default stays on its dataclass field; the command line and keyword arguments are
generated from :func:`settings`, and :func:`build` assembles the nested dataclass back.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Setting:
    """One leaf field of a (nested) config dataclass."""

    path: tuple[str, ...]  # attribute path from the root config, e.g. ("engine", "cache", "memory_gb")
    type: Any  # the resolved annotation, e.g. int | None
    default: Any
    metadata: Mapping[str, Any]

    @property
    def name(self) -> str:
        """The field's own name."""
        return self.path[-1]

    @property
    def flag(self) -> str | None:
        """Its command-line flag, or None when it is kept off the command line."""
        if not self.metadata.get("cli", True):
            return None
        return self.metadata.get("flag") or "--" + self.name.replace("_", "-")

    @property
    def keyword(self) -> str | None:
        """Its ``LLM(...)`` keyword, or None when it is not one."""
        return self.metadata.get("keyword", self.name)

    @property
    def help(self) -> str:
        """One line for ``--help``."""
        return str(self.metadata.get("help", ""))


def settings(cls: type, prefix: tuple[str, ...] = ()) -> list[Setting]:
    """The leaf fields of dataclass ``cls``, nested dataclass fields expanded in place."""
    hints = typing.get_type_hints(cls)
    out: list[Setting] = []
    for f in dataclasses.fields(cls):
        kind = hints[f.name]
        if dataclasses.is_dataclass(kind):
            out.extend(settings(kind, prefix + (f.name,)))
            continue
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        out.append(Setting(prefix + (f.name,), kind, default, f.metadata))
    return out


def build(cls: type, values: Mapping[tuple[str, ...], Any], prefix: tuple[str, ...] = ()) -> Any:
    """``cls`` with the given leaf ``values`` (keyed by path) and defaults elsewhere."""
    hints = typing.get_type_hints(cls)
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        path = prefix + (f.name,)
        if dataclasses.is_dataclass(hints[f.name]):
            kwargs[f.name] = build(hints[f.name], values, path)
        elif path in values:
            kwargs[f.name] = values[path]
    return cls(**kwargs)


def build_from_keywords(cls: type, keywords: Mapping[str, Any], **fixed: Any) -> Any:
    """``cls`` from ``LLM``-style keywords (see :attr:`Setting.keyword`) plus top-level ``fixed``.

    Raises ``TypeError`` naming an unknown keyword and the known ones.
    """
    by_keyword = {s.keyword: s.path for s in settings(cls) if s.keyword is not None}
    unknown = sorted(set(keywords) - set(by_keyword))
    if unknown:
        raise TypeError(f"unexpected keyword argument {unknown[0]!r}; known: {', '.join(sorted(by_keyword))}")
    values = {by_keyword[k]: v for k, v in keywords.items()}
    values.update({(k,): v for k, v in fixed.items()})
    return build(cls, values)
