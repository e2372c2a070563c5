"""A benchmark side: one engine in its own process, driven over JSON lines.

``tandem bench offline --vllm-python PATH`` measures tandem's engine and vLLM's
``LLM`` alternately (A B A B ...). Each side is a long-lived subprocess that loads its
engine once and then runs one measurement per request, so loading (slow for vLLM on a
few cores) is paid once while the measured runs alternate. The side runs under any
Python (vLLM lives in its own virtual environment), so this module is standard
library only.

Wire format, one JSON object per line. Requests on the side's stdin::

    {"op": "load", "model": DIR, "threads": N, "max_model_len": N,
     "max_num_batched_tokens": N, "seed": N, "dtype": "float32"|"bfloat16",
     "temperature": T, "top_p": P}                             # every request's; 0: greedy
    {"op": "generate", "prompts": [[ids]], "output_len": N}   # ignore_eos
    {"op": "ttft", "prompt": [ids]}                            # one prompt, one token
    {"op": "quit"}

Replies on the side's stdout: ``{"ok": true, ...}`` (``generate``: ``elapsed_s`` and
``tokens``, the output ids per prompt; ``ttft``: ``elapsed_s``; ``load``: ``info``) or
``{"ok": false, "error": TEXT}``. Anything the engine prints goes to stderr.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol


class Backend(Protocol):
    """One engine as a side serves it; each call times itself."""

    def generate(self, prompts: list[list[int]], output_len: int) -> tuple[float, list[list[int]]]:
        """Seconds to generate ``output_len`` tokens (EOS ignored) for every prompt, and the ids."""

    def ttft(self, prompt: list[int]) -> float:
        """Seconds from submitting one prompt to its first token."""


class TimedBackend:
    """A ``Backend`` whose calls are one timed generation each; subclasses give
    ``_generate`` (the ids of each prompt's ``output_len`` tokens)."""

    def _generate(self, prompts: list[list[int]], output_len: int) -> list[list[int]]:
        raise NotImplementedError

    def generate(self, prompts: list[list[int]], output_len: int) -> tuple[float, list[list[int]]]:
        t0 = time.perf_counter()
        ids = self._generate(prompts, output_len)
        return time.perf_counter() - t0, ids

    def ttft(self, prompt: list[int]) -> float:
        return self.generate([prompt], 1)[0]


def serve(load: Callable[..., tuple[Backend, dict[str, Any]]]) -> int:
    """Answer requests on stdin until ``quit`` or EOF. ``load(**request)`` builds the backend."""
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # whatever the engine prints stays off the protocol
    sys.stdout = sys.stderr
    backend: Backend | None = None
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            req = json.loads(line)
            op = req.pop("op")
            if op == "quit":
                break
            if op == "load":
                backend, info = load(**req)
                reply: dict[str, Any] = {"info": info}
            elif backend is None:
                raise RuntimeError("the side has no engine yet: send 'load' first")
            elif op == "generate":
                elapsed, tokens = backend.generate(req["prompts"], int(req["output_len"]))
                reply = {"elapsed_s": elapsed, "tokens": tokens}
            elif op == "ttft":
                reply = {"elapsed_s": backend.ttft(req["prompt"])}
            else:
                raise ValueError(f"unknown op {op!r}")
            proto.write(json.dumps({"ok": True, **reply}) + "\n")
        except Exception as e:  # reported to the driver, which stops the benchmark
            proto.write(json.dumps({"ok": False, "error": f"{type(e).__name__}: {e}"}) + "\n")
    return 0


class SideError(RuntimeError):
    """A side failed: it answered an error, died, or did not answer in time."""


class Side:
    """The driver's handle on one side process."""

    def __init__(self, name: str, argv: Sequence[str], env: dict[str, str], log_path: str) -> None:
        self.name = name
        self.log_path = log_path
        self.info: dict[str, Any] = {}  # what the side said it runs, from its ``load`` reply
        self._log = open(log_path, "wb")
        self._proc = subprocess.Popen(list(argv), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      stderr=self._log, env=env, text=True, bufsize=1,
                                      start_new_session=True)  # its own group: see close()
        self._replies: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, name=f"bench-side-{name}", daemon=True).start()

    def _read(self) -> None:
        assert self._proc.stdout is not None
        for line in self._proc.stdout:
            self._replies.put(line)
        self._replies.put(None)

    @property
    def pid(self) -> int:
        """The side's process (the root of its process tree)."""
        return self._proc.pid

    def call(self, op: str, timeout_s: float, **fields: Any) -> dict[str, Any]:
        """Send one request and wait for its reply; raises :class:`SideError`."""
        assert self._proc.stdin is not None
        try:
            self._proc.stdin.write(json.dumps({"op": op, **fields}) + "\n")
            self._proc.stdin.flush()
        except (BrokenPipeError, OSError):
            raise SideError(f"{self.name} side exited ({self._tail()})") from None
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                line = self._replies.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise SideError(f"{self.name} side: no answer to {op!r} in {timeout_s:.0f} s") from None
            if line is None:
                raise SideError(f"{self.name} side exited during {op!r} ({self._tail()})")
            try:
                reply = json.loads(line)
            except json.JSONDecodeError:
                raise SideError(f"{self.name} side: not a protocol line: {line[:200]!r}") from None
            if not reply.get("ok"):
                raise SideError(f"{self.name} side: {reply.get('error', 'failed')}")
            return reply

    def _tail(self, lines: int = 8) -> str:
        self._log.flush()
        try:
            with open(self.log_path, errors="replace") as f:
                text = f.read().strip().splitlines()[-lines:]
        except OSError:
            text = []
        return "log: " + (" | ".join(text) if text else "empty") + f"; full log {self.log_path}"

    def close(self, timeout_s: float = 30.0) -> None:
        """Ask the side to quit; kill it if it does not exit in time."""
        if self._proc.poll() is None:
            try:
                assert self._proc.stdin is not None
                self._proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
                self._proc.stdin.close()
            except (BrokenPipeError, OSError):
                pass
            try:
                self._proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        try:  # helpers the engine started (vLLM's engine core) go with it
            os.killpg(self._proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self._log.close()
