"""tandem's offline ``LLM`` as a benchmark side (see ``side_protocol``), vLLM's twin."""

from __future__ import annotations

import sys
from typing import Any

from tandem.bench.side_protocol import TimedBackend, serve
from tandem.common.config import EngineConfig


class TandemBackend(TimedBackend):
    """``tandem.engine.LLM`` over a model folder; EOS ignored, prompts as token ids, every
    request sampled alike (greedy by default)."""

    def __init__(self, model: str, threads: int, max_model_len: int, max_num_batched_tokens: int,
                 seed: int, onednn: bool = True, cpu_kernels: bool = True,
                 dtype: str = "float32", weight_layout: str = EngineConfig.cpu_weight_layout,
                 temperature: float = 0.0, top_p: float = 1.0) -> None:
        import torch

        from tandem.engine import LLM

        torch.set_num_threads(threads)
        self.llm = LLM(model, num_threads=threads, seed=seed, max_model_len=max_model_len,
                       max_num_batched_tokens=max_num_batched_tokens, enable_prefix_caching=False,
                       onednn=onednn, cpu_kernels=cpu_kernels, dtype=dtype,
                       cpu_weight_layout=weight_layout)
        self.sampling = dict(temperature=temperature, top_p=top_p)

    def _generate(self, prompts: list[list[int]], output_len: int) -> list[list[int]]:
        from tandem.engine import SamplingParams

        params = SamplingParams(max_tokens=output_len, ignore_eos=True, **self.sampling)
        outs = self.llm.generate(prompts, params)
        return [list(o.outputs[0].token_ids) for o in outs]


def load(**req: Any) -> tuple[TandemBackend, dict[str, Any]]:
    """Build the backend for a ``load`` request (``onednn`` / ``cpu_kernels`` /
    ``weight_layout`` / ``temperature`` / ``top_p`` optional)."""
    import torch

    from tandem.engine import gc_freeze

    backend = TandemBackend(req["model"], int(req["threads"]), int(req["max_model_len"]),
                            int(req["max_num_batched_tokens"]), int(req["seed"]),
                            onednn=bool(req.get("onednn", True)),
                            cpu_kernels=bool(req.get("cpu_kernels", True)),
                            dtype=str(req.get("dtype", "float32")),
                            weight_layout=str(req.get("weight_layout", EngineConfig.cpu_weight_layout)),
                            temperature=float(req.get("temperature", 0.0)),
                            top_p=float(req.get("top_p", 1.0)))
    gc_freeze.freeze()  # a side process holds its engine to the end (as vLLM's engine core freezes its heap)
    return backend, {"engine": "tandem", "torch": torch.__version__}


if __name__ == "__main__":
    sys.exit(serve(load))
