"""How many requests each decode worker on this host holds, for the prefill workers to read.

On a CPU host the pools share cores. A prefill worker pinned to its share leaves the
decode workers' cores idle whenever they hold nothing to decode, which is when a lone
prompt waits for its first token. The board lets a prefill worker see that moment: each
decode worker publishes how many requests it holds (reserved, prefilling locally or
decoding) into its slot of a small file every worker of a cluster started here maps; a
prefill worker compares the total with the requests it holds itself. Each of its
requests is held by a decode worker too (blocks are reserved before the prefill starts),
so ``total() == own`` means the decode workers hold only requests still being prefilled
here: nothing is decoding, and the prefill may take their cores (``ElasticThreads``).
Where ``own`` exceeds the total (a reservation released, or its decode worker replaced,
before the prefill here drops the request) the board's requests are counted as decoding.

The gateway creates the board (``create``) and removes it when the cluster stops; a
worker maps it by path (``DecodeBoard(path)``). Slots are int32 counts indexed by the
decode worker's number (``decode-3``: slot 3), one writer each, read without locks: a
torn read only picks the thread count of one step. A dead decode worker's slot keeps its
last count until its replacement (the same id) publishes its own: prefill workers stay
at their base count meanwhile.
"""

from __future__ import annotations

import mmap
import os
import re
import shutil
import tempfile

SLOTS = 1024  # decode workers one host's board can show (decode-0 .. decode-1023)
_SLOT_BYTES = 4


class DecodeBoard:
    """A mapped board; ``publish`` from a decode worker, ``total`` from a prefill worker."""

    def __init__(self, path: str) -> None:
        with open(path, "r+b") as f:
            self._map = mmap.mmap(f.fileno(), SLOTS * _SLOT_BYTES)
        self._slots = memoryview(self._map).cast("i")  # [SLOTS] int32
        self.path = path

    @classmethod
    def create(cls) -> DecodeBoard:
        """A fresh board in a private temporary folder (the creator ``remove``s it)."""
        folder = tempfile.mkdtemp(prefix="tandem-board-")
        path = os.path.join(folder, "decode")
        with open(path, "wb") as f:
            f.write(bytes(SLOTS * _SLOT_BYTES))
        return cls(path)

    @staticmethod
    def slot_of(worker_id: str) -> int | None:
        """The slot of ``decode-N`` (N < SLOTS), else None."""
        match = re.fullmatch(r"decode-(\d+)", worker_id)
        return int(match.group(1)) if match and int(match.group(1)) < SLOTS else None

    def publish(self, slot: int, held: int) -> None:
        """Decode worker ``slot`` now holds ``held`` requests."""
        self._slots[slot] = held

    def total(self) -> int:
        """Requests the host's decode workers hold, all together."""
        return sum(self._slots)

    def close(self) -> None:
        """Unmap (this process's view only; the file stays until ``remove``)."""
        self._slots.release()
        self._map.close()

    def remove(self) -> None:
        """Close and delete the board's folder (the creator, when the cluster stops)."""
        self.close()
        shutil.rmtree(os.path.dirname(self.path), ignore_errors=True)
