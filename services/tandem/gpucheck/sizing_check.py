"""KV cache sizing on the device: an engine started alone in a fresh process.

The engine sizes its cache from the device's free memory at start
(``kv_cache.sizing``): ``--gpu-memory-utilization`` of the device for what its
process holds in torch's allocator (weights, KV, a step's working memory). The
check starts one in a child process and judges what the device's use grew by
from before the engine to after it started and prefilled a long prompt. The
check's own process stays on the device meanwhile: its earlier sections leave
memory outside torch's allocator (GiBs of it) that no worker would hold.
``python -m tandem.gpucheck.sizing_check CHECKPOINT DTYPE ATTENTION``
prints the child's figures as one JSON line.
"""

from __future__ import annotations

import json
import subprocess
import sys

from tandem.gpucheck.checkpoints import speed_checkpoint
from tandem.gpucheck.context import CheckContext
from tandem.gpucheck.report import Result, Status

SLACK = 0.02  # of the device, above --gpu-memory-utilization
PROMPT_TOKENS = 3000  # one prompt prefilled after start: its working memory must fit too


def probe(path: str, dtype: str, attention: str) -> dict[str, float]:
    """Start an engine on ``cuda:0``, prefill one long prompt; the device's use at each point."""
    import torch

    from tandem.engine import SamplingParams
    from tandem.engine.llm import LLM

    dev = torch.device("cuda:0")
    free, total = torch.cuda.mem_get_info(dev)
    before = (total - free) / total
    eng = LLM(path, device=str(dev), dtype=dtype, attention_backend=attention, max_num_seqs=8,
              cuda_graphs=False).engine
    free, _ = torch.cuda.mem_get_info(dev)
    started = (total - free) / total
    eng.add_request("probe", list(range(3, 3 + PROMPT_TOKENS)),
                    SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    while eng.has_unfinished():
        eng.step()
    free, _ = torch.cuda.mem_get_info(dev)
    return {"before": before, "started": started, "after_prompt": (total - free) / total,
            "kv_gib": eng.kv_cache.kv.numel() * eng.kv_cache.kv.element_size() / 2 ** 30,
            "utilization": eng.config.cache.gpu_memory_utilization}


def check_kv_sizing(ctx: CheckContext) -> list[Result]:
    section = "kv cache sizing"
    if ctx.device.type != "cuda":
        return [Result(section, Status.SKIP, "sized from free memory on CUDA only")]
    args = [str(speed_checkpoint(ctx)), ctx.speed_dtype, ctx.attention]
    proc = subprocess.run([sys.executable, "-m", __name__, *args], capture_output=True,
                          text=True, timeout=300)
    if proc.returncode != 0:
        return [Result(section, Status.FAIL, f"probe exited {proc.returncode}: "
                       f"{proc.stderr.strip()[-160:]}")]
    m = json.loads(proc.stdout.strip().splitlines()[-1])
    util = m["utilization"]
    started, prompted = m["started"] - m["before"], m["after_prompt"] - m["before"]
    ok = m["kv_gib"] > 1 and max(started, prompted) <= util + SLACK
    return [Result(section, Status.PASS if ok else Status.FAIL,
                   f"default --gpu-memory-utilization {util}: the engine's process took "
                   f"{started:.1%} of the device at start, {prompted:.1%} after a "
                   f"{PROMPT_TOKENS:,}-token prompt (device {m['after_prompt']:.1%} used)",
                   f"KV {m['kv_gib']:.1f} GiB", f"<= {util + SLACK:.0%}, KV > 1 GiB")]


if __name__ == "__main__":
    print(json.dumps(probe(*sys.argv[1:4])), flush=True)
