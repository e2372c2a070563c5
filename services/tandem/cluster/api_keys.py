"""API keys of ``tandem serve``: where they come from, what a valid one is, and when none is allowed.

Sources, all combined: ``--api-key KEY`` (repeatable), ``--api-key-file PATH``
(repeatable), ``$TANDEM_API_KEY`` and ``$TANDEM_API_KEY_FILE``. A key file holds one key
per line (a Kubernetes Secret mounted as a file holds exactly one); blank lines and
lines starting with ``#`` are skipped, surrounding whitespace is ignored.

A key is refused (``ValueError``, with the source but never the key) when it is empty or
blank, contains whitespace or a control character, or is not ASCII: such a key either
means a mistake (``--api-key ""`` used to serve with no authentication at all) or
could not travel in an ``Authorization: Bearer`` header.

Serving beyond loopback without a key is refused unless ``allow_unauthenticated``;
then a warning says so at start-up.
"""

from __future__ import annotations

import ipaddress
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

ENV_KEY = "TANDEM_API_KEY"
ENV_KEY_FILE = "TANDEM_API_KEY_FILE"


def validate_key(key: str, source: str) -> str:
    """``key`` if it can be a bearer token, else ValueError naming ``source`` (not the key)."""
    if not key.strip():
        raise ValueError(f"the API key from {source} is empty: give a real key, or no key at all "
                         "to serve without authentication on loopback")
    if any(ch.isspace() for ch in key):
        raise ValueError(f"the API key from {source} contains whitespace")
    if not key.isascii() or not key.isprintable():
        raise ValueError(f"the API key from {source} contains non-ASCII or control characters")
    return key


def read_key_file(path: str | os.PathLike[str]) -> list[str]:
    """The keys in ``path`` (one per line; blank lines and ``#`` comments skipped)."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ValueError(f"API key file {str(p)!r} does not exist") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"cannot read API key file {str(p)!r}: {type(e).__name__}") from None
    keys = []
    for n, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if line and not line.startswith("#"):
            keys.append(validate_key(line, f"{p}:{n}"))
    if not keys:
        raise ValueError(f"API key file {str(p)!r} holds no key")
    return keys


def collect_keys(keys: Sequence[str] | None = None, key_files: Sequence[str] | None = None,
                 environ: Mapping[str, str] = os.environ) -> list[str]:
    """Every configured key, validated, duplicates dropped (order kept)."""
    found: list[str] = []
    for i, key in enumerate(keys or [], 1):
        found.append(validate_key(key, f"--api-key #{i}"))
    for path in key_files or []:
        found += read_key_file(path)
    if ENV_KEY in environ:
        found.append(validate_key(environ[ENV_KEY], f"${ENV_KEY}"))
    if environ.get(ENV_KEY_FILE):
        found += read_key_file(environ[ENV_KEY_FILE])
    return list(dict.fromkeys(found))


def is_loopback(host: str) -> bool:
    """Whether binding ``host`` keeps a server reachable from this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to anything


def check_exposure(host: str, keys: Sequence[str], allow_unauthenticated: bool) -> str | None:
    """None when binding ``host`` with ``keys`` is fine; a warning to print when it is allowed
    only because of ``allow_unauthenticated``; ValueError when it is refused."""
    if keys or is_loopback(host):
        return None
    if not allow_unauthenticated:
        raise ValueError(
            f"refusing to serve on {host} without an API key: anyone who can reach it could use "
            "the API. Give a key (--api-key-file, --api-key or $TANDEM_API_KEY), bind 127.0.0.1, "
            "or pass --allow-unauthenticated if something in front of it authenticates")
    return (f"WARNING: serving on {host} without an API key (--allow-unauthenticated): anyone who "
            "can reach this port can use the API")
