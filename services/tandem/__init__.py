"""tandem: disaggregated prefill/decode LLM serving on Ray.

``from tandem import LLM, SamplingParams`` is the offline engine's API; ``tandem serve`` (the
CLI, ``tandem.cli``) runs the cluster. The layers are described in services/ARCHITECTURE.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tandem.common.sampling_params import FinishReason, SamplingParams

if TYPE_CHECKING:
    from tandem.engine.llm import LLM, CompletionOutput, RequestOutput

__all__ = ["LLM", "SamplingParams", "FinishReason", "CompletionOutput", "RequestOutput"]


def __getattr__(name: str):
    # Lazy: importing the package for SamplingParams must not pull in torch.
    if name in ("LLM", "CompletionOutput", "RequestOutput"):
        from tandem.engine import llm
        return getattr(llm, name)
    raise AttributeError(name)
