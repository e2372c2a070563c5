"""Freed activations stay with the process: the next step writes into pages it already has."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# In a fresh interpreter, so this process's allocator settings stay as they were.
PROBE = """
import resource, torch
from tandem.engine import host_memory

mallopt = host_memory._glibc_mallopt()
if mallopt is None:
    print("no-glibc"); raise SystemExit(0)

def faults(blocks=8):  # page faults while a step's worth of 16 MiB activations come and go
    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(blocks):
        x = torch.empty(4 * 2**20)
        x.fill_(1.0)
        del x
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0

# glibc's thresholds low, as its run-time adaptation can leave them: every block is mapped afresh
mallopt(host_memory.M_MMAP_THRESHOLD, 128 * 1024)
mallopt(host_memory.M_TRIM_THRESHOLD, 128 * 1024)
before = faults()
kept = host_memory.keep_freed_memory(64 * 2**20)
faults(32)  # the heap grows to the blocks' steady state once (where glibc places them varies)
after = faults()
smaller = host_memory.keep_freed_memory(1)  # a later, smaller engine does not lower it
print(kept, before, after, smaller, host_memory._kept)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_freed_activations_are_reused_without_page_faults():
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120,
                         cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr
    words = out.stdout.split()
    if words == ["no-glibc"]:
        pytest.skip("not glibc")
    kept, before, after, smaller, threshold = words
    assert kept == "True" and smaller == "True"
    assert int(before) >= 8 * 8  # at least one fault per 2 MiB of each block, huge pages or not
    assert int(after) * 10 < int(before)
    assert int(threshold) == 64 * 2**20


ENGINE_PROBE = """
import sys
from tandem.common.config import EngineConfig
from tandem.engine import host_memory
from tandem.engine.engine import LLMEngine
from tandem.engine.kv_cache.sizing import working_memory_bytes

engine = LLMEngine(EngineConfig(model=sys.argv[1], device="cpu", num_threads=1))
sc = engine.config.scheduler
working = working_memory_bytes(engine.model_config, sc.max_num_batched_tokens, sc.max_num_seqs, engine.dtype)
print(host_memory._kept, working)
"""


def test_a_cpu_engine_keeps_its_working_memory_for_the_next_step(tiny_model_dir):
    from tandem.engine import host_memory

    if host_memory._glibc_mallopt() is None:
        pytest.skip("glibc's malloc")
    out = subprocess.run([sys.executable, "-c", ENGINE_PROBE, str(tiny_model_dir)], capture_output=True,
                         text=True, timeout=300, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr
    kept, working = (int(w) for w in out.stdout.split()[-2:])
    assert kept == min(max(working, host_memory.MMAP_THRESHOLD_MAX), 2**31 - 1)
