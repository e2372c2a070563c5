"""Command-line flags generated from the config dataclasses, so each default lives once.

    settings = add_config_flags(parser, ClusterConfig, exclude={"num_threads"})
    config = config_from_args(args, ClusterConfig, settings, {("engine", "model"): ...})

Types come from the field annotations (bool fields get ``--x/--no-x``, enums their
values as choices), choices and validators from the field metadata, so a bad value is a
usage error at parse time rather than a traceback from a worker.
"""

from __future__ import annotations

import argparse
import enum
import types
import typing
from collections.abc import Collection, Mapping
from typing import Any

from tandem.common.config_fields import Setting, build, settings


def _resource(text: str) -> tuple[str, float]:
    name, sep, amount = text.partition("=")
    try:
        if not sep or not name:
            raise ValueError
        return name, float(amount)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a resource is NAME=AMOUNT, got {text!r}") from None


def _base(kind: Any) -> tuple[Any, bool]:
    """(the type without ``None``, whether ``None`` is allowed)."""
    if isinstance(kind, types.UnionType) or typing.get_origin(kind) is typing.Union:
        args = [a for a in typing.get_args(kind) if a is not type(None)]
        return args[0], len(args) < len(typing.get_args(kind))
    return kind, False


def _checked(parse: Any) -> Any:
    """``parse`` with its ValueError turned into a usage error that shows its message."""
    def checked(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    return checked


def dest(setting: Setting) -> str:
    """The ``argparse`` attribute of a setting's flag."""
    assert setting.flag is not None
    return setting.flag.removeprefix("--").replace("-", "_")


def add_config_flags(parser: argparse.ArgumentParser, cls: type, exclude: Collection[str] = (),
                     only: Collection[str] | None = None) -> list[Setting]:
    """Add a flag for every CLI setting of ``cls`` not named in ``exclude`` (and named in
    ``only`` when given); return those settings."""
    added = []
    for s in settings(cls):
        if s.flag is None or s.name in exclude or (only is not None and s.name not in only):
            continue
        kind, nullable = _base(s.type)
        meta = s.metadata
        text = s.help
        kw: dict[str, Any] = {"dest": dest(s), "default": s.default}
        if kind is bool:
            kw["action"] = argparse.BooleanOptionalAction
        elif typing.get_origin(kind) is tuple:  # NAME=AMOUNT resources, repeatable
            kw.update(action="append", type=_resource, default=None, metavar="NAME=AMOUNT")
        elif isinstance(kind, type) and issubclass(kind, enum.Enum):
            kw.update(type=str, choices=[m.value for m in kind], default=s.default.value)
        else:
            kw["type"] = _checked(meta["type"]) if "type" in meta else kind
            if "choices" in meta:
                kw["choices"] = list(meta["choices"])
            if s.default is not None and kind is not bool:
                text += f" (default: {s.default})"
            if nullable and s.default is not None:
                kw["metavar"] = "N"
        parser.add_argument(s.flag, help=text, **kw)
        added.append(s)
    return added


def config_from_args(args: argparse.Namespace, cls: type, added: list[Setting],
                     fixed: Mapping[tuple[str, ...], Any] | None = None) -> Any:
    """``cls`` from the parsed flags of ``added``, and ``fixed`` values keyed by field path.

    ``-1`` for an optional integer whose default is a number means None (e.g. "never").
    """
    values: dict[tuple[str, ...], Any] = {}
    for s in added:
        value = getattr(args, dest(s))
        kind, nullable = _base(s.type)
        if typing.get_origin(kind) is tuple:
            value = tuple(value or ())
        elif nullable and kind is int and s.default is not None and value is not None and value < 0:
            value = None
        values[s.path] = value
    values.update(fixed or {})
    return build(cls, values)
