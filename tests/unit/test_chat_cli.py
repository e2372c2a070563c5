"""``tandem chat``'s loop: history kept and re-sent, /reset, Ctrl-C keeps the partial reply
and cancels the request; the local backend aborts its engine request when stopped."""

from __future__ import annotations

import io
from collections.abc import Iterator

from tandem.cli.chat import LocalChat, converse


class ScriptedBackend:
    name = "scripted"

    def __init__(self, replies: list[list[str]], interrupt_after: int | None = None) -> None:
        self.replies, self.interrupt_after = replies, interrupt_after
        self.seen: list[list[dict[str, str]]] = []
        self.closed = 0

    def stream(self, messages: list[dict[str, str]]) -> Iterator[str]:
        self.seen.append([dict(m) for m in messages])
        pieces = self.replies[len(self.seen) - 1]
        try:
            for i, piece in enumerate(pieces):
                if self.interrupt_after is not None and i == self.interrupt_after:
                    raise KeyboardInterrupt
                yield piece
        finally:
            self.closed += 1


def _lines(*lines: str):
    items = iter(lines)

    def read(prompt: str) -> str:
        try:
            return next(items)
        except StopIteration:
            raise EOFError from None
    return read


def test_history_reset_and_system_prompt():
    backend = ScriptedBackend([["Hel", "lo"], ["Again"], ["Fresh"]])
    out = io.StringIO()
    assert converse(backend, "Be nice.", _lines("hi", "more", "/reset", "new"), out) == 0
    system = {"role": "system", "content": "Be nice."}
    assert backend.seen[0] == [system, {"role": "user", "content": "hi"}]
    assert backend.seen[1] == [system, {"role": "user", "content": "hi"},
                               {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "more"}]
    assert backend.seen[2] == [system, {"role": "user", "content": "new"}]
    assert "Hello\n" in out.getvalue() and "(conversation cleared)" in out.getvalue()


def test_ctrl_c_stops_the_reply_and_keeps_what_was_written():
    backend = ScriptedBackend([["a", "b", "c", "d"], ["ok"]], interrupt_after=2)
    out = io.StringIO()
    assert converse(backend, None, _lines("go", "next", "/bye"), out) == 0
    assert "(stopped)" in out.getvalue() and backend.closed == 2
    assert backend.seen[1][1] == {"role": "assistant", "content": "ab"}


def test_local_chat_aborts_the_engine_request_when_stopped(tiny_model_dir):
    chat = LocalChat(str(tiny_model_dir), max_tokens=50, temperature=0.0)
    stream = chat.stream([{"role": "user", "content": "hello"}])
    next(stream)
    assert chat.llm.engine.has_unfinished()
    stream.close()  # what Ctrl-C does
    assert not chat.llm.engine.has_unfinished()
    reply = "".join(chat.stream([{"role": "user", "content": "hello"}]))
    assert reply and not chat.llm.engine.has_unfinished()
