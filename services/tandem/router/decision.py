"""The outcome of routing one request."""

from __future__ import annotations

from dataclasses import dataclass

from tandem.router.load import WorkerHandle

REMOTE = "remote"  # prefilled on a prefill worker, KV pushed to the decode worker
LOCAL_SHORT_PROMPT = "local_short_prompt"  # conditional: prompt under the threshold
LOCAL_PREFILL_SATURATED = "local_prefill_saturated"  # conditional: prefill pool saturated
LOCAL_PREFILL_UNAVAILABLE = "local_prefill_unavailable"  # no prefill worker alive
COLOCATED = "colocated"  # colocated mode: one worker does both phases
LOCAL_RESUME = "local_resume"  # a started stream re-driven: prompt + tokens so far, on decode
REASONS = (REMOTE, LOCAL_SHORT_PROMPT, LOCAL_PREFILL_SATURATED, LOCAL_PREFILL_UNAVAILABLE,
           COLOCATED, LOCAL_RESUME)


@dataclass(frozen=True)
class RouteDecision:
    """Where one request runs.

    ``prefill`` of ``None`` means the decode worker prefills locally.
    ``prefix_hit_blocks`` counts the leading prompt blocks the router expects
    the prefilling worker to hold already. ``attempt`` is 0 for ``route`` and
    counts up with each ``retry``.
    """

    request_id: str
    decode: WorkerHandle
    prefill: WorkerHandle | None
    reason: str
    prefix_hit_blocks: int
    attempt: int = 0

    @property
    def local_prefill(self) -> bool:
        """Whether the decode worker prefills the prompt itself."""
        return self.prefill is None
