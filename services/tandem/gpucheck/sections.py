"""The device check's sections, in the order they run, and the runner that tabulates them.

A section is ``fn(ctx) -> list[Result]``; one that raises becomes a FAIL row
naming the error, and the next section still runs.
"""

from __future__ import annotations

import gc
import time
import traceback
from collections.abc import Callable

import torch

from tandem.gpucheck.context import CheckContext
from tandem.gpucheck.kernel_check import check_kernel, check_layer_ops
from tandem.gpucheck.parity_checks import check_bf16, check_fp32
from tandem.gpucheck.report import Result, Status
from tandem.gpucheck.sampling_check import check_sampling
from tandem.gpucheck.sizing_check import check_kv_sizing
from tandem.gpucheck.speed_checks import check_decode, check_floors, check_prefill
from tandem.gpucheck.stream_checks import check_streams
from tandem.gpucheck.transfer_checks import transfer_sections

Section = tuple[str, Callable[[CheckContext], list[Result]]]


def check_device(ctx: CheckContext) -> list[Result]:
    import triton

    if ctx.device.type == "cuda":
        props = torch.cuda.get_device_properties(ctx.device)
        what = f"{props.name}, {props.total_memory / 2**30:.0f} GiB, {props.multi_processor_count} SMs"
        status = Status.PASS
    else:
        what, status = "CPU (dry run; Triton interpreted)", Status.DRY
    return [Result("device", status, what, f"torch {torch.__version__}, triton {triton.__version__}")]


def sections() -> list[Section]:
    return [
        ("device", check_device),
        ("floors", check_floors),  # first: later sections read ctx.hbm_bytes_per_s, peak_flops
        ("kernel", check_kernel),
        ("layer ops", check_layer_ops),
        ("engine fp32", check_fp32),
        ("engine bf16", check_bf16),
        ("sampling", check_sampling),
        ("kv sizing", check_kv_sizing),
        *transfer_sections(),
        ("streams", check_streams),
        ("decode", check_decode),
        ("prefill", check_prefill),
    ]


def run(ctx: CheckContext, only: set[str] | None = None,
        log: Callable[[str], None] = print) -> list[Result]:
    results: list[Result] = []
    for name, fn in sections():
        if only and name not in only:
            continue
        log(f"[gpu-check] {name} ...")
        started = time.monotonic()
        try:
            rows = fn(ctx)
        except Exception as e:  # noqa: BLE001 - a crashed section is a FAIL row
            log(traceback.format_exc())
            first = (str(e).strip().splitlines() or [""])[0]
            rows = [Result(name, Status.FAIL, f"{type(e).__name__}: {first}"[:200])]
        for r in rows:
            log(f"[gpu-check]   {r.status} {r.section}: {r.result} {r.figure}")
        log(f"[gpu-check] {name}: {time.monotonic() - started:.1f} s")
        results.extend(rows)
        gc.collect()
        if ctx.device.type == "cuda":
            torch.cuda.empty_cache()
    return results
