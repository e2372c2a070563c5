"""ElasticThreads: the decode engine's torch thread count follows pending prefills."""

from __future__ import annotations

import threading

import pytest
import torch

from tandem.worker.threads import ElasticThreads


def _on_own_thread(fn):
    """Run ``fn`` on a fresh thread (as the engine loop does); its result and the
    thread count that thread ends with."""
    out = {}

    def body():
        out["result"] = fn()
        out["threads"] = torch.get_num_threads()
    t = threading.Thread(target=body)
    t.start()
    t.join()
    return out["result"], out["threads"]


def test_burst_while_no_prefill_is_pending():
    before = torch.get_num_threads()
    try:
        threads = ElasticThreads(base=1, burst=2)
        assert threads.enabled

        def sequence():
            return [threads.apply(0), threads.apply(1), threads.apply(3), threads.apply(0)]
        applied, final = _on_own_thread(sequence)
        assert applied == [2, 1, 1, 2] and final == 2
        assert threads.current == 2
        assert threads.switches == 3  # unknown -> 2 -> 1 -> 2; a repeated count is no switch
    finally:
        torch.set_num_threads(before)


def test_off_when_burst_is_not_above_base():
    threads = ElasticThreads(base=2, burst=0)
    assert not threads.enabled
    assert threads.wanted(0) == threads.wanted(5) == 2
    assert ElasticThreads(base=2, burst=2).enabled is False


@pytest.mark.parametrize("base,burst", [(0, 2), (1, -1)])
def test_bad_counts(base, burst):
    with pytest.raises(ValueError):
        ElasticThreads(base=base, burst=burst)


def test_cluster_config_rejects_negative_burst():
    from tandem.common.config import ClusterConfig

    with pytest.raises(ValueError, match="decode_burst_threads"):
        ClusterConfig(decode_burst_threads=-1)
