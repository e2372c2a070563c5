"""A stand-in for ``tandem.bench.vllm_side`` where vLLM is not installed (CI).

Speaks the same protocol (``tandem.bench.side_protocol``). Its timings are fixed so
that a test can check the driver's arithmetic: every ``generate`` reports
``FAKE_VLLM_GENERATE_S`` seconds, and the ``ttft`` calls the comma-separated
``FAKE_VLLM_TTFT_S`` in turn. It prints on
stdout as engines do, which must not disturb the protocol. ``FAKE_VLLM_FAIL=load``
makes loading fail; ``FAKE_VLLM_FAIL=generate:N`` makes the N-th ``generate`` (from 1)
fail, as an engine dying mid-run would. ``FAKE_VLLM_SPIN_S=S`` keeps a core busy for S
seconds after each call, as vLLM's engine polls after a request.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import Any

from tandem.bench.side_protocol import serve

GENERATE_S = float(os.environ.get("FAKE_VLLM_GENERATE_S", "0.5"))
TTFT_S = [float(x) for x in os.environ.get("FAKE_VLLM_TTFT_S", "0.25").split(",")]
SPIN_S = float(os.environ.get("FAKE_VLLM_SPIN_S", "0"))


def _spin_after_reply() -> None:
    def spin() -> None:
        time.sleep(0.05)  # the reply is on its way first
        end = time.monotonic() + SPIN_S
        while time.monotonic() < end:
            pass

    if SPIN_S > 0:
        threading.Thread(target=spin, daemon=True).start()


class FakeBackend:
    """Output ids from the prompt's last id; no model."""

    def __init__(self) -> None:
        self.generated = 0
        self.ttfts = 0

    def generate(self, prompts: list[list[int]], output_len: int) -> tuple[float, list[list[int]]]:
        print("fake vllm: generating")  # stray engine output goes to stderr, not the protocol
        self.generated += 1
        if os.environ.get("FAKE_VLLM_FAIL") == f"generate:{self.generated}":
            raise RuntimeError("fake vllm engine died")
        _spin_after_reply()
        return GENERATE_S, [[(p[-1] + i) % 50 for i in range(output_len)] for p in prompts]

    def ttft(self, prompt: list[int]) -> float:
        assert len(prompt) > 0
        _spin_after_reply()
        self.ttfts += 1
        return TTFT_S[(self.ttfts - 1) % len(TTFT_S)]


def load(**req: Any) -> tuple[FakeBackend, dict[str, Any]]:
    print("fake vllm: loading", req["model"])
    if os.environ.get("FAKE_VLLM_FAIL") == "load":
        raise RuntimeError("fake vllm cannot load this model")
    env = {k: os.environ.get(k) for k in ("VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_KVCACHE_SPACE",
                                          "OMP_NUM_THREADS")}
    return FakeBackend(), {"engine": "fake-vllm 0.0", "request": req, "env": env}


if __name__ == "__main__":
    sys.exit(serve(load))
