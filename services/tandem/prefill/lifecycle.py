"""A request's lifecycle on a prefill worker: its states, the events that move it, and the
one object that holds everything the worker knows about it.

    queued ──added──▶ prefilling ──group_queued──▶ streaming ──last_group_queued──▶ sending
                         │   └──────────── last_group_queued ───────────────────────▶ │
                         │ first_token (no transfer), any end                          │ sent
                         ▼                                                             ▼
                      released ◀──────────────────────────────────────────────────────┘

``queued``: waiting for an earlier attempt of the id to be released, or for the engine to
take it. ``prefilling``: in the engine (its WAITING or RUNNING sequence). ``streaming``: its
earlier layer groups queued for sending. ``sending``: its last group, or the abandonment of
its transfer, queued: the sender's report (``sent``) frees its blocks, and any end meanwhile
only holds the request in the engine (no send reads blocks another request owns). A request
with no transfer (prefilled for a decode worker that computes nothing of it) is released at
token #1. The moves into ``released`` are the only places its blocks are freed (at
``shutdown`` they go with the stopped engine).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tandem.worker.lifecycle import Lifecycle

if TYPE_CHECKING:
    from tandem.protocol.messages import KVTransferDescriptor


class PrefillState(enum.Enum):
    QUEUED = enum.auto()
    PREFILLING = enum.auto()
    STREAMING = enum.auto()
    SENDING = enum.auto()
    RELEASED = enum.auto()


class PrefillEvent(enum.Enum):
    ADDED = enum.auto()  # the engine took it
    GROUP_QUEUED = enum.auto()  # a layer group before the last queued for sending
    LAST_GROUP_QUEUED = enum.auto()
    FIRST_TOKEN = enum.auto()  # token #1 sampled; released here when it has no transfer
    SENT = enum.auto()  # the sender's report on its transfer (done or failed)
    TRANSFER_FAILED = enum.auto()  # no transfer group to send on
    ABORT = enum.auto()
    TIMEOUT = enum.auto()  # no token #1 within the deadline
    STEP_FAILED = enum.auto()  # the engine step running it raised
    SHUTDOWN = enum.auto()


S, E = PrefillState, PrefillEvent
ENDS = (E.ABORT, E.TIMEOUT, E.STEP_FAILED)

TABLE: dict[tuple[PrefillState, PrefillEvent], PrefillState] = {
    (S.QUEUED, E.ADDED): S.PREFILLING,
    (S.PREFILLING, E.GROUP_QUEUED): S.STREAMING,
    (S.PREFILLING, E.LAST_GROUP_QUEUED): S.SENDING,
    (S.PREFILLING, E.FIRST_TOKEN): S.RELEASED,
    (S.PREFILLING, E.TRANSFER_FAILED): S.SENDING,
    (S.STREAMING, E.GROUP_QUEUED): S.STREAMING,
    (S.STREAMING, E.LAST_GROUP_QUEUED): S.SENDING,
    (S.STREAMING, E.TRANSFER_FAILED): S.SENDING,
    (S.STREAMING, E.SENT): S.RELEASED,  # a group's send failed: the sender drops the rest
    (S.SENDING, E.SENT): S.RELEASED,
    (S.SENDING, E.TRANSFER_FAILED): S.SENDING,
    **{(S.QUEUED, e): S.RELEASED for e in ENDS},
    **{(S.PREFILLING, e): S.RELEASED for e in ENDS},
    **{(S.STREAMING, e): S.SENDING for e in ENDS},  # abandoned behind the groups queued
    **{(S.SENDING, e): S.SENDING for e in ENDS},  # held: the report frees it
    # the engine stopped: its blocks go with it, never to be reused
    **{(s, E.SHUTDOWN): S.RELEASED for s in (S.QUEUED, S.PREFILLING, S.STREAMING, S.SENDING)},
}

LIFECYCLE = Lifecycle("prefill", PrefillState, PrefillEvent, TABLE, terminal=[S.RELEASED])


@dataclass(eq=False)
class PrefillingRequest:
    """Everything a prefill worker knows about one attempt of a request."""

    request_id: str
    state: PrefillState
    descriptor: KVTransferDescriptor | None = None  # where its KV goes; None: nowhere

    @property
    def transfer_id(self) -> str | None:
        return self.descriptor.transfer_id if self.descriptor is not None else None

    def move(self, event: PrefillEvent) -> bool:
        return LIFECYCLE.move(self, event, self.request_id)
