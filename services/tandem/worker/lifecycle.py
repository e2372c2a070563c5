"""A request's lifecycle on a worker: a table of states x events, one move per entry.

Each worker kind (``decode/lifecycle.py``, ``prefill/lifecycle.py``) declares its states, its
events and the table; its request object holds the state, and every change of state goes
through :meth:`Lifecycle.move`, which applies the table's entry or refuses the event (logged,
the state unchanged). The tables are printed in services/ARCHITECTURE.md ("Worker request
lifecycles") by :meth:`Lifecycle.markdown`.
"""

from __future__ import annotations

import enum
import logging
import threading
from collections.abc import Iterable, Mapping
from typing import Generic, Protocol, TypeVar

log = logging.getLogger(__name__)

S = TypeVar("S", bound=enum.Enum)
E = TypeVar("E", bound=enum.Enum)


class Lifecycle(Generic[S, E]):
    """The legal moves of one worker kind's requests."""

    def __init__(self, name: str, states: type[S], events: type[E],
                 table: Mapping[tuple[S, E], S], terminal: Iterable[S]) -> None:
        self.name = name
        self.states, self.events = states, events
        self.table = dict(table)
        self.terminal = frozenset(terminal)
        for (state, _), _ in self.table.items():
            if state in self.terminal:
                raise ValueError(f"{name}: a move out of the terminal state {state.name}")
        self.refused = 0  # events refused so far in this process, every worker's (for debugging)
        # one move at a time: the worker's event loop and its engine thread both move requests
        self._lock = threading.Lock()

    def next(self, state: S, event: E) -> S | None:
        """The state ``event`` moves a request in ``state`` to, or None when it is refused."""
        return self.table.get((state, event))

    def move(self, request: HasState[S], event: E, request_id: str = "") -> bool:
        """Apply ``event`` to ``request``: True when legal (its state is the table's), else
        the event is refused and logged, and the request keeps its state."""
        with self._lock:
            state = request.state
            to = self.table.get((state, event))
            if to is None:
                self.refused += 1
            else:
                request.state = to
        if to is None:
            log.info("%s %s: %s refused in %s", self.name, request_id, event.name, state.name)
            return False
        return True

    def move_held(self, held: dict, request, event: E) -> bool:
        """:meth:`move`, for a request a worker holds in ``held`` (by ``request.request_id``):
        one that reaches a terminal state is dropped from it."""
        moved = self.move(request, event, request.request_id)
        if request.state in self.terminal and held.get(request.request_id) is request:
            del held[request.request_id]
        return moved

    def markdown(self) -> str:
        """The table as Markdown: a row per state, a column per event, the next state in
        each legal cell (``·`` where the event is refused)."""
        events = list(self.events)
        rows = ["| state | " + " | ".join(e.name.lower() for e in events) + " |",
                "| --- |" + " --- |" * len(events)]
        for s in self.states:
            cells = [self.table[(s, e)].name.lower() if (s, e) in self.table else "·" for e in events]
            rows.append(f"| **{s.name.lower()}** | " + " | ".join(cells) + " |")
        return "\n".join(rows)


class HasState(Protocol[S]):
    """What :meth:`Lifecycle.move` needs of a request: a mutable ``state``."""

    state: S
