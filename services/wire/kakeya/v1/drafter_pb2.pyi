from . import sampling_pb2 as _sampling_pb2
from . import tensor_pb2 as _tensor_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GetDrafterInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DrafterInfo(_message.Message):
    __slots__ = ("model_name", "target_model", "block_size", "target_layer_ids", "mask_token_id", "hidden_size", "num_layers", "vocab_size", "backend", "aux_dtype", "device", "version", "max_block_size", "extra", "live_sessions", "max_sessions", "live_kv_bytes", "total_sessions", "max_context", "prefix_cache_bytes", "queued_sessions")
    class ExtraEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    TARGET_MODEL_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    TARGET_LAYER_IDS_FIELD_NUMBER: _ClassVar[int]
    MASK_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    AUX_DTYPE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    MAX_BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    EXTRA_FIELD_NUMBER: _ClassVar[int]
    LIVE_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    MAX_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    LIVE_KV_BYTES_FIELD_NUMBER: _ClassVar[int]
    TOTAL_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_BYTES_FIELD_NUMBER: _ClassVar[int]
    QUEUED_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    model_name: str
    target_model: str
    block_size: int
    target_layer_ids: _containers.RepeatedScalarFieldContainer[int]
    mask_token_id: int
    hidden_size: int
    num_layers: int
    vocab_size: int
    backend: str
    aux_dtype: _tensor_pb2.DType
    device: str
    version: str
    max_block_size: int
    extra: _containers.ScalarMap[str, str]
    live_sessions: int
    max_sessions: int
    live_kv_bytes: int
    total_sessions: int
    max_context: int
    prefix_cache_bytes: int
    queued_sessions: int
    def __init__(self, model_name: _Optional[str] = ..., target_model: _Optional[str] = ..., block_size: _Optional[int] = ..., target_layer_ids: _Optional[_Iterable[int]] = ..., mask_token_id: _Optional[int] = ..., hidden_size: _Optional[int] = ..., num_layers: _Optional[int] = ..., vocab_size: _Optional[int] = ..., backend: _Optional[str] = ..., aux_dtype: _Optional[_Union[_tensor_pb2.DType, str]] = ..., device: _Optional[str] = ..., version: _Optional[str] = ..., max_block_size: _Optional[int] = ..., extra: _Optional[_Mapping[str, str]] = ..., live_sessions: _Optional[int] = ..., max_sessions: _Optional[int] = ..., live_kv_bytes: _Optional[int] = ..., total_sessions: _Optional[int] = ..., max_context: _Optional[int] = ..., prefix_cache_bytes: _Optional[int] = ..., queued_sessions: _Optional[int] = ...) -> None: ...

class DrafterStats(_message.Message):
    __slots__ = ("context_positions", "kv_bytes", "metrics")
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    CONTEXT_POSITIONS_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    context_positions: int
    kv_bytes: int
    metrics: _containers.ScalarMap[str, float]
    def __init__(self, context_positions: _Optional[int] = ..., kv_bytes: _Optional[int] = ..., metrics: _Optional[_Mapping[str, float]] = ...) -> None: ...

