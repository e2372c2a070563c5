"""The header sent ahead of each layer-group payload, and a transfer's result.

The transport sends a :class:`LayerGroupHeader` ahead of each layer-group
payload as a fixed-size uint8 buffer: :func:`encode_header` /
:func:`decode_header` give it a constant size (:data:`HEADER_BYTES`) so the
receiver can post its receive before it knows anything about the message.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

from tandem.protocol.gen.tandem.v1 import kv_transfer_pb2 as pb
from tandem.protocol.messages import (_INT64_MAX, _UINT32_MAX, _UINT64_MAX, ProtocolError,
                                        TransferStatus, _check_int, _check_str, _from_proto_checked,
                                        _parse)

__all__ = ["HEADER_BYTES", "MAX_HEADER_PAYLOAD", "LayerGroupHeader", "TransferResult",
           "decode_header", "encode_header"]


# --------------------------------------------------------------------------- per-payload header

@dataclass(frozen=True)
class LayerGroupHeader:
    """Sent ahead of each layer-group payload: the receiver keys it by
    ``(transfer_id, layer_group)``, never by arrival order alone.

    ``num_bytes`` is the size of the payload that follows (0: none follows).
    ``checksum`` is present only when the descriptor asked for it.
    ``aborted`` tells the receiver that the sender gave up on this transfer.
    ``segments``: empty for one gathered payload; else the zero-copy layout, one
    message per (layer, K|V, run of this many blocks) — see the proto.
    """

    transfer_id: str
    layer_group: int
    num_bytes: int
    checksum: int | None = None
    final: bool = False
    aborted: bool = False
    segments: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.segments, tuple):
            raise ValueError(f"segments must be a tuple, got {type(self.segments).__name__}")
        for n in self.segments:
            _check_int("segment", n, 1, _UINT32_MAX)
        _check_str("transfer_id", self.transfer_id)
        _check_int("layer_group", self.layer_group, 0, _UINT32_MAX)
        _check_int("num_bytes", self.num_bytes, 0, _UINT64_MAX)
        if self.checksum is not None:
            _check_int("checksum", self.checksum, 0, _UINT64_MAX)
        for name in ("final", "aborted"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.aborted and self.num_bytes:
            raise ValueError("an aborted header carries no payload (num_bytes must be 0)")

    @property
    def key(self) -> tuple[str, int]:
        return (self.transfer_id, self.layer_group)

    def to_proto(self) -> pb.LayerGroupHeader:
        msg = pb.LayerGroupHeader(transfer_id=self.transfer_id, layer_group=self.layer_group,
                                  num_bytes=self.num_bytes, final=self.final,
                                  aborted=self.aborted, segments=self.segments)
        if self.checksum is not None:
            msg.checksum = self.checksum
        return msg

    @classmethod
    def from_proto(cls, msg: pb.LayerGroupHeader) -> LayerGroupHeader:
        return _from_proto_checked(lambda m: cls(
            transfer_id=m.transfer_id, layer_group=m.layer_group, num_bytes=m.num_bytes,
            checksum=m.checksum if m.HasField("checksum") else None, final=m.final,
            aborted=m.aborted, segments=tuple(m.segments)), msg, "LayerGroupHeader")

    def to_bytes(self) -> bytes:
        return self.to_proto().SerializeToString(deterministic=True)

    @classmethod
    def from_bytes(cls, data: bytes | bytearray | memoryview) -> LayerGroupHeader:
        return cls.from_proto(_parse(pb.LayerGroupHeader, data, "LayerGroupHeader"))


# Fixed-size framing: magic (4 bytes) + payload length (uint16, little endian) + payload + zeros.
HEADER_BYTES = 256
_HEADER_MAGIC = b"TKV1"
_HEADER_PREFIX = struct.Struct("<4sH")
MAX_HEADER_PAYLOAD = HEADER_BYTES - _HEADER_PREFIX.size


def encode_header(header: LayerGroupHeader) -> bytes:
    """``header`` as exactly :data:`HEADER_BYTES` bytes (the transport's uint8 header tensor).

    Raises ``ValueError`` when the encoded header does not fit (a very long transfer id).
    """
    if not isinstance(header, LayerGroupHeader):
        raise TypeError(f"expected a LayerGroupHeader, got {type(header).__name__}")
    body = header.to_bytes()
    if len(body) > MAX_HEADER_PAYLOAD:
        raise ValueError(f"encoded LayerGroupHeader is {len(body)} bytes, more than the "
                         f"{MAX_HEADER_PAYLOAD} that fit in a {HEADER_BYTES}-byte header "
                         f"(transfer_id of {len(header.transfer_id)} characters?)")
    out = bytearray(HEADER_BYTES)
    _HEADER_PREFIX.pack_into(out, 0, _HEADER_MAGIC, len(body))
    out[_HEADER_PREFIX.size:_HEADER_PREFIX.size + len(body)] = body
    return bytes(out)


def decode_header(buf: bytes | bytearray | memoryview | Any) -> LayerGroupHeader:
    """Inverse of :func:`encode_header`; ``buf`` is anything with the buffer protocol
    (bytes, a numpy uint8 array, ``tensor.numpy()``) of exactly :data:`HEADER_BYTES` bytes."""
    try:
        view = memoryview(buf).cast("B")
    except TypeError as e:
        raise ProtocolError(f"a header must be a byte buffer, got {type(buf).__name__}") from e
    if view.nbytes != HEADER_BYTES:
        raise ProtocolError(f"a header is {HEADER_BYTES} bytes, got {view.nbytes}")
    magic, length = _HEADER_PREFIX.unpack_from(view, 0)
    if magic != _HEADER_MAGIC:
        raise ProtocolError(f"not a LayerGroupHeader (magic {bytes(magic)!r}, "
                            f"expected {_HEADER_MAGIC!r}): is the stream out of step?")
    if length > MAX_HEADER_PAYLOAD:
        raise ProtocolError(f"header length {length} exceeds {MAX_HEADER_PAYLOAD}")
    start = _HEADER_PREFIX.size
    return LayerGroupHeader.from_bytes(view[start:start + length])


# --------------------------------------------------------------------------- result

@dataclass(frozen=True)
class TransferResult:
    """Outcome of one transfer; ``error`` is ``None`` on success."""

    transfer_id: str
    status: TransferStatus
    error: str | None = None
    num_bytes: int = 0
    seconds: float = 0.0

    def __post_init__(self) -> None:
        _check_str("transfer_id", self.transfer_id)
        if not isinstance(self.status, TransferStatus):
            raise ValueError(f"status must be a TransferStatus, got {self.status!r}")
        if self.error is not None:
            _check_str("error", self.error, allow_empty=True)
        _check_int("num_bytes", self.num_bytes, 0, _INT64_MAX)
        if isinstance(self.seconds, bool) or not isinstance(self.seconds, (int, float)) \
                or self.seconds < 0:
            raise ValueError(f"seconds must be a number >= 0, got {self.seconds!r}")

    @property
    def ok(self) -> bool:
        return self.status is TransferStatus.DONE

    @property
    def bandwidth(self) -> float | None:
        """Bytes per second, or ``None`` without a duration."""
        return self.num_bytes / self.seconds if self.seconds > 0 else None

    def to_proto(self) -> pb.TransferResult:
        msg = pb.TransferResult(transfer_id=self.transfer_id, status=self.status.value,
                                num_bytes=self.num_bytes, seconds=float(self.seconds))
        if self.error is not None:
            msg.error = self.error
        return msg

    @classmethod
    def from_proto(cls, msg: pb.TransferResult) -> TransferResult:
        return _from_proto_checked(lambda m: cls(
            transfer_id=m.transfer_id, status=TransferStatus.from_proto(m.status),
            error=m.error if m.HasField("error") else None, num_bytes=m.num_bytes,
            seconds=m.seconds), msg, "TransferResult")

    def to_bytes(self) -> bytes:
        return self.to_proto().SerializeToString(deterministic=True)

    @classmethod
    def from_bytes(cls, data: bytes | bytearray | memoryview) -> TransferResult:
        return cls.from_proto(_parse(pb.TransferResult, data, "TransferResult"))
