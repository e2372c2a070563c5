"""The decode board: decode workers publish the requests they hold, prefill workers of the
same host read the total (another process's writes included), and a prefill worker
bursts only while every request the decode workers hold is one it is still prefilling."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import types

import pytest

from tandem.prefill.worker import PrefillWorker
from tandem.worker.decode_board import SLOTS, DecodeBoard
from tandem.worker.threads import ElasticThreads


@pytest.fixture
def board():
    b = DecodeBoard.create()
    yield b
    b.remove()


def test_slots_add_up_across_processes(board):
    other = DecodeBoard(board.path)
    try:
        assert board.total() == 0
        other.publish(0, 3)
        board.publish(5, 2)
        assert board.total() == other.total() == 5
        code = ("import sys; from tandem.worker.decode_board import DecodeBoard; "
                "DecodeBoard(sys.argv[1]).publish(7, 4)")
        subprocess.run([sys.executable, "-c", code, board.path], check=True,
                       env={**os.environ, "PYTHONPATH": os.getcwd()})
        assert board.total() == 9
        other.publish(0, 0)
        assert board.total() == 6
    finally:
        other.close()


def test_remove_deletes_the_folder():
    b = DecodeBoard.create()
    folder = os.path.dirname(b.path)
    assert os.path.isfile(b.path)
    b.remove()
    assert not os.path.exists(folder)


@pytest.mark.parametrize("worker_id,slot", [
    ("decode-0", 0), ("decode-17", 17), (f"decode-{SLOTS - 1}", SLOTS - 1),
    (f"decode-{SLOTS}", None), ("prefill-0", None), ("decode-x", None), ("my-decode-1", None)])
def test_slot_of(worker_id, slot):
    assert DecodeBoard.slot_of(worker_id) == slot


def _prefill(board: DecodeBoard, remote: set[str]):
    """The state ``PrefillWorker._retune_threads`` reads: a board, the remote-prefill
    requests (those with a descriptor) and elastic threads of base 1, burst 2."""
    return types.SimpleNamespace(board=board, threads=ElasticThreads(1, 2),
                                 requests={rid: types.SimpleNamespace(descriptor=object()) for rid in remote})


def _engine(waiting=(), running=()):
    seqs = lambda ids: [types.SimpleNamespace(seq_id=i) for i in ids]  # noqa: E731
    return types.SimpleNamespace(scheduler=types.SimpleNamespace(waiting=seqs(waiting),
                                                                 running=seqs(running)))


@pytest.mark.parametrize("decode_holds,waiting,running,remote,threads", [
    (0, (), (), set(), 2),  # all idle
    (1, (), ("a",), {"a"}, 2),  # a lone prompt: its decode worker only holds its reservation
    (2, ("b",), ("a",), {"a", "b"}, 2),  # two queued prompts, nothing decoding yet
    (2, ("b",), (), {"a", "b"}, 1),  # "a" is done here (sends in flight): it decodes next
    (1, (), (), set(), 1),  # decoding a request prefilled earlier (or locally)
    (1, (), ("a",), set(), 1),  # a prompt without a reservation is no decode worker's
    (3, (), ("a",), {"a"}, 1),  # other prefill workers' requests, or decoding ones
    (1, (), ("a", "b"), {"a", "b"}, 1),  # one of ours released: the one shown may decode
    (0, (), ("a",), {"a"}, 2),  # ours released and nothing else held: nothing decodes
])
def test_prefill_bursts_only_while_nothing_decodes(board, decode_holds, waiting, running, remote,
                                                   threads):
    board.publish(0, decode_holds)
    worker = _prefill(board, remote)
    applied: list[int] = []

    def run():  # the engine thread's count (torch thread counts are per thread)
        PrefillWorker._retune_threads(worker, _engine(waiting, running))
        applied.append(worker.threads.current)
    t = threading.Thread(target=run)
    t.start()
    t.join()
    assert applied == [threads]
