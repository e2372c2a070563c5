"""``tandem chat``: a terminal chat with a running server (``--url``) or a local engine.

Replies stream as they are generated; the conversation is kept and re-sent each turn
(the chat template renders it); ``/reset`` forgets it, ``/bye`` (or Ctrl-D) quits, and
Ctrl-C stops the reply being written (the request is cancelled on the server or aborted
in the engine) and keeps what was written so far.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any, Protocol

PROMPT = ">>> "
HELP = "/reset forgets the conversation, /bye quits; Ctrl-C stops a reply, Ctrl-D quits"


class ChatBackend(Protocol):
    """Streams the assistant's reply to a conversation, piece by piece."""

    name: str

    def stream(self, messages: list[dict[str, str]]) -> Iterator[str]:
        """Yield text as it is generated; closing the iterator cancels the request."""
        ...


class HttpChat:
    """Chat completions with ``stream: true`` against an OpenAI-compatible server."""

    def __init__(self, url: str, model: str | None, api_key: str | None, max_tokens: int,
                 temperature: float) -> None:
        self.base = url.rstrip("/").removesuffix("/v1") + "/v1"
        self.headers = {"Content-Type": "application/json"}
        if api_key:
            self.headers["Authorization"] = f"Bearer {api_key}"
        self.max_tokens, self.temperature = max_tokens, temperature
        self.name = model or self._first_model()

    def _open(self, path: str, body: dict[str, Any] | None = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.base + path, data=data, headers=self.headers)
        try:
            return urllib.request.urlopen(req, timeout=600)
        except urllib.error.HTTPError as e:
            try:
                message = json.loads(e.read())["error"]["message"]
            except (ValueError, KeyError, TypeError):
                message = e.reason
            raise ConnectionError(f"{self.base}{path}: HTTP {e.code}: {message}") from None
        except urllib.error.URLError as e:
            raise ConnectionError(f"cannot reach {self.base}: {e.reason}") from None

    def _first_model(self) -> str:
        with self._open("/models") as resp:
            models = json.loads(resp.read())["data"]
        if not models:
            raise ConnectionError(f"{self.base} serves no model")
        return models[0]["id"]

    def stream(self, messages: list[dict[str, str]]) -> Iterator[str]:
        body = {"model": self.name, "messages": messages, "stream": True,
                "max_tokens": self.max_tokens, "temperature": self.temperature}
        with self._open("/chat/completions", body) as resp:  # leaving closes the connection
            for raw in resp:
                line = raw.decode("utf-8").strip()
                if not line.startswith("data:"):
                    continue
                data = line.removeprefix("data:").strip()
                if data == "[DONE]":
                    return
                event = json.loads(data)
                if "error" in event:
                    raise ConnectionError(event["error"].get("message", "the server failed the request"))
                for choice in event.get("choices", []):
                    text = (choice.get("delta") or {}).get("content")
                    if text:
                        yield text


class LocalChat:
    """The engine in this process (``LLM``), stepped here so a reply can be aborted."""

    def __init__(self, model: str | None, max_tokens: int, temperature: float) -> None:
        from tandem.engine import LLM
        from tandem.engine.model_source import resolve_model

        resolved = resolve_model(model)
        self.name = resolved.name
        self.llm = LLM(str(resolved.path))
        self.max_tokens, self.temperature = max_tokens, temperature
        self._ids = itertools.count()

    def stream(self, messages: list[dict[str, str]]) -> Iterator[str]:
        from tandem.common.sampling_params import SamplingParams
        from tandem.text.output_processor import OutputProcessor

        engine = self.llm.engine
        ids = self.llm.tokenizer.encode_chat(messages, add_generation_prompt=True)
        params = SamplingParams(max_tokens=self.max_tokens, temperature=self.temperature)
        engine.validate(ids, params)
        rid = f"chat-{next(self._ids)}"
        proc = OutputProcessor(self.llm.tokenizer, params)
        engine.add_request(rid, ids, params)
        done = False
        try:
            while not done:
                for out in engine.step():
                    if out.request_id != rid:
                        continue
                    delta = proc.process(out.new_token_ids, out.finish_reason if out.finished else None)
                    if delta.text:
                        yield delta.text
                    done = out.finished
        finally:
            if not done:
                engine.abort(rid)


def converse(backend: ChatBackend, system: str | None, read: Any = input, write: Any = None) -> int:
    """The read-reply loop; returns the exit status."""
    out = write or sys.stdout
    history: list[dict[str, str]] = []

    def base() -> list[dict[str, str]]:
        return [{"role": "system", "content": system}] if system else []

    history = base()
    print(f"chatting with {backend.name} ({HELP})", file=out, flush=True)
    while True:
        try:
            line = read(PROMPT)
        except EOFError:
            print(file=out)
            return 0
        except KeyboardInterrupt:
            print("\n(Ctrl-D or /bye to quit)", file=out, flush=True)
            continue
        text = line.strip()
        if not text:
            continue
        if text in ("/bye", "/exit", "/quit"):
            return 0
        if text == "/reset":
            history = base()
            print("(conversation cleared)", file=out, flush=True)
            continue
        if text in ("/help", "/?"):
            print(HELP, file=out, flush=True)
            continue
        history.append({"role": "user", "content": line})
        reply = []
        stream = backend.stream(history)
        try:
            for piece in stream:
                reply.append(piece)
                out.write(piece)
                out.flush()
            print(file=out, flush=True)
        except KeyboardInterrupt:
            stream.close()
            print("\n(stopped)", file=out, flush=True)
        except (ConnectionError, ValueError) as e:
            stream.close()
            history.pop()
            print(f"\nerror: {e}", file=out, flush=True)
            continue
        history.append({"role": "assistant", "content": "".join(reply)})


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model_arg", nargs="?", default=None, metavar="MODEL",
                   help="a local model to load (default: the embedded model); with --url, the "
                   "served model's id (default: the server's first)")
    p.add_argument("--url", default=None, help="chat with this running server, e.g. http://127.0.0.1:8000")
    p.add_argument("--api-key", default=None, help="bearer token for --url (also $TANDEM_API_KEY)")
    p.add_argument("--system", default=None, help="system prompt")
    p.add_argument("--max-tokens", type=int, default=512, help="longest reply, tokens")
    p.add_argument("--temperature", type=float, default=0.7)


def main(args: argparse.Namespace) -> int:
    import os

    try:
        if args.url:
            backend: ChatBackend = HttpChat(args.url, args.model_arg, args.api_key or os.environ.get(
                "TANDEM_API_KEY"), args.max_tokens, args.temperature)
        else:
            print(f"loading {args.model_arg or 'the embedded default model'} ...", file=sys.stderr, flush=True)
            backend = LocalChat(args.model_arg, args.max_tokens, args.temperature)
    except ConnectionError as e:
        print(f"tandem chat: {e}", file=sys.stderr)
        return 1
    return converse(backend, args.system)
