"""tandem: disaggregated prefill/decode LLM serving on Ray.

``from tandem import LLM, SamplingParams`` is the offline engine's API; ``tandem serve`` (the
CLI, ``tandem.cli``) runs the cluster. The layers are described in services/ARCHITECTURE.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tandem import engine
from tandem.engine import FinishReason, SamplingParams, __all__

if TYPE_CHECKING:
    from tandem.engine.llm import LLM, CompletionOutput, RequestOutput


def __getattr__(name: str):
    return getattr(engine, name)  # lazily, as tandem.engine: SamplingParams without torch
