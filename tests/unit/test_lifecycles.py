"""The request lifecycles of both worker kinds, driven by random event orders.

Each walk runs one request through random events (the worker's own and fake channel
arrivals, in any order, repeated, late), applying each through the kind's
``Lifecycle.move`` and, for the moves it allows, the effects the worker makes of them on
the request's blocks and its transfer. After every event: the blocks are freed at most
once, nothing is written into them after they are freed, no commit follows an end, and
every end is answered (legal in every live state). After a shutdown the request is in its
terminal state. Both tables run 10,000 walks each.
"""

from __future__ import annotations

import random

import pytest

from tandem.decode import lifecycle as dl
from tandem.prefill import lifecycle as pl
from tandem.worker.lifecycle import Lifecycle

WALKS = 10_000
STEPS = 24


class _Request:
    def __init__(self, state) -> None:
        self.state = state


class DecodeBlocks:
    """What a decode worker does to a request's blocks and transfer on each allowed move."""

    def __init__(self) -> None:
        self.held = False  # blocks taken
        self.transfer_open = False  # a transfer may still write into them
        self.frees = 0
        self.ended = False
        self.violations: list[str] = []

    def apply(self, before, event, after) -> None:
        E, S = dl.DecodeEvent, dl.DecodeState
        if event is E.RESERVED:
            self.held = self.transfer_open = True
        elif event is E.GROUP_ARRIVED and self.transfer_open and self.frees:
            self.violations.append("a KV write after the blocks were freed")
        elif event is E.ALL_ARRIVED:
            self.transfer_open = False
        elif event is E.COMMIT and self.ended:
            self.violations.append("committed after an end")
        elif event in dl.ENDS:
            self.ended = True
        if after is S.RELEASING and before is not S.RELEASING:
            self.transfer_open = False  # the release aborts the transfer first (no write in flight)
        if after is S.RELEASED and before is not S.RELEASED:
            if event in (E.FREED, E.FINISHED):
                self.frees += 1
            if self.transfer_open:
                self.violations.append("released with its transfer open")
        if self.frees > 1:
            self.violations.append("blocks freed twice")


class PrefillBlocks:
    """What a prefill worker does to a request's blocks and sends on each allowed move."""

    def __init__(self) -> None:
        self.sends_queued = 0  # groups (or an abandonment) the sender still holds
        self.frees = 0
        self.violations: list[str] = []

    def apply(self, before, event, after) -> None:
        E, S = pl.PrefillEvent, pl.PrefillState
        if event in (E.GROUP_QUEUED, E.LAST_GROUP_QUEUED) or (
                before is S.STREAMING and after is S.SENDING):  # the abandonment rides last
            self.sends_queued += 1
        if event is E.SENT:
            self.sends_queued = 0  # the report: the sender is done with its blocks
        if after is S.RELEASED and before is not S.RELEASED:
            self.frees += 1
            if self.sends_queued and event is not E.SHUTDOWN:
                self.violations.append("freed while a send may read the blocks")
        if self.frees > 1:
            self.violations.append("blocks freed twice")


def _walk(lifecycle: Lifecycle, start, effects, rng: random.Random, live, ends) -> None:
    req = _Request(start)
    events = list(lifecycle.events)
    for _ in range(STEPS):
        event = rng.choice(events)
        before = req.state
        if before in live and event in ends:
            assert lifecycle.next(before, event) is not None, f"{event.name} unanswered in {before.name}"
        if lifecycle.move(req, event):
            effects.apply(before, event, req.state)
        assert not effects.violations, (effects.violations, before.name, event.name)
    shutdown = lifecycle.events["SHUTDOWN"]
    before = req.state
    if lifecycle.move(req, shutdown):
        effects.apply(before, shutdown, req.state)
    for event in lifecycle.events:  # what the worker's shutdown then does: free what is left
        if req.state in lifecycle.terminal:
            break
        if event.name in ("FREED", "SENT"):
            before = req.state
            if lifecycle.move(req, event):
                effects.apply(before, event, req.state)
    assert req.state in lifecycle.terminal, f"left {req.state.name} after shutdown"
    assert not effects.violations, effects.violations


def test_decode_requests_under_random_event_orders():
    rng = random.Random(7)
    S = dl.DecodeState
    live = {S.RESERVING, S.RESERVED, S.RECEIVING, S.COMMITTED, S.DECODING}
    for _ in range(WALKS):
        start = rng.choice([S.RESERVING, S.DECODING])  # a remote prefill, or one prefilled here
        _walk(dl.LIFECYCLE, start, DecodeBlocks(), rng, live, dl.ENDS)


def test_prefill_requests_under_random_event_orders():
    rng = random.Random(11)
    S = pl.PrefillState
    live = {S.QUEUED, S.PREFILLING, S.STREAMING, S.SENDING}
    for _ in range(WALKS):
        _walk(pl.LIFECYCLE, S.QUEUED, PrefillBlocks(), rng, live, pl.ENDS)


@pytest.mark.parametrize("mutation", ["commit after abort", "release skips the transfer abort"])
def test_the_walks_catch_a_broken_decode_table(mutation):
    S, E = dl.DecodeState, dl.DecodeEvent
    table = dict(dl.TABLE)
    if mutation == "commit after abort":
        table[(S.RELEASING, E.COMMIT)] = S.DECODING
    else:  # a release that frees the blocks with the transfer still writing
        table[(S.RECEIVING, E.FREED)] = S.RELEASED
    broken = Lifecycle("decode", S, E, table, terminal=[S.RELEASED])
    rng = random.Random(3)
    with pytest.raises(AssertionError):
        for _ in range(WALKS):
            _walk(broken, S.RESERVING, DecodeBlocks(), rng, {S.RESERVING, S.RESERVED, S.RECEIVING,
                                                        S.COMMITTED, S.DECODING}, dl.ENDS)


def test_refused_events_keep_the_state_and_are_counted():
    lifecycle = Lifecycle("t", dl.DecodeState, dl.DecodeEvent, dl.TABLE, [dl.DecodeState.RELEASED])
    req = _Request(dl.DecodeState.RELEASING)
    assert not lifecycle.move(req, dl.DecodeEvent.COMMIT)
    assert req.state is dl.DecodeState.RELEASING and lifecycle.refused == 1
    with pytest.raises(ValueError, match="terminal"):
        Lifecycle("t", dl.DecodeState, dl.DecodeEvent,
                  {(dl.DecodeState.RELEASED, dl.DecodeEvent.TOKEN): dl.DecodeState.DECODING},
                  [dl.DecodeState.RELEASED])


def test_the_tables_render_as_markdown():
    text = dl.LIFECYCLE.markdown()
    assert "| **reserving** |" in text and "releasing" in text
    assert pl.LIFECYCLE.markdown().count("\n") == len(pl.PrefillState) + 1


def test_the_architecture_document_shows_the_tables_in_force():
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "services" / "ARCHITECTURE.md").read_text()
    assert dl.LIFECYCLE.markdown() in text and pl.LIFECYCLE.markdown() in text
