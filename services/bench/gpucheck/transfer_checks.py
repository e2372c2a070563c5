"""The KV transfer sections' slot.

The transfer path provides them, when it can, as ``services.transfer.device_check``
with ``sections() -> list[(name, fn)]``, each ``fn(ctx) -> list[Result]`` (``ctx`` a
``CheckContext``; ``ctx.dry_run``, ``ctx.device``), importing nothing missing on a
bare GPU machine (no Ray). Expected there: the sender and receiver over a real
NCCL communicator between two processes where two GPUs exist, the same-device
(CUDA IPC) transport on one GPU, and the event ordering of sends after compute.
Until that module exists the slot reports itself as not available (SKIP).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

from services.bench.gpucheck.context import CheckContext
from services.bench.gpucheck.report import Result, Status

ENTRY_POINT = "services.transfer.device_check"
SLOT = "kv transfer"


def transfer_sections() -> list[tuple[str, Callable[[CheckContext], list[Result]]]]:
    """The transfer path's sections, or one that says why there are none."""
    try:
        module = importlib.import_module(ENTRY_POINT)
    except ModuleNotFoundError as e:
        if e.name is not None and ENTRY_POINT.startswith(e.name):
            return [(SLOT, lambda ctx: [Result(SLOT, Status.SKIP,
                                               f"not available: no {ENTRY_POINT} yet")])]
        missing = e.name

        def fails(ctx: CheckContext) -> list[Result]:
            return [Result(SLOT, Status.FAIL,
                           f"{ENTRY_POINT} imports {missing}, which is not installed here")]
        return [(SLOT, fails)]
    return list(module.sections())
