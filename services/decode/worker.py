"""The decode worker: an engine in the decode role plus the receiving end of KV transfer.

It reserves a prompt's blocks before the prefill starts, receives the KV into
them, joins the request to its continuous batch once the transfer is done and
token #1 is known, and streams the following tokens. It can also prefill
locally (conditional disaggregation, re-drive after a failure).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Sequence

from services.common.config import EngineConfig
from services.common.sampling_params import SamplingParams
from services.engine.engine import EngineOutput
from services.protocol.messages import (KVTransferDescriptor,
                                        TransferStatus, layer_groups)
from services.protocol.request_path import DecodeRequest, TokenDelta, TokenLogprob
from services.transfer.endpoint import make_receiver, open_channel
from services.transfer.receiver import KVReceiver
from services.transfer.worker_base import EngineWorker

log = logging.getLogger(__name__)


class TransferFailedError(RuntimeError):
    """The KV of a request did not arrive (dead prefill worker, timeout, checksum)."""


class DecodeWorker(EngineWorker):
    """Wrap with ``ray.remote`` (async actor); one engine, one receiver."""

    def __init__(self, worker_id: str, config: EngineConfig, transfer_timeout_s: float = 30.0,
                 role: str = "decode") -> None:
        super().__init__(worker_id, config, role)
        self.receiver = None
        self.rank: int | None = None
        self.transfer_timeout_s = transfer_timeout_s
        self._transfers: dict[str, tuple[str, KVReceiver]] = {}  # request -> (transfer, receiver)
        self.kv_bytes_received = 0

    def join_transfer_group(self, backend: str, world_size: int, rank: int, group_name: str,
                            prefill_ranks: Sequence[int], timeout_ms: int = 30_000) -> int:
        channel = open_channel(backend, world_size, rank, group_name, timeout_ms)
        self.receiver = make_receiver(channel, self.engine, prefill_ranks)
        self.rank = rank
        return rank

    def leave_transfer_group(self) -> None:
        """Leave the group; transfers still in flight fail (and their requests are re-driven)."""
        if self.receiver is not None:
            receiver, self.receiver = self.receiver, None
            receiver.channel.close()

    def counters(self) -> dict:
        return {"kv_bytes_received": self.kv_bytes_received}

    # -- remote prefill: reserve, receive, decode -------------------------------
    async def reserve(self, request_id: str, prompt_token_ids: Sequence[int],
                      params: SamplingParams, src_rank: int, transfer_id: str,
                      layer_group_size: int | None = None, checksum: bool = False
                      ) -> KVTransferDescriptor | None:
        """Take blocks for the prompt and expect its KV from ``src_rank``; None when full."""
        receiver = self.receiver
        if receiver is None:
            raise TransferFailedError(f"decode worker {self.worker_id} is not in a transfer group")
        blocks = await self._run(lambda e: e.reserve(request_id, prompt_token_ids, params))
        if blocks is None:
            return None
        groups = layer_groups(self.engine.model_config.num_layers, layer_group_size)
        try:
            receiver.expect(transfer_id, src_rank, blocks, [g.layers for g in groups])
        except Exception as e:
            await self._run(lambda e: e.cancel_reserved(request_id))
            raise TransferFailedError(f"{request_id}: {e}") from e
        self._transfers[request_id] = (transfer_id, receiver)
        return KVTransferDescriptor(
            request_id=request_id, transfer_id=transfer_id, block_ids=tuple(blocks),
            layer_groups=groups, src_rank=src_rank, dst_rank=self.rank,
            num_prompt_tokens=len(prompt_token_ids), checksum=checksum)

    async def cancel(self, request_id: str) -> None:
        """Give up a reservation: stop writes into its blocks, then free them."""
        entry = self._transfers.pop(request_id, None)
        if entry is not None:
            tid, receiver = entry
            await asyncio.to_thread(receiver.abort, tid)  # returns once no write is in flight
            receiver.forget(tid)
        await self._run(lambda e: e.cancel_reserved(request_id))

    async def decode(self, req: DecodeRequest) -> AsyncIterator[TokenDelta]:
        """Stream the tokens after ``req.output_token_ids`` (a Ray streaming generator).

        With a descriptor, waits for the KV (bounded) and resumes at token 2;
        without, prefills prompt + tokens so far locally.
        """
        rid = req.request_id
        done = False
        aio = asyncio.get_running_loop()
        queue: asyncio.Queue[EngineOutput] = asyncio.Queue()
        self.loop.open_stream(rid, lambda out: aio.call_soon_threadsafe(queue.put_nowait, out))
        try:
            if req.descriptor is not None:
                await self._await_transfer(req)
                first = await self._run(lambda e: e.commit_imported(rid, req.output_token_ids[0]))
                start = 1
                if first.finished:
                    done = True
                    yield self._delta(rid, [first], start, include_tokens=False)
                    return
            else:
                start = len(req.output_token_ids)  # a re-drive continues the same output
                await self._run(lambda e: e.add_request(rid, req.prompt_token_ids, req.sampling_params,
                                                        output_token_ids=req.output_token_ids))
            index = start
            while not done:
                outs = [await queue.get()]
                while not queue.empty():
                    outs.append(queue.get_nowait())
                delta = self._delta(rid, outs, index)
                index = delta.next_index
                done = delta.finished
                yield delta
        finally:
            self.loop.close_stream(rid)
            if not done:
                self.loop.submit(lambda e: e.abort(rid))

    async def abort(self, request_id: str) -> None:
        """Stop a request wherever it is; a stream waiting on it ends with ``abort``."""
        if request_id in self._transfers:
            await self.cancel(request_id)
        out = await self._run(lambda e: e.abort(request_id))
        if out is not None:
            self.loop.dispatch([out])

    async def _await_transfer(self, req: DecodeRequest) -> None:
        entry = self._transfers.pop(req.request_id, None)
        if entry is None:
            raise TransferFailedError(f"{req.request_id}: no reservation on {self.worker_id}")
        tid, receiver = entry
        pt = await asyncio.to_thread(receiver.wait, tid, self.transfer_timeout_s)
        receiver.forget(tid)
        if pt.status != TransferStatus.DONE:
            self.transfer_failures += 1
            self.metrics.kv_transfer_failures.inc()
            await self._run(lambda e: e.cancel_reserved(req.request_id))
            raise TransferFailedError(f"{req.request_id}: KV transfer {pt.status.name}: {pt.error}")
        self.kv_bytes_received += pt.num_bytes
        self.metrics.kv_transfer_bytes.inc(pt.num_bytes)
        self.metrics.kv_transfer_time.observe(pt.seconds)

    @staticmethod
    def _delta(rid: str, outs: list[EngineOutput], index: int,
               include_tokens: bool = True) -> TokenDelta:
        tokens = [t for o in outs for t in o.new_token_ids] if include_tokens else []
        last = outs[-1]
        lps = [lp for o in outs for lp in o.new_logprobs]
        return TokenDelta(
            request_id=rid, token_ids=tuple(tokens), index=index, finished=last.finished,
            finish_reason=last.finish_reason if last.finished else None,
            logprobs=tuple(TokenLogprob.of(lp) for lp in lps) if lps and include_tokens else None)

    async def _run(self, fn):
        return await asyncio.wrap_future(self.loop.submit(fn))

    def shutdown(self) -> None:
        self.loop.stop()
        self.leave_transfer_group()

