"""Request placement: decode worker first, then prefill worker (services/ARCHITECTURE.md,
"The request's path" and "Layers").

Pure Python, no I/O: written against the :class:`WorkerHandle` protocol, which
the cluster layer implements over Ray actor handles and tests implement with fakes.
"""

from __future__ import annotations

from tandem.router.config import COLOCATED, CONDITIONAL, DISAGGREGATED, MODES, RouterConfig
from tandem.router.decision import (LOCAL_PREFILL_SATURATED, LOCAL_PREFILL_UNAVAILABLE,
                                      LOCAL_SHORT_PROMPT, REASONS, REMOTE, RouteDecision)
from tandem.router.errors import (ClusterFullError, NoWorkersError, PromptTooLargeError,
                                    RouterError)
from tandem.router.router import Router
from tandem.router.load import BOTH, DECODE, PREFILL, ROLES, WorkerHandle, WorkerLoad

__all__ = [
    "BOTH", "COLOCATED", "CONDITIONAL", "DECODE", "DISAGGREGATED", "LOCAL_PREFILL_SATURATED",
    "LOCAL_PREFILL_UNAVAILABLE", "LOCAL_SHORT_PROMPT", "MODES", "PREFILL", "REASONS", "REMOTE",
    "ROLES", "ClusterFullError", "NoWorkersError", "PromptTooLargeError", "RouteDecision",
    "Router", "RouterConfig", "RouterError", "WorkerHandle", "WorkerLoad",
]
