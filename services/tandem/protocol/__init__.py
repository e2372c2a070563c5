"""Layer 1: wire messages between gateway, router and workers (services/ARCHITECTURE.md, "Layers" and "KV protocol").

- ``messages``: the KV transfer protocol (compatibility descriptor, transfer
  descriptor, per-payload header, status, result), serialized through the code
  generated from ``protos/`` into ``gen/`` (regenerate with ``protos/check.sh --write``).
- ``request_path``: plain frozen dataclasses on the request path
  (``PrefillRequest``, ``PrefillResult``, ``DecodeRequest``, ``TokenDelta``).

Imports only ``tandem.common``, the standard library and ``google.protobuf``.
"""

from __future__ import annotations

from tandem.protocol.messages import (
    CompatibilityDescriptor,
    IncompatibleKVError,
    KVTransferDescriptor,
    LayerRange,
    ProtocolError,
    TransferStatus,
    layer_groups,
    payload_checksum,
)
from tandem.protocol.payload import (
    HEADER_BYTES,
    MAX_HEADER_PAYLOAD,
    LayerGroupHeader,
    TransferResult,
    decode_header,
    encode_header,
)
from tandem.protocol.request_path import (
    DecodeRequest,
    PrefillRequest,
    PrefillResult,
    TokenDelta,
    TokenLogprob,
)

__all__ = [
    "HEADER_BYTES",
    "MAX_HEADER_PAYLOAD",
    "CompatibilityDescriptor",
    "DecodeRequest",
    "IncompatibleKVError",
    "KVTransferDescriptor",
    "LayerGroupHeader",
    "LayerRange",
    "PrefillRequest",
    "PrefillResult",
    "ProtocolError",
    "TokenDelta",
    "TokenLogprob",
    "TransferResult",
    "TransferStatus",
    "decode_header",
    "encode_header",
    "layer_groups",
    "payload_checksum",
]
