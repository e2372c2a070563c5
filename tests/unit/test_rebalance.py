"""The rebalancing plan: when it starts and stops (hysteresis), which requests it moves
first, and what it never does (overshoot, move a cooling request, exceed its moves)."""

from __future__ import annotations

from tandem.cluster.rebalance import STOP_GAP, RequestView, WorkerView, plan


def _worker(wid: str, used: int, total: int = 100, running: int = 0) -> WorkerView:
    return WorkerView(wid, total, total - used, running, 256, 16)


def _req(rid: str, wid: str, tokens: int, remaining: int = 500) -> RequestView:
    return RequestView(rid, wid, tokens, remaining)


def test_moves_start_at_the_start_gap_and_go_on_down_to_the_stop_gap():
    reqs = [_req(f"r{i}", "d0", 16 * 2) for i in range(10)]
    # 20 points apart: not enough to start, enough to go on once started
    assert not plan([_worker("d0", 30), _worker("d1", 10)], reqs, False, 0, set()).moves
    going = plan([_worker("d0", 30), _worker("d1", 10)], reqs, True, 0, set())
    assert going.active and going.moves
    # under the stop gap: it ends
    done = plan([_worker("d0", 20), _worker("d1", 20 - int(STOP_GAP * 100) + 1)], reqs, True,
                0, set())
    assert not done.active and not done.moves
    start = plan([_worker("d0", 60), _worker("d1", 0)], reqs, False, 0, set())
    assert start.active and [dst for _, dst in start.moves] == ["d1", "d1"]


def test_the_move_that_pays_most_goes_first_and_none_overshoots():
    workers = [_worker("d0", 60), _worker("d1", 0)]
    reqs = [_req("short-left", "d0", 16 * 10, remaining=2),
            _req("long-left", "d0", 16 * 10, remaining=800),
            _req("small", "d0", 16 * 2, remaining=800),
            _req("too-big", "d0", 16 * 40, remaining=800),  # 40 of a 60-point gap: overshoots
            _req("elsewhere", "d1", 16 * 10)]
    p = plan(workers, reqs, False, 0, set(), max_in_flight=3)
    assert [r for r, _ in p.moves] == ["long-left", "small", "short-left"]


def test_cooling_requests_moves_in_flight_and_a_full_destination_hold_it_back():
    workers = [_worker("d0", 60), _worker("d1", 0)]
    reqs = [_req("a", "d0", 16 * 5), _req("b", "d0", 16 * 4)]
    assert [r for r, _ in plan(workers, reqs, False, 0, {"a"}).moves] == ["b"]
    assert plan(workers, reqs, False, 2, set()).moves == []  # two under way already
    assert [r for r, _ in plan(workers, reqs, False, 1, set()).moves] == ["a"]
    nearly_full = [_worker("d0", 95), _worker("d1", 60, total=64)]  # 4 blocks free there
    assert plan(nearly_full, [_req("a", "d0", 16 * 5)], False, 0, set()).moves == []
    assert plan([_worker("d0", 90)], reqs, False, 0, set()).moves == []  # one worker: nothing


def test_a_full_batch_counts_like_full_kv():
    busy = WorkerView("d0", 100, 100, running=128, max_num_seqs=256, block_size=16)
    idle = WorkerView("d1", 100, 100, running=0, max_num_seqs=256, block_size=16)
    assert busy.fullness == 0.5
    p = plan([busy, idle], [_req("a", "d0", 16)], False, 0, set())
    assert p.active and p.moves == [("a", "d1")]
