"""A request's lifecycle on a decode worker: its states, the events that move it, and the
one object that holds everything the worker knows about it.

    reserving ──reserved──▶ reserved ──start──▶ receiving ──all_arrived──▶ committed ──commit──▶ decoding
        │                                                                       │                    │
        │ refused                                                      finished │           finished │
        ▼                                                                       ▼                    ▼
     released ◀──freed── releasing ◀── any end, from every state above     released             released

A request prefilled here (a re-drive, or conditional mode's short prompts) starts in
``decoding``. A request moving to another decode worker with its KV goes ``decoding
──migrate──▶ migrating_out``: it keeps decoding while its full blocks are copied, then
pauses for the last ones; ``migrated`` (the destination committed) releases it without
an abort reaching its stream, ``rolled_back`` returns it to ``decoding``. On the
destination it is opened ``reserving ──migration_reserved──▶ migrating_in ──commit──▶
decoding``. Every end (abort, client gone, transfer failed, timeout, stream closed,
shutdown) moves a live request to ``releasing``: its transfer is aborted first (no write in
flight, later groups drained), then ``freed`` frees its blocks. ``finished`` is the engine
ending it (its blocks freed with it). Those two, and ``refused`` (a reservation undone
before any transfer could write into it), are the only moves into ``released``: the only
places its blocks are freed.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tandem.worker.lifecycle import Lifecycle

if TYPE_CHECKING:
    from tandem.transfer.receiver import KVReceiver


class DecodeState(enum.Enum):
    RESERVING = enum.auto()  # reserve() taking blocks, registering the transfer
    RESERVED = enum.auto()  # blocks held (the engine's RESERVED), the transfer expected
    RECEIVING = enum.auto()  # start() waiting for the KV (bounded)
    COMMITTED = enum.auto()  # KV complete: joins the batch with token #1 next
    DECODING = enum.auto()  # in the engine's batch, tokens streaming
    MIGRATING_OUT = enum.auto()  # its KV being copied to another decode worker
    MIGRATING_IN = enum.auto()  # blocks held for a request moving here, its KV arriving
    RELEASING = enum.auto()  # ending: transfer aborted and drained, then blocks freed
    RELEASED = enum.auto()  # blocks freed; the request is forgotten


class DecodeEvent(enum.Enum):
    RESERVED = enum.auto()  # blocks taken, transfer registered
    REFUSED = enum.auto()  # no room, or the reservation failed before holding anything
    START = enum.auto()  # start() with a descriptor
    GROUP_ARRIVED = enum.auto()  # a layer group landed (seen by the receiver)
    ALL_ARRIVED = enum.auto()  # the transfer is DONE: nothing writes any more
    COMMIT = enum.auto()  # joined the engine's batch
    TOKEN = enum.auto()
    FINISHED = enum.auto()  # the engine ended it (stop, length): its blocks freed
    ABORT = enum.auto()  # the gateway or the router aborted it
    CLIENT_GONE = enum.auto()  # its feed's subscriber left
    TRANSFER_FAILED = enum.auto()
    TIMEOUT = enum.auto()  # the KV did not come in time
    STREAM_CLOSED = enum.auto()  # start() failed or was cancelled
    SHUTDOWN = enum.auto()
    FREED = enum.auto()  # the release freed its blocks
    MIGRATE = enum.auto()  # its move to another decode worker began
    MIGRATED = enum.auto()  # the destination committed it: this copy goes
    ROLLED_BACK = enum.auto()  # the move failed or timed out: it decodes here again
    MIGRATION_RESERVED = enum.auto()  # blocks taken for a request moving here


S, E = DecodeState, DecodeEvent
ENDS = (E.ABORT, E.CLIENT_GONE, E.TRANSFER_FAILED, E.TIMEOUT, E.STREAM_CLOSED, E.SHUTDOWN)
_LIVE = (S.RESERVING, S.RESERVED, S.RECEIVING, S.COMMITTED, S.DECODING, S.MIGRATING_OUT,
         S.MIGRATING_IN)

TABLE: dict[tuple[DecodeState, DecodeEvent], DecodeState] = {
    (S.RESERVING, E.RESERVED): S.RESERVED,
    (S.RESERVING, E.REFUSED): S.RELEASED,
    (S.RESERVED, E.START): S.RECEIVING,
    (S.RESERVED, E.GROUP_ARRIVED): S.RESERVED,  # the KV may land before start() comes
    (S.RECEIVING, E.GROUP_ARRIVED): S.RECEIVING,
    (S.RECEIVING, E.ALL_ARRIVED): S.COMMITTED,
    (S.COMMITTED, E.COMMIT): S.DECODING,
    (S.COMMITTED, E.FINISHED): S.RELEASED,  # token #1 ended it as it joined
    (S.DECODING, E.TOKEN): S.DECODING,
    (S.DECODING, E.FINISHED): S.RELEASED,
    (S.DECODING, E.MIGRATE): S.MIGRATING_OUT,
    (S.MIGRATING_OUT, E.TOKEN): S.MIGRATING_OUT,  # it decodes on during the pre-copy
    (S.MIGRATING_OUT, E.FINISHED): S.RELEASED,  # ended here first: nothing to move
    (S.MIGRATING_OUT, E.ROLLED_BACK): S.DECODING,
    (S.MIGRATING_OUT, E.MIGRATED): S.RELEASING,
    (S.RESERVING, E.MIGRATION_RESERVED): S.MIGRATING_IN,
    (S.MIGRATING_IN, E.GROUP_ARRIVED): S.MIGRATING_IN,
    (S.MIGRATING_IN, E.COMMIT): S.DECODING,
    **{(s, e): S.RELEASING for s in _LIVE for e in ENDS},
    **{(S.RELEASING, e): S.RELEASING for e in ENDS},  # already ending: the same release answers
    (S.RELEASING, E.FREED): S.RELEASED,
}

LIFECYCLE = Lifecycle("decode", DecodeState, DecodeEvent, TABLE, terminal=[S.RELEASED])


@dataclass(eq=False)
class HeldRequest:
    """Everything a decode worker knows about one attempt of a request."""

    request_id: str
    state: DecodeState
    transfer_id: str | None = None
    receiver: KVReceiver | None = None  # set while a transfer may write into its blocks
    reserving: Any = None  # the reserve task (asyncio.Task) while RESERVING
    releasing: Any = None  # the release task, once RELEASING
    # later calls for the same request id waiting for this attempt's release; an abort of
    # the request marks them ended (``_Waiter.ended``)
    waiters: list = field(default_factory=list)
    migration: Any = None  # the move out of here under way (``decode/migration.py``)

    def move(self, event: DecodeEvent) -> bool:
        return LIFECYCLE.move(self, event, self.request_id)