class DrafterRequest(_message.Message):
    __slots__ = ("open", "draft", "close", "predraft", "lookup", "save")
    class Open(_message.Message):
        __slots__ = ("request_id", "sampling", "progress_ms", "ranked")
        REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
        SAMPLING_FIELD_NUMBER: _ClassVar[int]
        PROGRESS_MS_FIELD_NUMBER: _ClassVar[int]
        RANKED_FIELD_NUMBER: _ClassVar[int]
        request_id: str
        sampling: _sampling_pb2.Sampling
        progress_ms: int
        ranked: int
        def __init__(self, request_id: _Optional[str] = ..., sampling: _Optional[_Union[_sampling_pb2.Sampling, _Mapping]] = ..., progress_ms: _Optional[int] = ..., ranked: _Optional[int] = ...) -> None: ...
    class Draft(_message.Message):
        __slots__ = ("new_aux", "last_token", "block_size", "resume_at")
        NEW_AUX_FIELD_NUMBER: _ClassVar[int]
        LAST_TOKEN_FIELD_NUMBER: _ClassVar[int]
        BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
        RESUME_AT_FIELD_NUMBER: _ClassVar[int]
        new_aux: _tensor_pb2.Tensor
        last_token: int
        block_size: int
        resume_at: int
        def __init__(self, new_aux: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., last_token: _Optional[int] = ..., block_size: _Optional[int] = ..., resume_at: _Optional[int] = ...) -> None: ...
    class Predraft(_message.Message):
        __slots__ = ("new_aux", "block_ids", "block_size", "alternatives")
        NEW_AUX_FIELD_NUMBER: _ClassVar[int]
        BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
        BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
        ALTERNATIVES_FIELD_NUMBER: _ClassVar[int]
        new_aux: _tensor_pb2.Tensor
        block_ids: _containers.RepeatedScalarFieldContainer[int]
        block_size: int
        alternatives: int
        def __init__(self, new_aux: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., block_ids: _Optional[_Iterable[int]] = ..., block_size: _Optional[int] = ..., alternatives: _Optional[int] = ...) -> None: ...
    class Close(_message.Message):
        __slots__ = ()
        def __init__(self) -> None: ...
    class Lookup(_message.Message):
        __slots__ = ("prompt_ids",)
        PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
        prompt_ids: _containers.RepeatedScalarFieldContainer[int]
        def __init__(self, prompt_ids: _Optional[_Iterable[int]] = ...) -> None: ...
    class Save(_message.Message):
        __slots__ = ("token_ids", "unseen_aux")
        TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
        UNSEEN_AUX_FIELD_NUMBER: _ClassVar[int]
        token_ids: _containers.RepeatedScalarFieldContainer[int]
        unseen_aux: _containers.RepeatedCompositeFieldContainer[_tensor_pb2.Tensor]
        def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., unseen_aux: _Optional[_Iterable[_Union[_tensor_pb2.Tensor, _Mapping]]] = ...) -> None: ...
    OPEN_FIELD_NUMBER: _ClassVar[int]
    DRAFT_FIELD_NUMBER: _ClassVar[int]
    CLOSE_FIELD_NUMBER: _ClassVar[int]
    PREDRAFT_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_FIELD_NUMBER: _ClassVar[int]
    SAVE_FIELD_NUMBER: _ClassVar[int]
    open: DrafterRequest.Open
    draft: DrafterRequest.Draft
    close: DrafterRequest.Close
    predraft: DrafterRequest.Predraft
    lookup: DrafterRequest.Lookup
    save: DrafterRequest.Save
    def __init__(self, open: _Optional[_Union[DrafterRequest.Open, _Mapping]] = ..., draft: _Optional[_Union[DrafterRequest.Draft, _Mapping]] = ..., close: _Optional[_Union[DrafterRequest.Close, _Mapping]] = ..., predraft: _Optional[_Union[DrafterRequest.Predraft, _Mapping]] = ..., lookup: _Optional[_Union[DrafterRequest.Lookup, _Mapping]] = ..., save: _Optional[_Union[DrafterRequest.Save, _Mapping]] = ...) -> None: ...

class DrafterResponse(_message.Message):
    __slots__ = ("opened", "drafted", "closed", "predrafted", "found", "saved", "progress", "elapsed_s", "draining")
    class Opened(_message.Message):
        __slots__ = ("info", "session_id")
        INFO_FIELD_NUMBER: _ClassVar[int]
        SESSION_ID_FIELD_NUMBER: _ClassVar[int]
        info: DrafterInfo
        session_id: str
        def __init__(self, info: _Optional[_Union[DrafterInfo, _Mapping]] = ..., session_id: _Optional[str] = ...) -> None: ...
    class Drafted(_message.Message):
        __slots__ = ("token_ids", "stats", "proposal", "ranked_ids")
        TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
        STATS_FIELD_NUMBER: _ClassVar[int]
        PROPOSAL_FIELD_NUMBER: _ClassVar[int]
        RANKED_IDS_FIELD_NUMBER: _ClassVar[int]
        token_ids: _containers.RepeatedScalarFieldContainer[int]
        stats: DrafterStats
        proposal: _sampling_pb2.Proposal
        ranked_ids: _containers.RepeatedScalarFieldContainer[int]
        def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., stats: _Optional[_Union[DrafterStats, _Mapping]] = ..., proposal: _Optional[_Union[_sampling_pb2.Proposal, _Mapping]] = ..., ranked_ids: _Optional[_Iterable[int]] = ...) -> None: ...
    class Predrafted(_message.Message):
        __slots__ = ("token_ids", "stats", "outcomes")
        class Outcome(_message.Message):
            __slots__ = ("accepted", "next_token", "token_ids")
            ACCEPTED_FIELD_NUMBER: _ClassVar[int]
            NEXT_TOKEN_FIELD_NUMBER: _ClassVar[int]
            TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
            accepted: int
            next_token: int
            token_ids: _containers.RepeatedScalarFieldContainer[int]
            def __init__(self, accepted: _Optional[int] = ..., next_token: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ...) -> None: ...
        TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
        STATS_FIELD_NUMBER: _ClassVar[int]
        OUTCOMES_FIELD_NUMBER: _ClassVar[int]
        token_ids: _containers.RepeatedScalarFieldContainer[int]
        stats: DrafterStats
        outcomes: _containers.RepeatedCompositeFieldContainer[DrafterResponse.Predrafted.Outcome]
        def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., stats: _Optional[_Union[DrafterStats, _Mapping]] = ..., outcomes: _Optional[_Iterable[_Union[DrafterResponse.Predrafted.Outcome, _Mapping]]] = ...) -> None: ...
    class Closed(_message.Message):
        __slots__ = ("stats",)
        STATS_FIELD_NUMBER: _ClassVar[int]
        stats: DrafterStats
        def __init__(self, stats: _Optional[_Union[DrafterStats, _Mapping]] = ...) -> None: ...
    class Found(_message.Message):
        __slots__ = ("positions",)
        POSITIONS_FIELD_NUMBER: _ClassVar[int]
        positions: _containers.RepeatedScalarFieldContainer[int]
        def __init__(self, positions: _Optional[_Iterable[int]] = ...) -> None: ...
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
    DRAFTED_FIELD_NUMBER: _ClassVar[int]
    CLOSED_FIELD_NUMBER: _ClassVar[int]
    PREDRAFTED_FIELD_NUMBER: _ClassVar[int]
    FOUND_FIELD_NUMBER: _ClassVar[int]
    SAVED_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    ELAPSED_S_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    opened: DrafterResponse.Opened
    drafted: DrafterResponse.Drafted
    closed: DrafterResponse.Closed
    predrafted: DrafterResponse.Predrafted
    found: DrafterResponse.Found
    saved: DrafterResponse.Saved
    progress: DrafterResponse.Progress
    elapsed_s: float
    draining: bool
    def __init__(self, opened: _Optional[_Union[DrafterResponse.Opened, _Mapping]] = ..., drafted: _Optional[_Union[DrafterResponse.Drafted, _Mapping]] = ..., closed: _Optional[_Union[DrafterResponse.Closed, _Mapping]] = ..., predrafted: _Optional[_Union[DrafterResponse.Predrafted, _Mapping]] = ..., found: _Optional[_Union[DrafterResponse.Found, _Mapping]] = ..., saved: _Optional[_Union[DrafterResponse.Saved, _Mapping]] = ..., progress: _Optional[_Union[DrafterResponse.Progress, _Mapping]] = ..., elapsed_s: _Optional[float] = ..., draining: _Optional[bool] = ...) -> None: ...

