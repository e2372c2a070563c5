"""``tandem serve`` with no model: the embedded SmolLM2-135M-Instruct answers a real question
through the openai SDK, under its own name."""

from __future__ import annotations

import sys

import pytest

from tandem.bench.launcher import TandemServer

pytestmark = pytest.mark.real_model


@pytest.fixture(scope="module")
def default_server(real_model_dir):
    """``python -m tandem.cli.main serve --port P``: nothing else (the model is converted
    into the shared cache by the fixture first, so start-up does not count conversion)."""
    server = TandemServer("unused", startup_timeout_s=600)
    server.argv = [sys.executable, "-m", "tandem.cli.main", "serve", "--port", str(server.port)]
    with server:
        yield server


def test_serve_without_arguments_answers_with_the_default_model(default_server):
    import openai

    client = openai.OpenAI(base_url=default_server.url + "/v1", api_key="unused")
    [model] = client.models.list().data
    assert model.id == "SmolLM2-135M-Instruct"
    reply = client.chat.completions.create(
        model=model.id, messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=24, temperature=0)
    assert "Paris" in reply.choices[0].message.content
    assert reply.choices[0].finish_reason == "stop"


class Terminal:
    """A process on a pseudo-terminal: what it writes, read as it comes; keys sent as typed."""

    def __init__(self, argv: list[str]) -> None:
        import os
        import pty
        import signal

        self.pid, self.fd = pty.fork()
        if self.pid == 0:  # the child: its stdin/stdout/stderr are the terminal
            # as a shell at a terminal starts it: Ctrl-C interrupts (a run of the suite
            # started in the background inherits SIGINT ignored, and so would the child)
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.execv(argv[0], argv)
        self.out = ""
        self.seen = 0  # read_until looks after this offset

    def send(self, keys: str) -> None:
        import os

        os.write(self.fd, keys.encode())

    def read_until(self, text: str, limit_s: float = 300.0) -> str:
        """Everything after the last match up to and including ``text``."""
        import os
        import select
        import time

        deadline = time.monotonic() + limit_s
        while text not in self.out[self.seen:]:
            if time.monotonic() > deadline:
                raise AssertionError(f"{text!r} never came; the terminal shows:\n{self.out[-2000:]}")
            ready, _, _ = select.select([self.fd], [], [], 1.0)
            if ready:
                try:
                    self.out += os.read(self.fd, 4096).decode("utf-8", "replace")
                except OSError:  # the child closed the terminal
                    break
        end = self.out.index(text, self.seen) + len(text)
        chunk, self.seen = self.out[self.seen:end], end
        return chunk

    def wait(self) -> int:
        import os

        return os.waitstatus_to_exitcode(os.waitpid(self.pid, 0)[1])

    def kill(self) -> None:
        import os
        import signal

        try:
            os.kill(self.pid, signal.SIGKILL)
            os.waitpid(self.pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass
        os.close(self.fd)


def _in_flight(url: str) -> float:
    """Requests the gateway is serving plus sequences the workers are running, from /metrics."""
    import httpx

    total = 0.0
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(("tandem_gateway_requests_in_flight", "tandem_num_requests_running")):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_tandem_chat_in_a_terminal(default_server):
    import time

    term = Terminal([sys.executable, "-m", "tandem.cli.main", "chat", "--url", default_server.url,
                     "--temperature", "0", "--max-tokens", "1000"])
    try:
        term.read_until("chatting with SmolLM2-135M-Instruct")
        term.read_until(">>> ")
        term.send("What is the capital of France?\n")
        assert "Paris" in term.read_until(">>> ")
        term.send("/reset\n")
        term.read_until("(conversation cleared)")
        term.read_until(">>> ")
        term.send("Write a very long story about a dragon who learns to paint.\n")
        term.read_until("paint.\r\n")  # the echo of the question
        term.read_until(" ")  # the reply has started streaming
        term.send("\x03")  # Ctrl-C
        term.read_until("(stopped)")
        term.read_until(">>> ")
        deadline = time.monotonic() + 60  # the server notices the closed stream and aborts
        while _in_flight(default_server.url) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert _in_flight(default_server.url) == 0
        term.send("/bye\n")
        assert term.wait() == 0
    finally:
        term.kill()
