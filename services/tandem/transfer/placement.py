"""Which transport each pair of the transfer group uses, from where its two ends run.

Prefill-decode pairs carry a prompt's KV; decode-decode pairs (``migration``) carry a
running request's KV when it moves to another decode worker.

NCCL refuses two ranks on one GPU ("Duplicate GPU detected"), and a pair on one
GPU needs no network: such a pair goes over CUDA IPC (``ipc_channel.py``). The
choice is made from each worker's device UUID (the same physical GPU, whatever
index each process sees it under):

* ``gloo`` (or ``auto`` on CPU): gloo for every pair;
* ``auto`` on CUDA: ``ipc`` where both ends share a device, ``nccl`` elsewhere;
* ``nccl``: NCCL for every pair; two ends on one device is an error that says how
  to fix it, before anything hangs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

GLOO, NCCL, IPC = "gloo", "nccl", "ipc"


def pair_transports(backend: str, cuda: bool, device_uuids: Mapping[int, str | None],
                    prefill_ranks: Sequence[int], decode_ranks: Sequence[int],
                    names: Mapping[int, str] | None = None,
                    migration: bool = False) -> dict[int, dict[int, str]]:
    """``{rank: {peer: transport}}`` for every prefill-decode pair, and with ``migration``
    every decode-decode pair.

    ``device_uuids``: each rank's GPU UUID (None on CPU); ``names``: worker ids for
    error messages.
    """
    if backend not in ("auto", GLOO, NCCL):
        raise ValueError(f"unknown transfer backend {backend!r} (auto, gloo or nccl)")
    names = names or {}
    out: dict[int, dict[int, str]] = {r: {} for r in (*prefill_ranks, *decode_ranks)}
    for p in prefill_ranks:
        for d in decode_ranks:
            kind = _pair(backend, cuda, device_uuids.get(p), device_uuids.get(d),
                         names.get(p, f"rank {p}"), names.get(d, f"rank {d}"))
            out[p][d] = out[d][p] = kind
    if migration:
        for i, a in enumerate(decode_ranks):
            for b in decode_ranks[i + 1:]:
                out[a][b] = out[b][a] = _pair(backend, cuda, device_uuids.get(a),
                                              device_uuids.get(b), names.get(a, f"rank {a}"),
                                              names.get(b, f"rank {b}"))
    return out


def _pair(backend: str, cuda: bool, a: str | None, b: str | None, name_a: str,
          name_b: str) -> str:
    if backend == GLOO or (backend == "auto" and not cuda):
        return GLOO
    if a is None or b is None:
        raise ValueError(f"{name_a} or {name_b} has no CUDA device for the {backend} transfer "
                         "backend (does each worker get a GPU? --gpus-per-worker)")
    if a != b:
        return NCCL
    if backend == NCCL:
        raise ValueError(
            f"{name_a} and {name_b} run on the same GPU ({a}): NCCL refuses two ranks on one "
            "GPU. Give each worker its own GPU (--gpus-per-worker 1) or use "
            "--transfer-backend auto (same-GPU pairs then use CUDA IPC)")
    return IPC
