"""The requests `tandem drain` / `tandem scale` hand a gateway through Ray's key-value store,
over an in-memory stand-in for that store (the Ray round trip is in test_drain and
test_multinode)."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from tandem.cluster import control


class FakeKV:
    """``ray.experimental.internal_kv``'s four calls, over a dict."""

    def __init__(self) -> None:
        self.data: dict[tuple[str, bytes], bytes] = {}

    def _internal_kv_put(self, key, value, overwrite=True, namespace=None):
        self.data[(namespace, key)] = value

    def _internal_kv_get(self, key, namespace=None):
        return self.data.get((namespace, key))

    def _internal_kv_del(self, key, namespace=None):
        self.data.pop((namespace, key), None)

    def _internal_kv_list(self, prefix, namespace=None):
        return [k for ns, k in self.data if ns == namespace and k.startswith(prefix)]


@pytest.fixture
def kv(monkeypatch) -> FakeKV:
    store = FakeKV()
    monkeypatch.setattr(control, "_kv", lambda: store)
    monkeypatch.setattr(control, "POLL_S", 0.01)
    return store


def test_workers_are_found_by_node_or_by_id_across_gateways(kv):
    control.publish_nodes("a", {"prefill-0": "n1", "decode-0": "n2", "decode-1": "n2"})
    control.publish_nodes("b", {"decode-0": "n3", "decode-7": "n2"})
    assert control.find_workers(node_id="n2") == [("a", "decode-0"), ("a", "decode-1"),
                                                  ("b", "decode-7")]
    assert control.find_workers(node_id="n2", name="b") == [("b", "decode-7")]
    assert control.find_workers(node_id="n9") == []
    assert control.find_workers(["decode-1", "decode-7"]) == [("a", "decode-1"), ("b", "decode-7")]
    with pytest.raises(ValueError, match="several gateways .*a, b.*--deployment"):
        control.find_workers(["decode-0"])
    assert control.find_workers(["decode-0"], name="b") == [("b", "decode-0")]
    with pytest.raises(ValueError, match="no running gateway has a worker 'decode-5'"):
        control.find_workers(["decode-5"])
    assert control.gateway_names() == ["a", "b"]
    control.publish_nodes("a", {"prefill-0": "n1"})  # decode-0 and -1 left gateway a
    assert control.find_workers(node_id="n2") == [("b", "decode-7")]
    control.publish_nodes("b", {})
    assert control.gateway_names() == ["a"]


class FakeCluster:
    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def drain_worker(self, worker_id: str, timeout_s: float):
        self.calls.append(("drain", worker_id, timeout_s))
        if worker_id == "decode-0":
            raise ValueError("decode-0 is the last decode worker of the cluster")
        return SimpleNamespace(idle=True, migrated=1, redriven=0, seconds=0.25)

    def scale(self, role: str, workers: int, timeout_s: float, drain_timeout_s: float):
        self.calls.append(("scale", role, workers, timeout_s, drain_timeout_s))
        return SimpleNamespace(workers=workers, added=("decode-2",), drained=())


def test_the_watcher_answers_each_request_and_removes_it(kv):
    cluster = FakeCluster()
    watcher = control.ControlWatcher("gw", cluster).start()
    try:
        drains = [("gw", "decode-1"), ("gw", "decode-0")]
        control.request_drain(drains, 12.5)
        answers = control.wait_drained(drains, time.monotonic() + 30)
        control.request("scale", [("gw", "decode")], {"workers": 3, "timeout_s": 60})
        scaled = control.wait_answers("scale", [("gw", "decode")], time.monotonic() + 30)
    finally:
        watcher.stop()
    assert answers == {"decode-1": {"idle": True, "migrated": 1, "redriven": 0, "seconds": 0.25},
                       "decode-0": {"error": "ValueError: decode-0 is the last decode worker "
                                             "of the cluster"}}
    assert scaled == {"decode": {"workers": 3, "added": ["decode-2"], "drained": []}}
    assert sorted(cluster.calls) == [("drain", "decode-0", 12.5), ("drain", "decode-1", 12.5),
                                     ("scale", "decode", 3, 60.0, 30.0)]
    assert not kv._internal_kv_list(b"gw/drain/", control.NAMESPACE)  # requests consumed
    assert not kv._internal_kv_list(b"gw/scale/", control.NAMESPACE)


def test_a_request_nobody_answers_times_out_and_is_withdrawn(kv):
    target = [("gone", "decode-1")]
    control.request_drain(target, 5)
    answers = control.wait_drained(target, time.monotonic() + 0.05)
    assert "no answer from gateway 'gone'" in answers["decode-1"]["error"]
    assert kv.data == {}  # not left for a gateway that starts later


@pytest.mark.parametrize("argv, message", [
    (["drain"], "name the workers to drain, or --node / --this-node"),
    (["drain", "decode-1", "--node", "abc"], "name the workers to drain, or --node / --this-node"),
    (["drain", "decode-1", "--timeout", "-1"], "--timeout must be >= 0"),
    (["scale"], "say how many workers: --prefill N and/or --decode M"),
    (["scale", "--decode", "0"], "a pool needs at least one worker"),
    (["scale", "--decode", "2", "--drain-timeout", "-5"], "--timeout and --drain-timeout must be >= 0"),
])
def test_bad_drain_and_scale_commands_are_refused_before_joining_ray(argv, message, capsys):
    from tandem.cli.main import main

    assert main(argv) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("command", ["drain", "scale"])
def test_the_commands_print_their_json_and_no_spinner_off_a_terminal(kv, monkeypatch, capsys, command,
                                                                      tmp_path):
    import json

    from tandem.cli.main import main
    from tandem.cluster import ray_start

    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))  # no tandem serve of this machine's
    monkeypatch.setattr(ray_start, "RayRuntime",
                        lambda address="auto": SimpleNamespace(start=lambda: None, stop=lambda: None))
    control.publish_nodes("gw", {"decode-1": "n1"})
    watcher = control.ControlWatcher("gw", FakeCluster()).start()
    try:
        code = main(["drain", "decode-1", "--timeout", "7"] if command == "drain" else ["scale", "--decode", "3"])
    finally:
        watcher.stop()
    out = capsys.readouterr()
    assert code == 0
    if command == "drain":
        assert json.loads(out.out) == {"decode-1": {"idle": True, "migrated": 1, "redriven": 0, "seconds": 0.25}}
        assert out.err == "tandem drain: draining decode-1 (up to 7s)\n"  # stderr is no terminal: no spinner
    else:
        assert json.loads(out.out) == {"decode": {"workers": 3, "added": ["decode-2"], "drained": []}}
        assert out.err == ""


def test_a_wait_reports_the_answers_as_they_arrive(kv):
    cluster = FakeCluster()
    seen: list[tuple[int, int]] = []
    watcher = control.ControlWatcher("gw", cluster).start()
    try:
        drains = [("gw", "decode-1"), ("gw", "decode-3")]
        control.request_drain(drains, 1)
        control.wait_drained(drains, time.monotonic() + 30, lambda done, total: seen.append((done, total)))
    finally:
        watcher.stop()
    assert seen and seen[-1] == (2, 2) and all(total == 2 for _, total in seen)
    assert [done for done, _ in seen] == sorted(done for done, _ in seen)
