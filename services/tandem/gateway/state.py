"""What every endpoint of one gateway app shares: the backend, the tokenizer, the limits."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry

from tandem.common.metrics import GatewayMetrics, gateway_metrics
from typing import Any

from tandem.gateway.backend import Backend
from tandem.gateway.errors import APIError
from tandem.gateway.logprobs import TokenStrings
from tandem.text.tokenizer import Tokenizer


@dataclass
class GatewayState:
    """Configuration and shared objects of one app (``app.state.gateway``)."""

    backend: Backend
    tokenizer: Tokenizer
    request_timeout_s: float | None
    max_n: int
    max_prompts: int
    ready_timeout_s: float
    metrics_registry: CollectorRegistry = field(default_factory=CollectorRegistry)
    metrics: GatewayMetrics = field(init=False)
    created: int = field(default_factory=lambda: int(time.time()))
    draining: bool = False  # set on SIGINT/SIGTERM: /ready answers 503 while requests drain
    strings: TokenStrings = field(init=False)

    def __post_init__(self) -> None:
        self.metrics = gateway_metrics(self.metrics_registry)
        self.strings = TokenStrings(self.tokenizer)

    def check_model(self, model: str) -> None:
        """404 unless ``model`` is the served one."""
        if model != self.backend.model_id:
            raise APIError(404, f"the model {model!r} does not exist; this server serves "
                           f"{self.backend.model_id!r}", param="model", code="model_not_found")

    def model_card(self) -> dict[str, Any]:
        """The served model as ``/v1/models`` lists it."""
        return {"id": self.backend.model_id, "object": "model", "created": self.created, "owned_by": "tandem",
                "max_model_len": self.backend.max_model_len}

    @staticmethod
    def created_now() -> int:
        """Unix seconds, for a response's ``created``."""
        return int(time.time())

    @staticmethod
    def new_id(prefix: str) -> str:
        """A fresh response id such as ``cmpl-3f2a...``."""
        return f"{prefix}-{uuid.uuid4().hex}"


def mark_draining(app: Any) -> None:
    """Tell the app behind a server that it is shutting down (no-op for other apps)."""
    state = getattr(getattr(app, "state", None), "gateway", None)
    if isinstance(state, GatewayState):
        state.draining = True
