"""New workers get the lowest numbers no live worker holds: a worker still draining keeps
its number, which names its metrics and its slot on the decode board."""

from __future__ import annotations

import types

from tandem.cluster.scale import new_worker_ids


def _cluster(prefill=(), decode=(), draining=()):
    w = lambda wid: types.SimpleNamespace(worker_id=wid)  # noqa: E731
    return types.SimpleNamespace(prefill=[w(i) for i in prefill], decode=[w(i) for i in decode],
                                 draining={i: w(i) for i in draining})


def test_new_ids_fill_the_gaps_from_zero():
    c = _cluster(prefill=["prefill-0"], decode=["decode-1", "decode-3"])
    assert new_worker_ids(c, "decode", 3) == ["decode-0", "decode-2", "decode-4"]
    assert new_worker_ids(c, "prefill", 1) == ["prefill-1"]


def test_a_draining_worker_keeps_its_number():
    c = _cluster(decode=["decode-0"], draining=["decode-1"])
    assert new_worker_ids(c, "decode", 2) == ["decode-2", "decode-3"]
