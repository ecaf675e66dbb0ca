from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class CacheKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CACHE_KIND_UNSPECIFIED: _ClassVar[CacheKind]
    CACHE_KIND_NATIVE: _ClassVar[CacheKind]
    CACHE_KIND_SINK_WINDOW: _ClassVar[CacheKind]
CACHE_KIND_UNSPECIFIED: CacheKind
CACHE_KIND_NATIVE: CacheKind
CACHE_KIND_SINK_WINDOW: CacheKind

class CachePolicy(_message.Message):
    __slots__ = ("kind", "sink", "window", "slack", "full_kv_bits", "full_kv_group_size", "restore_path")
    KIND_FIELD_NUMBER: _ClassVar[int]
    SINK_FIELD_NUMBER: _ClassVar[int]
    WINDOW_FIELD_NUMBER: _ClassVar[int]
    SLACK_FIELD_NUMBER: _ClassVar[int]
    FULL_KV_BITS_FIELD_NUMBER: _ClassVar[int]
    FULL_KV_GROUP_SIZE_FIELD_NUMBER: _ClassVar[int]
    RESTORE_PATH_FIELD_NUMBER: _ClassVar[int]
    kind: CacheKind
    sink: int
    window: int
    slack: int
    full_kv_bits: int
    full_kv_group_size: int
    restore_path: str
    def __init__(self, kind: _Optional[_Union[CacheKind, str]] = ..., sink: _Optional[int] = ..., window: _Optional[int] = ..., slack: _Optional[int] = ..., full_kv_bits: _Optional[int] = ..., full_kv_group_size: _Optional[int] = ..., restore_path: _Optional[str] = ...) -> None: ...
