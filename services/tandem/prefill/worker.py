"""The prefill worker: an engine in the prefill role plus the sending end of KV transfer.

It computes a prompt's KV, samples token #1 from its own logits and returns it
at once (TTFT does not wait for the transfer); meanwhile each layer group's
KV, complete as soon as that group's forward finishes, is pushed to the
blocks the decode worker reserved. The request's blocks are freed when the
last group's send completed on the device or the send failed; a step that
stops between groups abandons the transfer behind the groups already queued,
so no send reads blocks that were freed.

On CUDA each group's send waits (device-side) for an event recorded on the
compute stream right after the group's last layer was queued, so the engine
never stalls for a send and a send never reads KV still being written.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping

from tandem.common.config import EngineConfig
from tandem.engine.engine import EngineOutput, LLMEngine
from tandem.engine.engine_loop import EngineLoopStopped
from tandem.engine.sequence import Sequence
from tandem.prefill.lifecycle import LIFECYCLE, PrefillEvent as E, PrefillingRequest, PrefillState as S
from tandem.protocol.request_path import PrefillRequest, PrefillResult, TokenLogprob
from tandem.transfer.channel import ChannelBrokenError
from tandem.transfer.endpoint import make_sender, open_channel
from tandem.transfer.layout import MIN_RUN_PLANE_BYTES
from tandem.transfer.sender import SendJob, SendReport
from tandem.worker.decode_board import DecodeBoard
from tandem.worker.engine_worker import EngineWorker
from tandem.worker.threads import ElasticThreads

log = logging.getLogger(__name__)


class RequestAbortedError(RuntimeError):
    """The request was aborted before its first token."""


class PrefillTimeoutError(TimeoutError):
    """Token #1 did not come within the prefill deadline (the worker's queue is too long)."""


class PrefillFailedError(RuntimeError):
    """The engine step running the prompt raised; the request ended, the worker serves on."""