class DraftRoundRequest(_message.Message):
    __slots__ = ("items", "progress_ms")
    class Item(_message.Message):
        __slots__ = ("session_id", "draft")
        SESSION_ID_FIELD_NUMBER: _ClassVar[int]
        DRAFT_FIELD_NUMBER: _ClassVar[int]
        session_id: str
        draft: DrafterRequest.Draft
        def __init__(self, session_id: _Optional[str] = ..., draft: _Optional[_Union[DrafterRequest.Draft, _Mapping]] = ...) -> None: ...
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_MS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[DraftRoundRequest.Item]
    progress_ms: int
    def __init__(self, items: _Optional[_Iterable[_Union[DraftRoundRequest.Item, _Mapping]]] = ..., progress_ms: _Optional[int] = ...) -> None: ...

class DraftRoundResponse(_message.Message):
    __slots__ = ("done", "progress", "elapsed_s", "draining")
    class Error(_message.Message):
        __slots__ = ("code", "message")
        CODE_FIELD_NUMBER: _ClassVar[int]
        MESSAGE_FIELD_NUMBER: _ClassVar[int]
        code: int
        message: str
        def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...
    class Item(_message.Message):
        __slots__ = ("drafted", "error")
        DRAFTED_FIELD_NUMBER: _ClassVar[int]
        ERROR_FIELD_NUMBER: _ClassVar[int]
        drafted: DrafterResponse.Drafted
        error: DraftRoundResponse.Error
        def __init__(self, drafted: _Optional[_Union[DrafterResponse.Drafted, _Mapping]] = ..., error: _Optional[_Union[DraftRoundResponse.Error, _Mapping]] = ...) -> None: ...
    class Done(_message.Message):
        __slots__ = ("items",)
        ITEMS_FIELD_NUMBER: _ClassVar[int]
        items: _containers.RepeatedCompositeFieldContainer[DraftRoundResponse.Item]
        def __init__(self, items: _Optional[_Iterable[_Union[DraftRoundResponse.Item, _Mapping]]] = ...) -> None: ...
    DONE_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    ELAPSED_S_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    done: DraftRoundResponse.Done
    progress: DrafterResponse.Progress
    elapsed_s: float
    draining: bool
    def __init__(self, done: _Optional[_Union[DraftRoundResponse.Done, _Mapping]] = ..., progress: _Optional[_Union[DrafterResponse.Progress, _Mapping]] = ..., elapsed_s: _Optional[float] = ..., draining: _Optional[bool] = ...) -> None: ...
