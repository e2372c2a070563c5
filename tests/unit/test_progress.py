"""tandem.engine.progress: bars and spinners on a terminal's stderr, nothing anywhere else."""

from __future__ import annotations

import io
import os
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from tandem.engine import progress as progress_mod
from tandem.engine.progress import bar, enabled, progress, spinner


class Stream(io.StringIO):
    """A text stream that records what is written; a terminal when ``tty``."""

    def __init__(self, tty: bool) -> None:
        super().__init__()
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty

    @property
    def encoding(self) -> str:
        return "utf-8"


@contextmanager
def streams(tty: bool) -> Iterator[tuple[Stream, Stream]]:
    """stderr and stdout replaced, within a test's body (pytest puts its own capture back
    between a fixture and the test): (stderr, stdout), terminals or pipes (CI logs)."""
    err, out = Stream(tty), Stream(tty)
    saved = sys.stderr, sys.stdout
    sys.stderr, sys.stdout = err, out
    try:
        yield err, out
    finally:
        sys.stderr, sys.stdout = saved


@pytest.fixture(autouse=True)
def columns(monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")


def test_nothing_is_written_and_the_iterable_is_unchanged_off_a_terminal():
    items = [1, 2, 3]
    with streams(tty=False) as (err, out):
        assert not enabled()
        assert progress(items, desc="work") is items
        assert list(progress(iter(items), desc="work")) == items
        with bar(10, desc="work") as b:
            assert not b.shown
            b.update(3)
            b.set_count(7)
            b.set_postfix("note")
        with spinner("waiting") as s:
            s.set_postfix("1 of 2")
            threading.Event().wait(3 * progress_mod.SPINNER_INTERVAL_S)
        assert sys.stdout is out and sys.stderr is err
    assert err.getvalue() == "" and out.getvalue() == ""
    assert not any(t.name == "tandem-spinner" for t in threading.enumerate())


def test_a_bar_counts_the_items_on_a_terminal():
    with streams(tty=True) as (err, out):
        assert enabled()
        assert list(progress([1, 2, 3], desc="converting", unit="tensor")) == [1, 2, 3]
    text = err.getvalue()
    assert "converting" in text and "3/3" in text and "tensor" in text
    assert out.getvalue() == ""  # bars go to stderr: stdout stays parseable


def test_disable_draws_nothing_even_on_a_terminal():
    items = [1, 2]
    with streams(tty=True) as (err, _):
        assert progress(items, disable=True) is items
        with bar(2, disable=True) as b:
            assert not b.shown
            b.update()
    assert err.getvalue() == ""


def test_a_spinner_shows_its_wait_on_a_terminal_and_stops():
    with streams(tty=True) as (err, _), spinner("tandem drain: waiting") as s:
        s.set_postfix("1 of 2 drained")
        threading.Event().wait(3 * progress_mod.SPINNER_INTERVAL_S)
    text = err.getvalue()
    assert "tandem drain: waiting" in text and "1 of 2 drained" in text
    assert any(frame in text for frame in progress_mod.SPINNER_FRAMES[1:])  # it turned
    assert not any(t.name == "tandem-spinner" for t in threading.enumerate())


def test_lines_printed_meanwhile_reach_their_stream_whole_and_the_streams_come_back():
    with streams(tty=True) as (err, out):
        with bar(2, desc="rates") as outer:
            assert sys.stdout is not out  # lines go above the bars
            print("rate 1 starting")
            with bar(3, desc="run") as inner:  # nested: drawn on the real stderr, not through the redirection
                inner.update(3)
                print("partial", end="")
                print(" line", file=sys.stdout)
                print("to stderr", file=sys.stderr)
            outer.update(2)
        assert sys.stdout is out and sys.stderr is err
    assert out.getvalue() == "rate 1 starting\npartial line\n"
    assert "to stderr\n" in err.getvalue() and "run" in err.getvalue() and "2/2" in err.getvalue()


def test_a_real_pseudo_terminal_gets_the_bar():
    import fcntl
    import struct
    import termios

    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 80, 0, 0))
    tty = open(slave, "w", encoding="utf-8", closefd=True)
    saved = sys.stderr
    drawn = b""
    try:
        sys.stderr = tty
        for _ in progress(range(4), desc="on a pty"):
            pass
        tty.flush()
        os.set_blocking(master, False)
        while True:
            try:
                chunk = os.read(master, 65536)
            except BlockingIOError:
                break
            if not chunk:
                break
            drawn += chunk
    finally:
        sys.stderr = saved
        tty.close()
        os.close(master)
    drawn = drawn.decode()
    assert "on a pty" in drawn and "4/4" in drawn


def test_the_load_generators_line_becomes_a_bar_on_a_terminal():
    from tandem.bench.loadgen import Progress

    with streams(tty=True) as (err, _):
        p = Progress("chat 2 req/s", total=4)
        p.sent, p.done = 4, 3
        p.show()
        p.done, p.errors = 4, 1
        p.show(final=True)
    text = err.getvalue()
    assert "3/4" in text and "sent 4, errors 0" in text
    assert "[chat 2 req/s] sent 4/4  done 4  errors 1" in text  # the run's last status line stays


def test_the_hub_download_bars_follow_the_terminal():
    pytest.importorskip("huggingface_hub")
    from tandem.engine.model_source import hub_progress_class

    cls = hub_progress_class()
    with streams(tty=False) as (pipe, _):
        quiet = cls(total=3, desc="Fetching")  # as huggingface_hub makes its bars: disable=None
        assert quiet.disable
        quiet.close()
    assert pipe.getvalue() == ""
    with streams(tty=True) as (err, _):
        shown = cls(total=3, desc="Fetching", disable=None)
        assert not shown.disable
        shown.close()
    assert "Fetching" in err.getvalue()
