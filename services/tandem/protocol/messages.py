"""Wire messages of the KV transfer protocol (services/ARCHITECTURE.md, "KV protocol").

The schemas live in ``protos/tandem/v1/kv_transfer.proto``; these frozen
dataclasses are the Python face of them. Every ``to_bytes()`` / ``from_bytes()``
goes through the generated protobuf classes, so what travels is the protobuf
encoding that ``buf breaking`` guards.

The per-payload header and the transfer result are in ``payload.py``.
"""

from __future__ import annotations

import enum
import zlib
from dataclasses import dataclass
from typing import Any

from google.protobuf.message import DecodeError

from tandem.protocol.gen.tandem.v1 import kv_transfer_pb2 as pb

__all__ = [
    "CompatibilityDescriptor",
    "IncompatibleKVError",
    "KVTransferDescriptor",
    "LayerRange",
    "ProtocolError",
    "TransferStatus",
    "layer_groups",
    "payload_checksum",
]

_UINT32_MAX = 2**32 - 1
_UINT64_MAX = 2**64 - 1
_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1
_INT64_MAX = 2**63 - 1


class ProtocolError(ValueError):
    """Bytes that are not a valid message of the expected type."""


class IncompatibleKVError(ValueError):
    """Two KV caches cannot exchange blocks: their compatibility descriptors differ.

    ``mismatches`` maps each differing field to ``(ours, theirs)``.
    """

    def __init__(self, message: str, mismatches: dict[str, tuple[Any, Any]]) -> None:
        super().__init__(message)
        self.mismatches = mismatches

    def __reduce__(self):  # keep ``mismatches`` across pickling (Ray ships exceptions)
        return (type(self), (str(self), self.mismatches))


# --------------------------------------------------------------------------- helpers

