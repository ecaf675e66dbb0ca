from . import cache_pb2 as _cache_pb2
from . import sampling_pb2 as _sampling_pb2
from . import tensor_pb2 as _tensor_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GetVerifierInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class VerifierInfo(_message.Message):
    __slots__ = ("model_name", "vocab_size", "eos_token_ids", "hidden_size", "num_layers", "sliding_window", "target_layer_ids", "backend", "aux_dtype", "device", "version", "default_cache_policy", "max_block_size", "extra", "live_sessions", "max_sessions", "live_kv_bytes", "total_sessions", "max_position_embeddings", "max_context", "max_kv_bytes", "reserved_kv_bytes", "restore_sources", "prefix_cache_bytes", "queued_sessions", "constrains")
    class ExtraEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    SLIDING_WINDOW_FIELD_NUMBER: _ClassVar[int]
    TARGET_LAYER_IDS_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    AUX_DTYPE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_CACHE_POLICY_FIELD_NUMBER: _ClassVar[int]
    MAX_BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    EXTRA_FIELD_NUMBER: _ClassVar[int]
    LIVE_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    MAX_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    LIVE_KV_BYTES_FIELD_NUMBER: _ClassVar[int]
    TOTAL_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    MAX_POSITION_EMBEDDINGS_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    MAX_KV_BYTES_FIELD_NUMBER: _ClassVar[int]
    RESERVED_KV_BYTES_FIELD_NUMBER: _ClassVar[int]
    RESTORE_SOURCES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_BYTES_FIELD_NUMBER: _ClassVar[int]
    QUEUED_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    CONSTRAINS_FIELD_NUMBER: _ClassVar[int]
    model_name: str
    vocab_size: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    hidden_size: int
    num_layers: int
    sliding_window: int
    target_layer_ids: _containers.RepeatedScalarFieldContainer[int]
    backend: str
    aux_dtype: _tensor_pb2.DType
    device: str
    version: str
    default_cache_policy: _cache_pb2.CachePolicy
    max_block_size: int
    extra: _containers.ScalarMap[str, str]
    live_sessions: int
    max_sessions: int
    live_kv_bytes: int
    total_sessions: int
    max_position_embeddings: int
    max_context: int
    max_kv_bytes: int
    reserved_kv_bytes: int
    restore_sources: _containers.RepeatedScalarFieldContainer[str]
    prefix_cache_bytes: int
    queued_sessions: int
    constrains: bool
    def __init__(self, model_name: _Optional[str] = ..., vocab_size: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., hidden_size: _Optional[int] = ..., num_layers: _Optional[int] = ..., sliding_window: _Optional[int] = ..., target_layer_ids: _Optional[_Iterable[int]] = ..., backend: _Optional[str] = ..., aux_dtype: _Optional[_Union[_tensor_pb2.DType, str]] = ..., device: _Optional[str] = ..., version: _Optional[str] = ..., default_cache_policy: _Optional[_Union[_cache_pb2.CachePolicy, _Mapping]] = ..., max_block_size: _Optional[int] = ..., extra: _Optional[_Mapping[str, str]] = ..., live_sessions: _Optional[int] = ..., max_sessions: _Optional[int] = ..., live_kv_bytes: _Optional[int] = ..., total_sessions: _Optional[int] = ..., max_position_embeddings: _Optional[int] = ..., max_context: _Optional[int] = ..., max_kv_bytes: _Optional[int] = ..., reserved_kv_bytes: _Optional[int] = ..., restore_sources: _Optional[_Iterable[str]] = ..., prefix_cache_bytes: _Optional[int] = ..., queued_sessions: _Optional[int] = ..., constrains: _Optional[bool] = ...) -> None: ...

