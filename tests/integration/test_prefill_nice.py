"""Prefill workers on a shared CPU host run at a lower priority than decode workers."""

from __future__ import annotations

import threading

import pytest

from tandem.common.config import ClusterConfig, EngineConfig


def _niceness(native_id: int) -> int:
    with open(f"/proc/self/task/{native_id}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[16])  # field 19: nice


@pytest.mark.skipif(not __import__("os").path.exists("/proc/self/task"), reason="Linux only")
def test_a_nice_prefill_worker_runs_its_engine_thread_at_that_niceness(tiny_model_dir):
    from tandem.prefill.worker import PrefillWorker

    box = {}

    def build():  # in its own thread: Linux niceness is per thread, so the test's stays
        box["worker"] = PrefillWorker("prefill-0", EngineConfig(model=str(tiny_model_dir)),
                                      niceness=7)
    t = threading.Thread(target=build)
    t.start()
    t.join(timeout=60)
    worker = box["worker"]
    try:
        base = _niceness(threading.get_native_id())
        assert _niceness(worker.loop._thread.native_id) == min(19, base + 7)
    finally:
        worker.shutdown()


def test_prefill_nice_is_bounded():
    with pytest.raises(ValueError, match="prefill_nice"):
        ClusterConfig(prefill_nice=20)
    with pytest.raises(ValueError, match="prefill_nice"):
        ClusterConfig(prefill_nice=-1)
