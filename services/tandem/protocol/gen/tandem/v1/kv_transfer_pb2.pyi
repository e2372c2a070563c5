from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TransferStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TRANSFER_STATUS_UNSPECIFIED: _ClassVar[TransferStatus]
    TRANSFER_STATUS_BOOTSTRAPPING: _ClassVar[TransferStatus]
    TRANSFER_STATUS_WAITING: _ClassVar[TransferStatus]
    TRANSFER_STATUS_TRANSFERRING: _ClassVar[TransferStatus]
    TRANSFER_STATUS_DONE: _ClassVar[TransferStatus]
    TRANSFER_STATUS_FAILED: _ClassVar[TransferStatus]
    TRANSFER_STATUS_ABORTED: _ClassVar[TransferStatus]
TRANSFER_STATUS_UNSPECIFIED: TransferStatus
TRANSFER_STATUS_BOOTSTRAPPING: TransferStatus
TRANSFER_STATUS_WAITING: TransferStatus
TRANSFER_STATUS_TRANSFERRING: TransferStatus
TRANSFER_STATUS_DONE: TransferStatus
TRANSFER_STATUS_FAILED: TransferStatus
TRANSFER_STATUS_ABORTED: TransferStatus

class CompatibilityDescriptor(_message.Message):
    __slots__ = ("model_id", "dtype", "num_layers", "num_kv_heads", "head_dim", "block_size", "layout_version")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_VERSION_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    dtype: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    layout_version: int
    def __init__(self, model_id: _Optional[str] = ..., dtype: _Optional[str] = ..., num_layers: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., block_size: _Optional[int] = ..., layout_version: _Optional[int] = ...) -> None: ...

class LayerRange(_message.Message):
    __slots__ = ("start", "stop")
    START_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    start: int
    stop: int
    def __init__(self, start: _Optional[int] = ..., stop: _Optional[int] = ...) -> None: ...

class KVTransferDescriptor(_message.Message):
    __slots__ = ("request_id", "transfer_id", "block_ids", "layer_groups", "src_rank", "dst_rank", "checksum", "num_prompt_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    LAYER_GROUPS_FIELD_NUMBER: _ClassVar[int]
    SRC_RANK_FIELD_NUMBER: _ClassVar[int]
    DST_RANK_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    transfer_id: str
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    layer_groups: _containers.RepeatedCompositeFieldContainer[LayerRange]
    src_rank: int
    dst_rank: int
    checksum: bool
    num_prompt_tokens: int
    def __init__(self, request_id: _Optional[str] = ..., transfer_id: _Optional[str] = ..., block_ids: _Optional[_Iterable[int]] = ..., layer_groups: _Optional[_Iterable[_Union[LayerRange, _Mapping]]] = ..., src_rank: _Optional[int] = ..., dst_rank: _Optional[int] = ..., checksum: _Optional[bool] = ..., num_prompt_tokens: _Optional[int] = ...) -> None: ...

class LayerGroupHeader(_message.Message):
    __slots__ = ("transfer_id", "layer_group", "num_bytes", "checksum", "final", "aborted", "segments")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    LAYER_GROUP_FIELD_NUMBER: _ClassVar[int]
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    FINAL_FIELD_NUMBER: _ClassVar[int]
    ABORTED_FIELD_NUMBER: _ClassVar[int]
    SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    layer_group: int
    num_bytes: int
    checksum: int
    final: bool
    aborted: bool
    segments: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, transfer_id: _Optional[str] = ..., layer_group: _Optional[int] = ..., num_bytes: _Optional[int] = ..., checksum: _Optional[int] = ..., final: _Optional[bool] = ..., aborted: _Optional[bool] = ..., segments: _Optional[_Iterable[int]] = ...) -> None: ...

class TransferResult(_message.Message):
    __slots__ = ("transfer_id", "status", "error", "num_bytes", "seconds")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    status: TransferStatus
    error: str
    num_bytes: int
    seconds: float
    def __init__(self, transfer_id: _Optional[str] = ..., status: _Optional[_Union[TransferStatus, str]] = ..., error: _Optional[str] = ..., num_bytes: _Optional[int] = ..., seconds: _Optional[float] = ...) -> None: ...