class SessionStats(_message.Message):
    __slots__ = ("kv_bytes_sliding", "kv_bytes_full", "positions", "bounded", "metrics")
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    KV_BYTES_SLIDING_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_FULL_FIELD_NUMBER: _ClassVar[int]
    POSITIONS_FIELD_NUMBER: _ClassVar[int]
    BOUNDED_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    kv_bytes_sliding: int
    kv_bytes_full: int
    positions: int
    bounded: bool
    metrics: _containers.ScalarMap[str, float]
    def __init__(self, kv_bytes_sliding: _Optional[int] = ..., kv_bytes_full: _Optional[int] = ..., positions: _Optional[int] = ..., bounded: _Optional[bool] = ..., metrics: _Optional[_Mapping[str, float]] = ...) -> None: ...

class VerifierRequest(_message.Message):
    __slots__ = ("open", "prefill", "verify", "close", "save")
    class Open(_message.Message):
        __slots__ = ("request_id", "cache_policy", "target_layer_ids", "max_positions", "sampling", "progress_ms", "logprobs", "constraint")
        REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
        CACHE_POLICY_FIELD_NUMBER: _ClassVar[int]
        TARGET_LAYER_IDS_FIELD_NUMBER: _ClassVar[int]
        MAX_POSITIONS_FIELD_NUMBER: _ClassVar[int]
        SAMPLING_FIELD_NUMBER: _ClassVar[int]
        PROGRESS_MS_FIELD_NUMBER: _ClassVar[int]
        LOGPROBS_FIELD_NUMBER: _ClassVar[int]
        CONSTRAINT_FIELD_NUMBER: _ClassVar[int]
        request_id: str
        cache_policy: _cache_pb2.CachePolicy
        target_layer_ids: _containers.RepeatedScalarFieldContainer[int]
        max_positions: int
        sampling: _sampling_pb2.Sampling
        progress_ms: int
        logprobs: int
        constraint: _sampling_pb2.Constraint
        def __init__(self, request_id: _Optional[str] = ..., cache_policy: _Optional[_Union[_cache_pb2.CachePolicy, _Mapping]] = ..., target_layer_ids: _Optional[_Iterable[int]] = ..., max_positions: _Optional[int] = ..., sampling: _Optional[_Union[_sampling_pb2.Sampling, _Mapping]] = ..., progress_ms: _Optional[int] = ..., logprobs: _Optional[int] = ..., constraint: _Optional[_Union[_sampling_pb2.Constraint, _Mapping]] = ...) -> None: ...
    class Prefill(_message.Message):
        __slots__ = ("token_ids", "reuse_any", "reuse_positions")
        TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
        REUSE_ANY_FIELD_NUMBER: _ClassVar[int]
        REUSE_POSITIONS_FIELD_NUMBER: _ClassVar[int]
        token_ids: _containers.RepeatedScalarFieldContainer[int]
        reuse_any: bool
        reuse_positions: _containers.RepeatedScalarFieldContainer[int]
        def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., reuse_any: _Optional[bool] = ..., reuse_positions: _Optional[_Iterable[int]] = ...) -> None: ...
    class Verify(_message.Message):
        __slots__ = ("block_ids", "proposal")
        BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
        PROPOSAL_FIELD_NUMBER: _ClassVar[int]
        block_ids: _containers.RepeatedScalarFieldContainer[int]
        proposal: _sampling_pb2.Proposal
        def __init__(self, block_ids: _Optional[_Iterable[int]] = ..., proposal: _Optional[_Union[_sampling_pb2.Proposal, _Mapping]] = ...) -> None: ...
    class Close(_message.Message):
        __slots__ = ()
        def __init__(self) -> None: ...
    class Save(_message.Message):
        __slots__ = ("token_ids",)
        TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
        token_ids: _containers.RepeatedScalarFieldContainer[int]
        def __init__(self, token_ids: _Optional[_Iterable[int]] = ...) -> None: ...
    OPEN_FIELD_NUMBER: _ClassVar[int]
    PREFILL_FIELD_NUMBER: _ClassVar[int]
    VERIFY_FIELD_NUMBER: _ClassVar[int]
    CLOSE_FIELD_NUMBER: _ClassVar[int]
    SAVE_FIELD_NUMBER: _ClassVar[int]
    open: VerifierRequest.Open
    prefill: VerifierRequest.Prefill
    verify: VerifierRequest.Verify
    close: VerifierRequest.Close
    save: VerifierRequest.Save
    def __init__(self, open: _Optional[_Union[VerifierRequest.Open, _Mapping]] = ..., prefill: _Optional[_Union[VerifierRequest.Prefill, _Mapping]] = ..., verify: _Optional[_Union[VerifierRequest.Verify, _Mapping]] = ..., close: _Optional[_Union[VerifierRequest.Close, _Mapping]] = ..., save: _Optional[_Union[VerifierRequest.Save, _Mapping]] = ...) -> None: ...

