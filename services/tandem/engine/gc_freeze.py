"""The cyclic garbage collector in a process that keeps one engine for its whole life.

A full collection traverses every tracked object: after start-up that is hundreds of
thousands of them (torch, the model's modules, Ray), and full collections come every few
thousand allocations' worth of steps, a visible share of a small model's batch-1 decode
(perf samples in ``gc_collect_main`` and its visitors; services/RESULTS.md). Frozen,
those objects are skipped; collections then look only at what the steps allocate.

Only for processes that hold their engine to the end (worker actors, a benchmark's
process): a frozen object that later becomes part of a garbage cycle is never freed.
"""

from __future__ import annotations

import atexit
import gc


def freeze() -> int:
    """Collect what is garbage now, then move every object still alive into the
    collector's permanent generation (``gc.freeze``) until the interpreter exits (then
    the shutdown's collections see them again); returns how many are frozen."""
    gc.collect()
    gc.freeze()
    atexit.unregister(gc.unfreeze)  # once
    atexit.register(gc.unfreeze)
    return gc.get_freeze_count()


def in_actor_process() -> bool:
    """Whether this process is a Ray actor's (its own process, for the actor's life),
    without starting Ray where it is not running."""
    import ray

    return ray.is_initialized() and ray.get_runtime_context().get_actor_id() is not None
