"""Ray failures as the router sees them (services/cluster/handles.py): a transient
``ActorUnavailableError`` is retried, not death; a prefill queue timeout is a 503."""

from __future__ import annotations

import ray.exceptions as rex

from services.cluster.handles import RayWorker, is_transient
from services.decode.worker import TransferFailedError
from services.engine.engine_loop import EngineLoopStopped
from services.gateway.errors import from_backend_error
from services.prefill.worker import PrefillTimeoutError
from services.router.driver import TransferError, WorkerLostError
from services.router.errors import PrefillQueueTimeoutError
from services.transfer.channel import ChannelBrokenError


def _task_error(cause: BaseException) -> rex.RayTaskError:
    return rex.RayTaskError("prefill", "Traceback ...", cause)


def test_unavailable_is_transient_and_death_is_not():
    w = RayWorker(None, "decode-0", "decode")
    unavailable = rex.ActorUnavailableError("connection reset", None)
    assert is_transient(unavailable)
    lost = w._translate(unavailable)
    assert isinstance(lost, WorkerLostError) and lost.transient and lost.worker_id == "decode-0"
    died = w._translate(rex.ActorDiedError())
    assert isinstance(died, WorkerLostError) and not died.transient
    assert not is_transient(rex.ActorDiedError())


def test_a_prefill_queue_timeout_is_a_503_and_a_failed_transfer_is_re_driven():
    w = RayWorker(None, "prefill-0", "prefill")
    timeout = w._translate(_task_error(PrefillTimeoutError("no first token within 120s")))
    assert isinstance(timeout, PrefillQueueTimeoutError)
    err = from_backend_error(timeout)
    assert err.status == 503 and "Retry-After" in err.headers
    assert isinstance(w._translate(_task_error(TransferFailedError("x"))), TransferError)
    broken = w._translate(_task_error(ChannelBrokenError("not in a transfer group")))
    assert isinstance(broken, TransferError)  # re-driven once the group is rebuilt
    stopped = w._translate(_task_error(EngineLoopStopped("the engine loop stopped")))
    assert isinstance(stopped, WorkerLostError) and not stopped.transient