class VerifierResponse(_message.Message):
    __slots__ = ("opened", "prefilled", "verified", "closed", "saved", "progress", "elapsed_s", "draining")
    class Opened(_message.Message):
        __slots__ = ("info", "cache_policy", "session_id")
        INFO_FIELD_NUMBER: _ClassVar[int]
        CACHE_POLICY_FIELD_NUMBER: _ClassVar[int]
        SESSION_ID_FIELD_NUMBER: _ClassVar[int]
        info: VerifierInfo
        cache_policy: _cache_pb2.CachePolicy
        session_id: str
        def __init__(self, info: _Optional[_Union[VerifierInfo, _Mapping]] = ..., cache_policy: _Optional[_Union[_cache_pb2.CachePolicy, _Mapping]] = ..., session_id: _Optional[str] = ...) -> None: ...
    class Prefilled(_message.Message):
        __slots__ = ("next_token", "aux", "stats", "cached_tokens", "logprobs")
        NEXT_TOKEN_FIELD_NUMBER: _ClassVar[int]
        AUX_FIELD_NUMBER: _ClassVar[int]
        STATS_FIELD_NUMBER: _ClassVar[int]
        CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
        LOGPROBS_FIELD_NUMBER: _ClassVar[int]
        next_token: int
        aux: _tensor_pb2.Tensor
        stats: SessionStats
        cached_tokens: int
        logprobs: _sampling_pb2.TokenLogprobs
        def __init__(self, next_token: _Optional[int] = ..., aux: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., stats: _Optional[_Union[SessionStats, _Mapping]] = ..., cached_tokens: _Optional[int] = ..., logprobs: _Optional[_Union[_sampling_pb2.TokenLogprobs, _Mapping]] = ...) -> None: ...
    class Verified(_message.Message):
        __slots__ = ("accepted", "next_token", "aux", "stats", "logprobs")
        ACCEPTED_FIELD_NUMBER: _ClassVar[int]
        NEXT_TOKEN_FIELD_NUMBER: _ClassVar[int]
        AUX_FIELD_NUMBER: _ClassVar[int]
        STATS_FIELD_NUMBER: _ClassVar[int]
        LOGPROBS_FIELD_NUMBER: _ClassVar[int]
        accepted: int
        next_token: int
        aux: _tensor_pb2.Tensor
        stats: SessionStats
        logprobs: _containers.RepeatedCompositeFieldContainer[_sampling_pb2.TokenLogprobs]
        def __init__(self, accepted: _Optional[int] = ..., next_token: _Optional[int] = ..., aux: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., stats: _Optional[_Union[SessionStats, _Mapping]] = ..., logprobs: _Optional[_Iterable[_Union[_sampling_pb2.TokenLogprobs, _Mapping]]] = ...) -> None: ...
    class Closed(_message.Message):
        __slots__ = ("stats",)
        STATS_FIELD_NUMBER: _ClassVar[int]
        stats: SessionStats
        def __init__(self, stats: _Optional[_Union[SessionStats, _Mapping]] = ...) -> None: ...
    class Saved(_message.Message):
        __slots__ = ("kept",)
        KEPT_FIELD_NUMBER: _ClassVar[int]
        kept: bool
        def __init__(self, kept: _Optional[bool] = ...) -> None: ...
    class Progress(_message.Message):
        __slots__ = ("waited_s",)
        WAITED_S_FIELD_NUMBER: _ClassVar[int]
        waited_s: float
        def __init__(self, waited_s: _Optional[float] = ...) -> None: ...
    OPENED_FIELD_NUMBER: _ClassVar[int]
    PREFILLED_FIELD_NUMBER: _ClassVar[int]
    VERIFIED_FIELD_NUMBER: _ClassVar[int]
    CLOSED_FIELD_NUMBER: _ClassVar[int]
    SAVED_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    ELAPSED_S_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    opened: VerifierResponse.Opened
    prefilled: VerifierResponse.Prefilled
    verified: VerifierResponse.Verified
    closed: VerifierResponse.Closed
    saved: VerifierResponse.Saved
    progress: VerifierResponse.Progress
    elapsed_s: float
    draining: bool
    def __init__(self, opened: _Optional[_Union[VerifierResponse.Opened, _Mapping]] = ..., prefilled: _Optional[_Union[VerifierResponse.Prefilled, _Mapping]] = ..., verified: _Optional[_Union[VerifierResponse.Verified, _Mapping]] = ..., closed: _Optional[_Union[VerifierResponse.Closed, _Mapping]] = ..., saved: _Optional[_Union[VerifierResponse.Saved, _Mapping]] = ..., progress: _Optional[_Union[VerifierResponse.Progress, _Mapping]] = ..., elapsed_s: _Optional[float] = ..., draining: _Optional[bool] = ...) -> None: ...

