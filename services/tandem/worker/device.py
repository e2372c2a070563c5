"""Which GPU a worker actor runs on, and how to recognise that GPU from another process.

Inside a Ray actor, ``cuda`` means the GPU Ray assigned to it. Ray normally
narrows ``CUDA_VISIBLE_DEVICES`` to the assigned GPUs (then it is ``cuda:0``);
with ``RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES`` it leaves the variable as
the node had it (the GPUs the node was started with, or unset: all of them),
and the assigned GPU's index is its position in that list (or its id, when
unset). ``cuda:N`` names the N-th GPU assigned to the worker; without GPUs from
Ray (``--gpus-per-worker 0``) the configured device stands.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch


def resolve_device(configured: str, gpu_ids: Sequence[str | int],
                   visible: str | None) -> str:
    """The ``cuda:N`` (or ``cpu``) a worker uses, from the configured device, the GPU ids
    Ray assigned (``ray.get_gpu_ids()``) and ``CUDA_VISIBLE_DEVICES`` (None: unset).

    Without assigned GPUs the configured device stands (as ``cuda:N``). Raises
    ``ValueError`` when the configured index or an assigned id cannot be found.
    """
    if configured == "cpu":
        return "cpu"
    _, _, index_text = configured.partition(":")
    index = int(index_text or 0)
    if not gpu_ids:
        return f"cuda:{index}"
    if index >= len(gpu_ids):
        raise ValueError(f"device {configured!r}: the worker was assigned {len(gpu_ids)} GPU(s) "
                         f"({', '.join(map(str, gpu_ids))})")
    gpu = str(gpu_ids[index]).strip()
    if visible is None:
        if not gpu.isdigit():
            raise ValueError(f"assigned GPU {gpu!r} is not an index and CUDA_VISIBLE_DEVICES "
                             "is unset")
        return f"cuda:{gpu}"
    listed = [v.strip() for v in visible.split(",") if v.strip()]
    if gpu not in listed:
        raise ValueError(f"assigned GPU {gpu!r} is not among CUDA_VISIBLE_DEVICES={visible!r}")
    return f"cuda:{listed.index(gpu)}"


def actor_device(configured: str) -> str:
    """``resolve_device`` for this process (a Ray actor, or a plain process without Ray)."""
    gpu_ids: list = []
    if configured != "cpu":
        import ray

        if ray.is_initialized():
            gpu_ids = list(ray.get_gpu_ids())
    return resolve_device(configured, gpu_ids, os.environ.get("CUDA_VISIBLE_DEVICES"))


def device_uuid(device: torch.device) -> str | None:
    """The physical GPU's UUID (the same in every process, whatever its index); None on CPU."""
    if device.type != "cuda":
        return None
    return str(torch.cuda.get_device_properties(device).uuid)