def _check_int(name: str, value: object, lo: int, hi: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if not lo <= value <= hi:
        raise ValueError(f"{name} must be in [{lo}, {hi}], got {value}")


def _check_str(name: str, value: object, *, allow_empty: bool = False) -> None:
    if not isinstance(value, str):
        raise ValueError(f"{name} must be a string, got {value!r}")
    if not allow_empty and not value:
        raise ValueError(f"{name} must not be empty")


def _parse(cls: type, data: bytes | bytearray | memoryview, what: str):
    msg = cls()
    try:
        msg.ParseFromString(bytes(data))
    except DecodeError as e:
        raise ProtocolError(f"cannot decode {what}: {e}") from e
    return msg


def _from_proto_checked(build, msg, what: str):
    """Run a dataclass constructor on a parsed message; invalid content is a ProtocolError."""
    try:
        return build(msg)
    except ProtocolError:
        raise
    except ValueError as e:
        raise ProtocolError(f"invalid {what}: {e}") from e


def payload_checksum(data: bytes | bytearray | memoryview) -> int:
    """The checksum carried in :attr:`LayerGroupHeader.checksum` (CRC-32 of the payload bytes)."""
    return zlib.crc32(memoryview(data).cast("B")) & 0xFFFFFFFF


# --------------------------------------------------------------------------- status

class TransferStatus(enum.Enum):
    """Where one transfer stands, on either side; values equal the proto enum's numbers.

    ``BOOTSTRAPPING -> WAITING -> TRANSFERRING -> DONE | FAILED | ABORTED``
    (the state machine itself lives in ``tandem.transfer``).
    """

    UNSPECIFIED = pb.TRANSFER_STATUS_UNSPECIFIED
    BOOTSTRAPPING = pb.TRANSFER_STATUS_BOOTSTRAPPING
    WAITING = pb.TRANSFER_STATUS_WAITING
    TRANSFERRING = pb.TRANSFER_STATUS_TRANSFERRING
    DONE = pb.TRANSFER_STATUS_DONE
    FAILED = pb.TRANSFER_STATUS_FAILED
    ABORTED = pb.TRANSFER_STATUS_ABORTED

    @property
    def is_terminal(self) -> bool:
        return self in (TransferStatus.DONE, TransferStatus.FAILED, TransferStatus.ABORTED)

    @property
    def proto_name(self) -> str:
        """The proto enum value's name, e.g. ``TRANSFER_STATUS_DONE``."""
        return pb.TransferStatus.Name(self.value)

    @classmethod
    def from_proto(cls, value: int) -> TransferStatus:
        try:
            return cls(value)
        except ValueError:
            raise ProtocolError(f"unknown TransferStatus value {value}") from None


# --------------------------------------------------------------------------- compatibility

_COMPAT_INT_FIELDS = ("num_layers", "num_kv_heads", "head_dim", "block_size", "layout_version")


@dataclass(frozen=True)
class CompatibilityDescriptor:
    """What both ends of a KV channel must share; exchanged once per P-D pair."""

    model_id: str
    dtype: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    layout_version: int = 1

    def __post_init__(self) -> None:
        _check_str("model_id", self.model_id)
        _check_str("dtype", self.dtype)
        for name in _COMPAT_INT_FIELDS:
            lo = 0 if name == "layout_version" else 1
            _check_int(name, getattr(self, name), lo, _UINT32_MAX)

    def check(self, other: CompatibilityDescriptor, *, ours: str = "local",
              theirs: str = "peer") -> None:
        """Raise :class:`IncompatibleKVError` naming every field that differs, with both values."""
        if not isinstance(other, CompatibilityDescriptor):
            raise TypeError(f"expected a CompatibilityDescriptor, got {type(other).__name__}")
        mismatches = {name: (getattr(self, name), getattr(other, name))
                      for name in ("model_id", "dtype", *_COMPAT_INT_FIELDS)
                      if getattr(self, name) != getattr(other, name)}
        if mismatches:
            parts = "; ".join(f"{name}: {ours} {a!r} != {theirs} {b!r}"
                              for name, (a, b) in mismatches.items())
            raise IncompatibleKVError(f"incompatible KV caches ({parts})", mismatches)

    def is_compatible(self, other: CompatibilityDescriptor) -> bool:
        try:
            self.check(other)
        except IncompatibleKVError:
            return False
        return True

    def to_proto(self) -> pb.CompatibilityDescriptor:
        return pb.CompatibilityDescriptor(
            model_id=self.model_id, dtype=self.dtype, num_layers=self.num_layers,
            num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
            block_size=self.block_size, layout_version=self.layout_version)

    @classmethod
    def from_proto(cls, msg: pb.CompatibilityDescriptor) -> CompatibilityDescriptor:
        return _from_proto_checked(lambda m: cls(
            model_id=m.model_id, dtype=m.dtype, num_layers=m.num_layers,
            num_kv_heads=m.num_kv_heads, head_dim=m.head_dim, block_size=m.block_size,
            layout_version=m.layout_version), msg, "CompatibilityDescriptor")

    def to_bytes(self) -> bytes:
        return self.to_proto().SerializeToString(deterministic=True)

    @classmethod
    def from_bytes(cls, data: bytes | bytearray | memoryview) -> CompatibilityDescriptor:
        return cls.from_proto(_parse(pb.CompatibilityDescriptor, data, "CompatibilityDescriptor"))


# --------------------------------------------------------------------------- transfer descriptor

@dataclass(frozen=True)
class LayerRange:
    """Decoder layers ``[start, stop)`` sent as one payload."""

    start: int
    stop: int

    def __post_init__(self) -> None:
        _check_int("LayerRange.start", self.start, 0, _UINT32_MAX)
        _check_int("LayerRange.stop", self.stop, 0, _UINT32_MAX)
        if self.stop <= self.start:
            raise ValueError(f"LayerRange must be non-empty, got [{self.start}, {self.stop})")

    @property
    def num_layers(self) -> int:
        return self.stop - self.start

    @property
    def layers(self) -> range:
        """The layer indices, ``range(start, stop)``."""
        return range(self.start, self.stop)

    def __iter__(self):  # ``start, stop = group``
        return iter((self.start, self.stop))


def layer_groups(num_layers: int, group_size: int | None = None) -> tuple[LayerRange, ...]:
    """Split ``num_layers`` into consecutive groups of ``group_size`` (the last may be shorter).

    ``group_size`` of ``None`` (or >= ``num_layers``) gives one group: no layer-wise streaming.
    """
    _check_int("num_layers", num_layers, 1, _UINT32_MAX)
    if group_size is None:
        group_size = num_layers
    _check_int("group_size", group_size, 1, _UINT32_MAX)
    return tuple(LayerRange(s, min(s + group_size, num_layers))
                 for s in range(0, num_layers, group_size))


def _as_layer_range(g: LayerRange | tuple[int, int]) -> LayerRange:
    if isinstance(g, LayerRange):
        return g
    try:
        start, stop = g
    except (TypeError, ValueError):
        raise ValueError(f"a layer group is a LayerRange or a (start, stop) pair, got {g!r}") from None
    return LayerRange(start, stop)


@dataclass(frozen=True)
class KVTransferDescriptor:
    """D's reserved blocks for one request, handed to P: where each layer group goes.

    ``layer_groups`` are sent in order, one payload each; (start, stop) pairs are
    accepted and turned into :class:`LayerRange`. ``checksum`` asks P to put a
    :func:`payload_checksum` in every header.
    """

    request_id: str
    transfer_id: str
    block_ids: tuple[int, ...]
    layer_groups: tuple[LayerRange, ...]
    src_rank: int
    dst_rank: int
    num_prompt_tokens: int
    checksum: bool = False

    def __post_init__(self) -> None:
        _check_str("request_id", self.request_id)
        _check_str("transfer_id", self.transfer_id)
        object.__setattr__(self, "block_ids", tuple(self.block_ids))
        for b in self.block_ids:
            _check_int("block id", b, 0, _INT64_MAX)
        groups = tuple(_as_layer_range(g) for g in self.layer_groups)
        object.__setattr__(self, "layer_groups", groups)
        if not groups:
            raise ValueError("layer_groups must not be empty")
        for prev, cur in zip(groups, groups[1:]):
            if cur.start < prev.stop:
                raise ValueError(f"layer groups must be ascending and disjoint, got "
                                 f"[{prev.start}, {prev.stop}) then [{cur.start}, {cur.stop})")
        _check_int("src_rank", self.src_rank, 0, _INT32_MAX)
        _check_int("dst_rank", self.dst_rank, 0, _INT32_MAX)
        _check_int("num_prompt_tokens", self.num_prompt_tokens, 0, _UINT32_MAX)
        if not isinstance(self.checksum, bool):
            raise ValueError(f"checksum must be a bool, got {self.checksum!r}")

    @property
    def num_groups(self) -> int:
        return len(self.layer_groups)

    def to_proto(self) -> pb.KVTransferDescriptor:
        return pb.KVTransferDescriptor(
            request_id=self.request_id, transfer_id=self.transfer_id,
            block_ids=list(self.block_ids),
            layer_groups=[pb.LayerRange(start=g.start, stop=g.stop) for g in self.layer_groups],
            src_rank=self.src_rank, dst_rank=self.dst_rank, checksum=self.checksum,
            num_prompt_tokens=self.num_prompt_tokens)

    @classmethod
    def from_proto(cls, msg: pb.KVTransferDescriptor) -> KVTransferDescriptor:
        return _from_proto_checked(lambda m: cls(
            request_id=m.request_id, transfer_id=m.transfer_id, block_ids=tuple(m.block_ids),
            layer_groups=tuple(LayerRange(g.start, g.stop) for g in m.layer_groups),
            src_rank=m.src_rank, dst_rank=m.dst_rank, num_prompt_tokens=m.num_prompt_tokens,
            checksum=m.checksum), msg, "KVTransferDescriptor")

    def to_bytes(self) -> bytes:
        return self.to_proto().SerializeToString(deterministic=True)

    @classmethod
    def from_bytes(cls, data: bytes | bytearray | memoryview) -> KVTransferDescriptor:
        return cls.from_proto(_parse(pb.KVTransferDescriptor, data, "KVTransferDescriptor"))
