"""Where the two ends of a pair meet to build a connection: a small key-value exchange.

NCCL's pairs need the lower rank's unique id at the higher rank, and a same-device
pair needs the decode side's address and key at the prefill side. Inside Ray the
exchange goes through Ray's internal KV (``RayRendezvous``); without Ray (the
device check's two processes, tests) through a private directory
(``FileRendezvous``). Values are bytes; ``get`` waits for a key, bounded.
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path
from typing import Protocol


class Rendezvous(Protocol):
    def put(self, key: str, value: bytes) -> None: ...

    def get(self, key: str, timeout_s: float) -> bytes:
        """The value of ``key`` once someone put it; ``TimeoutError`` after ``timeout_s``."""
        ...

    def delete(self, key: str) -> None: ...


def _poll(read, key: str, timeout_s: float) -> bytes:
    deadline = time.monotonic() + timeout_s
    pause = 1e-3
    while (value := read(key)) is None:
        if time.monotonic() > deadline:
            raise TimeoutError(f"the peer did not publish {key!r} within {timeout_s:g}s")
        time.sleep(pause)
        pause = min(pause * 2, 0.05)
    return value


class RayRendezvous:
    """Ray's internal KV of the cluster this process is connected to."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix

    def put(self, key: str, value: bytes) -> None:
        from ray.experimental import internal_kv

        internal_kv._internal_kv_put(self.prefix + key, value, overwrite=True)

    def get(self, key: str, timeout_s: float) -> bytes:
        from ray.experimental import internal_kv

        return _poll(lambda k: internal_kv._internal_kv_get(self.prefix + k), key, timeout_s)

    def delete(self, key: str) -> None:
        from ray.experimental import internal_kv

        internal_kv._internal_kv_del(self.prefix + key)


class FileRendezvous:
    """A directory only this user can read; each key one file, written atomically."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.dir = Path(directory)
        self.dir.mkdir(mode=0o700, parents=True, exist_ok=True)

    def _path(self, key: str) -> Path:
        if not key or "/" in key or key.startswith("."):
            raise ValueError(f"bad rendezvous key {key!r}")
        return self.dir / key

    def put(self, key: str, value: bytes) -> None:
        fd, tmp = tempfile.mkstemp(dir=self.dir, prefix=".put-")
        with os.fdopen(fd, "wb") as f:
            f.write(value)
        os.replace(tmp, self._path(key))

    def get(self, key: str, timeout_s: float) -> bytes:
        def read(k: str) -> bytes | None:
            try:
                return self._path(k).read_bytes()
            except FileNotFoundError:
                return None
        return _poll(read, key, timeout_s)

    def delete(self, key: str) -> None:
        self._path(key).unlink(missing_ok=True)