class PrefillWorker(EngineWorker):
    """Wrap with ``ray.remote`` (async actor); one engine, one sender.

    Each request it holds is one :class:`PrefillingRequest` in ``requests``, moved through
    its lifecycle (``prefill/lifecycle.py``) by the table there."""

    def __init__(self, worker_id: str, config: EngineConfig, niceness: int = 0,
                 sync=None, burst_threads: int = 0, board: str | None = None) -> None:
        """``burst_threads``: torch threads while the host's decode workers hold no request
        but this worker's own (read from ``board``, the host's ``DecodeBoard``; 0 or no
        board: always ``config.num_threads``)."""
        super().__init__(worker_id, config, "prefill", on_layer_done=self._on_layer_done,
                         niceness=niceness, on_request_failed=self._end_on_engine, sync=sync)
        self.threads = ElasticThreads(self.num_threads, burst_threads if board else 0)
        self.board = DecodeBoard(board) if self.threads.enabled else None
        self.sender = None
        self._joined = False  # joined a transfer group once: without one now, it is broken
        # the attempt held of each request id (the event loop, the engine thread and the
        # sender's completions read it; each request moves by its lifecycle's table)
        self.requests: dict[str, PrefillingRequest] = {}
        self._hold_sends = False  # this step's layer groups wait for its last layer
        self.kv_bytes_sent = 0
        if self.board is not None:
            self.loop.between_steps = self._retune_threads

    def _retune_threads(self, engine: LLMEngine) -> None:
        """On the engine thread, before each step: burst while every request the decode
        workers hold is one still being prefilled here (a request whose prompt is done
        may be decoding already, its KV sends in flight or not)."""
        sched = engine.scheduler
        own = sum(1 for s in (*sched.waiting, *sched.running)  # a decode worker holds each
                  if (r := self.requests.get(s.seq_id)) is not None and r.descriptor is not None)
        total = self.board.total()
        # own > total: some of ours are no longer held (released, or their decode worker
        # replaced), so the board's requests cannot be told from ours: any may be decoding
        self.threads.apply(total - own if own <= total else total)

    def join_transfer_group(self, transports: Mapping[int, str], world_size: int, rank: int,
                            group_name: str, timeout_ms: int = 30_000,
                            in_place_min_bytes: int | None = MIN_RUN_PLANE_BYTES,
                            op_timeout_s: float = 30.0) -> int:
        """Become ``rank`` of the transfer group (all workers call this together), reaching
        each decode rank of ``transports`` over the transport named there; returns once
        every pair is connected."""
        # a decode rank lost (drained, or dead until the group is rebuilt) fails only the
        # transfers to it: the others go on
        channel = open_channel(transports, world_size, rank, group_name, self.sync,
                               timeout_ms=timeout_ms, op_timeout_s=op_timeout_s,
                               optional=list(transports))
        self.sender = make_sender(channel, self.engine, self._on_sent, in_place_min_bytes)
        self._joined = True
        return rank

    def leave_transfer_group(self) -> None:
        """Leave the group (before it is rebuilt around a replaced worker)."""
        if self.sender is not None:
            sender, self.sender = self.sender, None
            sender.channel.close()
            sender.close()

    def transfer_broken(self) -> str | None:
        sender = self.sender
        if sender is None:
            return "left the transfer group" if self._joined else None
        return sender.channel.broken

    def counters(self) -> dict:
        sender = self.sender
        return {"kv_bytes_sent": self.kv_bytes_sent, "thread_switches": self.threads.switches,
                "kv_groups_in_place": sender.groups_in_place if sender else 0,
                "kv_groups_gathered": sender.groups_gathered if sender else 0}

    # -- requests ---------------------------------------------------------------
    async def prefill(self, req: PrefillRequest, timeout_s: float = 120.0) -> PrefillResult:
        """Prefill, start pushing KV to ``req.descriptor``, return token #1.

        Raises ``PrefillTimeoutError`` when token #1 is not out within ``timeout_s``
        (queued behind too much work), ``PrefillFailedError`` when the step running
        it raised; the request is aborted either way.
        """
        if req.descriptor is not None and (broken := self.transfer_broken() or (
                None if self.sender is not None else "not in a transfer group")):
            raise ChannelBrokenError(f"prefill worker {self.worker_id}: {broken}")
        aio = asyncio.get_running_loop()
        first: asyncio.Future[EngineOutput] = aio.create_future()

        def settle(fn) -> None:
            aio.call_soon_threadsafe(lambda: first.done() or fn())

        rid = req.request_id
        await self._earlier_attempt_released(rid, timeout_s)
        self.loop.open_stream(rid, lambda out: settle(lambda: first.set_result(out)),
                              lambda exc: settle(lambda: first.set_exception(exc)))
        record = self.requests[rid] = PrefillingRequest(rid, S.QUEUED, req.descriptor)

        def add(e: LLMEngine) -> None:
            e.add_request(rid, req.prompt_token_ids, req.sampling_params)
            record.move(E.ADDED)
        try:
            await self._run(add)
            try:
                out = await asyncio.wait_for(first, timeout_s)
            except asyncio.TimeoutError:
                raise PrefillTimeoutError(f"{rid}: no first token within {timeout_s:g}s on "
                                          f"{self.worker_id}") from None
        except BaseException as e:
            ended = E.TIMEOUT if isinstance(e, PrefillTimeoutError) else \
                E.ABORT if isinstance(e, (asyncio.CancelledError, ValueError)) else E.STEP_FAILED
            await asyncio.shield(self._abort(rid, ended))
            if isinstance(e, Exception) and not isinstance(
                    e, (PrefillTimeoutError, ValueError, EngineLoopStopped)):
                raise PrefillFailedError(f"{rid} failed on {self.worker_id}: "
                                         f"{type(e).__name__}: {e}") from e
            raise
        finally:
            self.loop.close_stream(rid)
        if not out.new_token_ids:
            raise RequestAbortedError(f"{rid} was aborted during prefill")
        if req.descriptor is None:
            self.loop.submit(lambda e: self._released_at_first_token(e, record))
        lp = out.new_logprobs[0] if out.new_logprobs else None
        return PrefillResult(
            request_id=rid, first_token_id=out.new_token_ids[0],
            num_prompt_tokens=out.num_prompt_tokens, num_cached_tokens=out.num_cached_tokens,
            first_logprob=TokenLogprob.of(lp) if lp is not None else None,
            kv_bytes=self._kv_bytes(req), finish_reason=out.finish_reason)

    async def _earlier_attempt_released(self, rid: str, timeout_s: float) -> None:
        """A re-drive of a request to this worker waits until the KV of its earlier attempt
        here is released (its sends ended): until then the request's descriptor, and the
        engine's sequence of that id, are the earlier attempt's."""
        deadline = time.monotonic() + timeout_s
        while rid in self.requests:
            if time.monotonic() > deadline:
                raise PrefillTimeoutError(f"{rid}: an earlier attempt still holds its KV on "
                                          f"{self.worker_id} after {timeout_s:g}s")
            await asyncio.sleep(0.01)

    async def abort(self, request_id: str) -> None:
        """Stop a prefill; KV already queued for sending is freed once the sends end.

        It ends the attempt registered when it is called (or none): the engine runs it
        between steps, and a re-drive of the request that registers meanwhile (its
        ``add_request`` queued behind this abort) is not this abort's to end; taking its
        descriptor would leave its prompt's KV held with no transfer to release it."""
        await self._abort(request_id, E.ABORT)

    async def _abort(self, request_id: str, event: E) -> None:
        attempt = self.requests.get(request_id)

        def run(e: LLMEngine) -> None:
            if self.requests.get(request_id) is not attempt:
                return  # a later attempt registered after this abort was asked
            out = self._end_on_engine(e, request_id, event)
            if out is not None:
                self.loop.dispatch([out])  # wakes a prefill() waiting on it
        try:
            await self._run(run)
        except Exception as e:  # the engine is gone: its blocks with it
            log.warning("could not abort %s on %s: %s", request_id, self.worker_id, e)

    def _end_on_engine(self, e: LLMEngine, request_id: str,
                       event: E = E.STEP_FAILED) -> EngineOutput | None:
        """End a request on the engine thread; blocks with sends queued are freed by the
        sender's completion instead, so no send reads blocks another request owns. A
        request whose step stopped between its layer groups has its transfer abandoned
        behind the groups already queued."""
        req = self.requests.get(request_id)
        if req is not None and req.state is S.STREAMING:
            req.move(event)  # -> SENDING
            d = req.descriptor
            if self.sender is None:
                self._on_sent(SendReport(d.transfer_id, False, "no transfer group", 0, 0.0))
            else:
                self.sender.abandon(d.transfer_id, d.dst_rank,
                                    f"{request_id}'s prefill step failed")
        elif req is not None and req.state is not S.SENDING:
            self._move(req, event)  # queued or prefilling: released here
        if req is not None and req.state is S.SENDING:
            req.move(event)
            e.hold(request_id)  # not run again; the report's release frees it
            return None
        out = e.abort(request_id)
        e.release(request_id)
        return out

    def _released_at_first_token(self, e: LLMEngine, req: PrefillingRequest) -> None:
        """On the engine thread: a request with no transfer frees its KV once token #1 is out."""
        if self._move(req, E.FIRST_TOKEN):
            e.release(req.request_id)

    def _move(self, req: PrefillingRequest, event: E) -> bool:
        return LIFECYCLE.move_held(self.requests, req, event)

    def _kv_bytes(self, req: PrefillRequest) -> int:
        d = req.descriptor
        if d is None:
            return 0
        cache = self.engine.kv_cache
        per_layer = cache.bytes_per_block(1, cache.block_size, cache.num_kv_heads, cache.head_dim,
                                          cache.dtype)
        return per_layer * len(d.block_ids) * sum(g.num_layers for g in d.layer_groups)

    # -- transfer (engine loop thread / sender thread) ----------------------------
    def _on_layer_done(self, layer: int, completing: list[Sequence]) -> None:
        """On the engine thread, right after layer ``layer``'s kernels were queued.

        Each layer group goes out as its last layer is queued, while the next layers
        compute; except while this worker bursts: then its threads hold every core, and a
        send (with the decode worker's receive) would preempt one of them and stall the
        whole fork-join step, so every group waits for the step's last layer."""
        if layer == 0:  # one answer for the whole step (the count changes between steps)
            self._hold_sends = self.threads.bursting
        hold = self._hold_sends
        if hold and layer + 1 < self.engine.model_config.num_layers:
            return
        sender = self.sender
        ready = None  # one event per layer, recorded only when a group ends here
        for seq in completing:
            req = self.requests.get(seq.seq_id)
            # not sent, or its last group (or a failure) queued at an earlier layer
            if req is None or req.descriptor is None or req.state not in (S.PREFILLING, S.STREAMING):
                continue
            d = req.descriptor
            if sender is None:  # left the group mid-request: fail the transfer, free the KV
                req.move(E.TRANSFER_FAILED)
                self._on_sent(SendReport(d.transfer_id, False, "no transfer group", 0, 0.0))
                continue
            n_blocks = len(d.block_ids)
            if len(seq.block_ids) < n_blocks:
                raise RuntimeError(f"{seq.seq_id}: {len(seq.block_ids)} blocks, "
                                   f"decode reserved {n_blocks}")
            for g, group in enumerate(d.layer_groups):
                if group.stop == layer + 1 or hold:
                    if ready is None:
                        ready = self.sync.record_event(self.sync.current_stream())
                    final = g == len(d.layer_groups) - 1
                    req.move(E.LAST_GROUP_QUEUED if final else E.GROUP_QUEUED)
                    sender.submit(SendJob(
                        transfer_id=d.transfer_id, dst_rank=d.dst_rank,
                        src_block_ids=seq.block_ids[:n_blocks], layers=group.layers,
                        layer_group=g, final=final, with_checksum=d.checksum,
                        dst_block_ids=d.block_ids, ready=ready))

    def _on_sent(self, report: SendReport) -> None:
        req = next((r for r in list(self.requests.values()) if r.transfer_id == report.transfer_id),
                   None)
        if req is None:
            return
        rid = req.request_id
        if report.ok:
            self.kv_bytes_sent += report.num_bytes
            self.metrics.kv_transfer_bytes.inc(report.num_bytes)
        else:
            self.transfer_failures += 1
            self.metrics.kv_transfer_failures.inc()
            log.warning("transfer %s failed: %s", report.transfer_id, report.error)

        def release(e: LLMEngine) -> None:
            if not self._move(req, E.SENT):
                return
            e.release(rid)  # held for export since its first token, or since its step failed
            out = e.abort(rid)  # should it still be scheduled: never left held by nobody
            if out is not None:
                self.loop.dispatch([out])
        self.loop.submit(release)

    def shutdown(self) -> None:
        self.loop.stop()
        for req in list(self.requests.values()):  # the engine's blocks go with it
            self._move(req, E.SHUTDOWN)
        self.leave_transfer_group()
        if self.board is not None:
            self.loop.between_steps = None
            self.board.close()