class VerifyRoundRequest(_message.Message):
    __slots__ = ("items", "progress_ms")
    class Item(_message.Message):
        __slots__ = ("session_id", "verify")
        SESSION_ID_FIELD_NUMBER: _ClassVar[int]
        VERIFY_FIELD_NUMBER: _ClassVar[int]
        session_id: str
        verify: VerifierRequest.Verify
        def __init__(self, session_id: _Optional[str] = ..., verify: _Optional[_Union[VerifierRequest.Verify, _Mapping]] = ...) -> None: ...
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_MS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[VerifyRoundRequest.Item]
    progress_ms: int
    def __init__(self, items: _Optional[_Iterable[_Union[VerifyRoundRequest.Item, _Mapping]]] = ..., progress_ms: _Optional[int] = ...) -> None: ...

class VerifyRoundResponse(_message.Message):
    __slots__ = ("done", "progress", "elapsed_s", "draining")
    class Error(_message.Message):
        __slots__ = ("code", "message")
        CODE_FIELD_NUMBER: _ClassVar[int]
        MESSAGE_FIELD_NUMBER: _ClassVar[int]
        code: int
        message: str
        def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...
    class Item(_message.Message):
        __slots__ = ("verified", "error")
        VERIFIED_FIELD_NUMBER: _ClassVar[int]
        ERROR_FIELD_NUMBER: _ClassVar[int]
        verified: VerifierResponse.Verified
        error: VerifyRoundResponse.Error
        def __init__(self, verified: _Optional[_Union[VerifierResponse.Verified, _Mapping]] = ..., error: _Optional[_Union[VerifyRoundResponse.Error, _Mapping]] = ...) -> None: ...
    class Done(_message.Message):
        __slots__ = ("items",)
        ITEMS_FIELD_NUMBER: _ClassVar[int]
        items: _containers.RepeatedCompositeFieldContainer[VerifyRoundResponse.Item]
        def __init__(self, items: _Optional[_Iterable[_Union[VerifyRoundResponse.Item, _Mapping]]] = ...) -> None: ...
    DONE_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    ELAPSED_S_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    done: VerifyRoundResponse.Done
    progress: VerifierResponse.Progress
    elapsed_s: float
    draining: bool
    def __init__(self, done: _Optional[_Union[VerifyRoundResponse.Done, _Mapping]] = ..., progress: _Optional[_Union[VerifierResponse.Progress, _Mapping]] = ..., elapsed_s: _Optional[float] = ..., draining: _Optional[bool] = ...) -> None: ...
