"""The benchmarks' HTTP client for an OpenAI-compatible server (tandem's or another's).

``stream_completion`` streams one ``/v1/completions`` request and returns its timestamps
and usage, or the kind of error that ended it (never raises for a failed request):
``http_<status>``, ``timeout``, ``connection``, ``stream_error`` (an error event in the
stream), ``protocol`` (unparseable event), ``incomplete`` (no ``[DONE]``), ``other``.
"""

from __future__ import annotations

import asyncio
import codecs
import json
import re
import subprocess
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx


@dataclass
class StreamResult:
    """One streamed request as the client saw it (``perf_counter`` seconds)."""

    send_t: float
    token_times: list[float] = field(default_factory=list)  # arrival of each chunk that carried tokens
    chunk_tokens: list[int | None] = field(default_factory=list)  # tokens in each (None: unknown)
    done_t: float | None = None
    status: int | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None  # from usage (None if the server sent none)
    error: str | None = None
    detail: str | None = None


def completion_body(model: str, prompt: list[int] | str, max_tokens: int, ignore_eos: bool = True,
                    logprobs: int | None = None) -> dict[str, Any]:
    """A streamed greedy completion of exactly ``max_tokens`` tokens (with ``ignore_eos``).

    ``logprobs=0`` makes every chunk name its tokens, so a token is seen (and timed) even
    when its text is empty or held back by the detokenizer (partial UTF-8, a random-weight
    model's ids outside its tokenizer): without it only chunks that carry text are timed.
    """
    body: dict[str, Any] = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                            "stream": True, "stream_options": {"include_usage": True}}
    if ignore_eos:
        body["ignore_eos"] = True
    if logprobs is not None:
        body["logprobs"] = logprobs
    return body


def _split_lines(buffer: str, final: bool) -> tuple[list[str], str]:
    """Complete lines of ``buffer`` (ended by CRLF, LF or CR) and the unfinished rest.

    A CR at the very end stays in the rest unless ``final``: its LF may be in the next chunk.
    """
    out, start, i = [], 0, 0
    while i < len(buffer):
        ch = buffer[i]
        if ch == "\r" and i + 1 == len(buffer) and not final:
            break
        if ch == "\n" or ch == "\r":
            out.append(buffer[start:i])
            i += 2 if buffer.startswith("\r\n", i) else 1
            start = i
        else:
            i += 1
    return out, buffer[start:]


async def sse_data(chunks: AsyncIterator[bytes]) -> AsyncIterator[str]:
    """The ``data`` of each server-sent event in ``chunks``, split as the SSE spec says.

    Lines end at CRLF, LF or CR only (never at U+2028, U+0085 ... as ``str.splitlines``
    would); an event ends at an empty line; its ``data:`` lines (one leading space
    dropped) are joined with LF; comments and other fields are ignored; an event the
    stream ends in the middle of is dropped, as the spec says.
    """
    decoder = codecs.getincrementaldecoder("utf-8")("replace")
    rest, data = "", []
    final = False
    while not final:
        try:
            rest += decoder.decode(await anext(chunks))
        except StopAsyncIteration:
            rest += decoder.decode(b"", final=True)
            final = True
        lines, rest = _split_lines(rest, final)
        for line in lines:
            if line == "":
                if data:
                    yield "\n".join(data)
                    data = []
                continue
            name, _, value = line.partition(":")
            if name == "data":
                data.append(value[1:] if value.startswith(" ") else value)


async def _consume(resp: httpx.Response, out: StreamResult) -> None:
    done = False
    async for data in sse_data(resp.aiter_bytes()):
        if data == "[DONE]":
            done = True
            break
        try:
            event = json.loads(data)
        except json.JSONDecodeError:
            out.error, out.detail = "protocol", data[:200]
            return
        if event.get("error"):
            err = event["error"]
            out.error, out.detail = "stream_error", str(err.get("message", err) if isinstance(err, dict) else err)[:300]
            return
        if event.get("usage"):
            out.prompt_tokens = event["usage"].get("prompt_tokens")
            out.completion_tokens = event["usage"].get("completion_tokens")
        choices = event.get("choices") or []
        if not choices:
            continue
        lps = choices[0].get("logprobs")
        n = len(lps["tokens"]) if isinstance(lps, dict) and isinstance(lps.get("tokens"), list) else None
        if n or (n is None and choices[0].get("text")):
            out.token_times.append(time.perf_counter())
            out.chunk_tokens.append(n)
    out.done_t = time.perf_counter()
    if not done:
        out.error, out.detail = "incomplete", "the stream ended without [DONE]"


async def stream_completion(client: httpx.AsyncClient, url: str, body: dict[str, Any],
                            timeout_s: float | None = None) -> StreamResult:
    """POST ``body`` to ``{url}/v1/completions`` and read the stream to its end (or ``timeout_s``)."""
    out = StreamResult(send_t=time.perf_counter())
    try:
        async with asyncio.timeout(timeout_s):
            async with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
                out.status = resp.status_code
                if resp.status_code != 200:
                    out.error, out.detail = f"http_{resp.status_code}", (await resp.aread())[:300].decode(
                        "utf-8", "replace")
                    return out
                await _consume(resp, out)
    except (TimeoutError, httpx.TimeoutException) as e:
        out.error, out.detail = "timeout", repr(e)[:300]
    except httpx.TransportError as e:
        out.error, out.detail = "connection", repr(e)[:300]
    except httpx.HTTPError as e:
        out.error, out.detail = "other", repr(e)[:300]
    return out


def wait_ready(url: str, proc: subprocess.Popen | None = None, timeout_s: float = 180.0) -> None:
    """Poll ``{url}/ready`` until 200; RuntimeError if ``proc`` exits first, TimeoutError after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode} before it was ready")
        try:
            if httpx.get(f"{url}/ready", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{url} not ready after {timeout_s:.0f}s")


class ServerUnusable(ConnectionError):
    """The server a benchmark was pointed at cannot be reached or serves no model."""


def first_model(url: str) -> str:
    """The id of the first model ``{url}/v1/models`` lists; ServerUnusable, with what went
    wrong, where the server cannot be reached or lists none."""
    try:
        resp = httpx.get(f"{url}/v1/models", timeout=10)
    except (httpx.HTTPError, httpx.InvalidURL) as e:
        raise ServerUnusable(f"cannot reach {url}: {e}") from None
    try:
        resp.raise_for_status()
        return resp.json()["data"][0]["id"]
    except httpx.HTTPStatusError:
        raise ServerUnusable(f"{url}/v1/models: HTTP {resp.status_code}") from None
    except (ValueError, KeyError, IndexError, TypeError):
        raise ServerUnusable(f"{url}/v1/models lists no model (is it an OpenAI-compatible server?)") from None


_READY = re.compile(r'^tandem_workers_ready\{role="([^"]+)"\}\s+([0-9.eE+-]+)', re.M)


def server_pools(url: str) -> dict[str, int] | None:
    """Live workers per pool role from a tandem server's ``/metrics`` (None for other servers)."""
    try:
        resp = httpx.get(f"{url}/metrics", timeout=10)
    except httpx.HTTPError:
        return None
    if resp.status_code != 200:
        return None
    pools = {role: int(float(v)) for role, v in _READY.findall(resp.text)}
    return pools or None
