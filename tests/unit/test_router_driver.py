"""The request driver under faults, against fake workers: a re-drive waits for a
transfer-group rebuild instead of burning its attempts, a transient loss is retried
without declaring the worker dead, a real loss is."""

from __future__ import annotations

import asyncio
from contextlib import aclosing

import pytest

from tandem.common.sampling_params import FinishReason, SamplingParams
from tandem.protocol.messages import KVTransferDescriptor, layer_groups
from tandem.protocol.request_path import PrefillResult, TokenDelta
from tandem.router import NoWorkersError, Router, RouterConfig, WorkerLoad
from tandem.router.driver import RequestDriver, TransferError, WorkerLostError

PARAMS = SamplingParams(temperature=0.0, max_tokens=3)


class Worker:
    def __init__(self, worker_id: str, role: str, rank: int = 0) -> None:
        self.worker_id, self.role, self.rank = worker_id, role, rank
        self.failures: list[BaseException | None] = []  # the next calls raise these in order
        # (None: that call passes)
        self.calls: list[str] = []
        self.aborted: list[str] = []
        self.aborted_transfers: list[str | None] = []
        self.reserved_transfers: list[str] = []
        self.free_blocks = 100

    def load(self) -> WorkerLoad:
        return WorkerLoad(self.worker_id, self.role, total_blocks=100,
                          free_blocks=self.free_blocks)

    def _maybe_fail(self, what: str) -> None:
        self.calls.append(what)
        if self.failures and (failure := self.failures.pop(0)) is not None:
            raise failure

    async def reserve(self, rid, prompt, params, src_rank, transfer_id, lg, checksum):
        self.reserved_transfers.append(transfer_id)
        self._maybe_fail("reserve")
        return KVTransferDescriptor(rid, transfer_id, (0,), layer_groups(2, None), src_rank, 9, 1)

    async def prefill(self, req) -> PrefillResult:
        self._maybe_fail("prefill")
        return PrefillResult(req.request_id, 11, len(req.prompt_token_ids))

    async def decode(self, req):
        self._maybe_fail("decode")
        n = len(req.output_token_ids)
        yield TokenDelta(req.request_id, (12, 13)[n - 1:], n, finished=True,
                         finish_reason=FinishReason.LENGTH)

    async def abort(self, rid: str, transfer_id: str | None = None) -> None:
        self.aborted.append(rid)
        self.aborted_transfers.append(transfer_id)


def _cluster(**driver_kw):
    p, d1, d2 = Worker("p0", "prefill"), Worker("d0", "decode"), Worker("d1", "decode")
    router = Router(RouterConfig(mode="disaggregated"), [p, d1, d2])
    return router, RequestDriver(router, **driver_kw), p, d1, d2


async def _run(driver, rid="r"):
    tokens = []
    async with aclosing(driver.generate(rid, [1, 2, 3], PARAMS)) as gen:
        async for delta in gen:
            tokens += delta.token_ids
    return tokens


def test_a_redrive_waits_for_the_rebuild_instead_of_spending_its_attempts():
    gate_waits = []

    async def main():
        rebuilt = asyncio.Event()

        async def wait_until_serving():
            gate_waits.append(len(d0.calls) + len(d1.calls))
            await rebuilt.wait()

        router, driver, p, d0, d1 = _cluster(max_attempts=2, wait_until_serving=wait_until_serving)
        # both decode workers are mid-rebuild: no transfer group to reserve into
        d0.failures.append(TransferError("d0 is not in a transfer group"))
        d1.failures.append(TransferError("d1 is not in a transfer group"))
        run = asyncio.ensure_future(_run(driver))
        while not gate_waits:
            await asyncio.sleep(0)
        assert not run.done() and len(d0.calls) + len(d1.calls) == 1
        rebuilt.set()
        return await run, router
    tokens, router = asyncio.run(main())
    assert tokens == [11, 12, 13] and gate_waits == [1]
    assert router.in_flight() == 0


def test_a_transient_loss_is_retried_without_marking_the_worker_dead():
    router, driver, p, d0, d1 = _cluster()
    d0.failures.append(WorkerLostError("d0", "unreachable", transient=True))
    d1.failures.append(WorkerLostError("d1", "unreachable", transient=True))
    assert asyncio.run(_run(driver)) == [11, 12, 13]
    assert router._dead == set()
    assert asyncio.run(_run(driver, "r2")) == [11, 12, 13]


def test_dead_workers_are_marked_dead_and_with_none_left_the_answer_is_503():
    router, driver, p, d0, d1 = _cluster()
    d0.failures.append(WorkerLostError("d0", "actor died"))
    assert asyncio.run(_run(driver)) == [11, 12, 13]  # moved to d1
    assert router._dead == {"d0"}
    d1.failures.append(WorkerLostError("d1", "actor died"))
    with pytest.raises(NoWorkersError):  # the gateway's 503 with Retry-After
        asyncio.run(_run(driver, "r2"))
    assert router._dead == {"d0", "d1"} and router.in_flight() == 0


def test_a_stream_under_way_moves_to_a_full_decode_worker_instead_of_being_cut():
    """Token #1 is out when d0 is lost; d1 has no free block: the stream resumes there
    (prompt + token #1 prefilled by d1 itself, queued until blocks free), never a 429."""
    router, driver, p, d0, d1 = _cluster()
    d1.free_blocks = 0  # route() picks d0, the roomier one
    d0.failures.append(None)  # reserve passes
    d0.failures.append(WorkerLostError("d0", "the engine loop stopped"))  # decode fails
    assert asyncio.run(_run(driver)) == [11, 12, 13]
    assert (p.calls, d0.calls, d1.calls) == (["prefill"], ["reserve", "decode"], ["decode"])
    assert router.decisions["local_resume"] == 1 and router.in_flight() == 0


def test_every_attempt_gets_its_own_transfer_id():
    from tandem.router.driver import transfer_id

    ids = {transfer_id("r", 0), transfer_id("r", 0), transfer_id("r", 1)}
    assert len(ids) == 3 and all(i.startswith("r#") for i in ids)


def test_an_attempts_abort_names_its_reservations_transfer():
    # the decode worker refuses a reserve that runs after its own abort only if the abort
    # names the attempt: a failed attempt's abort carries that attempt's transfer id
    router, driver, p, d0, d1 = _cluster()
    p.failures.append(TransferError("KV transfer TIMED_OUT"))
    assert asyncio.run(_run(driver)) == [11, 12, 13]
    reserved = sorted(d0.reserved_transfers + d1.reserved_transfers)  # "r#0.…", "r#1.…"
    assert [t[:4] for t in reserved] == ["r#0.", "r#1."]
    assert d0.aborted_transfers + d1.aborted_transfers == [reserved[0]]


def test_a_caller_leaving_during_reserve_aborts_that_attempts_transfer():
    # the case the transfer id is for: the reserve call still in flight when the caller
    # leaves; the abort that follows must name it, whichever runs first on the worker
    router, driver, p, d0, d1 = _cluster()
    started = asyncio.Event()

    async def reserve_forever(rid, prompt, params, src_rank, transfer_id, lg, checksum):
        for d in (d0, d1):
            d.reserved_transfers.append(transfer_id)
        started.set()
        await asyncio.Event().wait()

    d0.reserve = d1.reserve = reserve_forever

    async def main():
        task = asyncio.ensure_future(_run(driver))
        await started.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    asyncio.run(main())
    tid = d0.reserved_transfers[0]
    assert d0.aborted_transfers + d1.aborted_transfers == [tid] and router.in_flight() == 0
