from . import cache_pb2 as _cache_pb2
from . import sampling_pb2 as _sampling_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ToolChoiceMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TOOL_CHOICE_MODE_UNSPECIFIED: _ClassVar[ToolChoiceMode]
    TOOL_CHOICE_MODE_AUTO: _ClassVar[ToolChoiceMode]
    TOOL_CHOICE_MODE_NONE: _ClassVar[ToolChoiceMode]
    TOOL_CHOICE_MODE_REQUIRED: _ClassVar[ToolChoiceMode]

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_ABORT: _ClassVar[FinishReason]
    FINISH_REASON_ERROR: _ClassVar[FinishReason]
    FINISH_REASON_TOOL_CALLS: _ClassVar[FinishReason]
TOOL_CHOICE_MODE_UNSPECIFIED: ToolChoiceMode
TOOL_CHOICE_MODE_AUTO: ToolChoiceMode
TOOL_CHOICE_MODE_NONE: ToolChoiceMode
TOOL_CHOICE_MODE_REQUIRED: ToolChoiceMode
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_ABORT: FinishReason
FINISH_REASON_ERROR: FinishReason
FINISH_REASON_TOOL_CALLS: FinishReason

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ChatMessage(_message.Message):
    __slots__ = ("role", "content", "tool_calls", "tool_call_id", "name")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALL_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    tool_calls: _containers.RepeatedCompositeFieldContainer[ToolCall]
    tool_call_id: str
    name: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ..., tool_calls: _Optional[_Iterable[_Union[ToolCall, _Mapping]]] = ..., tool_call_id: _Optional[str] = ..., name: _Optional[str] = ...) -> None: ...

class ToolCall(_message.Message):
    __slots__ = ("id", "name", "arguments_json")
    ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    ARGUMENTS_JSON_FIELD_NUMBER: _ClassVar[int]
    id: str
    name: str
    arguments_json: str
    def __init__(self, id: _Optional[str] = ..., name: _Optional[str] = ..., arguments_json: _Optional[str] = ...) -> None: ...

class Tool(_message.Message):
    __slots__ = ("name", "description", "parameters_json", "strict")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    PARAMETERS_JSON_FIELD_NUMBER: _ClassVar[int]
    STRICT_FIELD_NUMBER: _ClassVar[int]
    name: str
    description: str
    parameters_json: str
    strict: bool
    def __init__(self, name: _Optional[str] = ..., description: _Optional[str] = ..., parameters_json: _Optional[str] = ..., strict: _Optional[bool] = ...) -> None: ...

class ChatMessages(_message.Message):
    __slots__ = ("messages", "continue_final_message", "tools", "tool_choice")
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    CONTINUE_FINAL_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    TOOLS_FIELD_NUMBER: _ClassVar[int]
    TOOL_CHOICE_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    continue_final_message: bool
    tools: _containers.RepeatedCompositeFieldContainer[Tool]
    tool_choice: ToolChoice
    def __init__(self, messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., continue_final_message: _Optional[bool] = ..., tools: _Optional[_Iterable[_Union[Tool, _Mapping]]] = ..., tool_choice: _Optional[_Union[ToolChoice, _Mapping]] = ...) -> None: ...

class ToolChoice(_message.Message):
    __slots__ = ("mode", "function")
    MODE_FIELD_NUMBER: _ClassVar[int]
    FUNCTION_FIELD_NUMBER: _ClassVar[int]
    mode: ToolChoiceMode
    function: str
    def __init__(self, mode: _Optional[_Union[ToolChoiceMode, str]] = ..., function: _Optional[str] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "seed", "max_tokens", "stop", "stop_token_ids", "ignore_eos", "min_p", "rule", "logprobs")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    RULE_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    seed: int
    max_tokens: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    min_p: float
    rule: _sampling_pb2.SamplingRule
    logprobs: int
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., max_tokens: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., min_p: _Optional[float] = ..., rule: _Optional[_Union[_sampling_pb2.SamplingRule, str]] = ..., logprobs: _Optional[int] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "text", "tokenized", "messages", "sampling_params", "block_size", "cache_policy", "constraint", "resume_token_ids")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKENIZED_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_PARAMS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    CACHE_POLICY_FIELD_NUMBER: _ClassVar[int]
    CONSTRAINT_FIELD_NUMBER: _ClassVar[int]
    RESUME_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    text: str
    tokenized: TokenIds
    messages: ChatMessages
    sampling_params: SamplingParams
    block_size: int
    cache_policy: _cache_pb2.CachePolicy
    constraint: _sampling_pb2.Constraint
    resume_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, request_id: _Optional[str] = ..., text: _Optional[str] = ..., tokenized: _Optional[_Union[TokenIds, _Mapping]] = ..., messages: _Optional[_Union[ChatMessages, _Mapping]] = ..., sampling_params: _Optional[_Union[SamplingParams, _Mapping]] = ..., block_size: _Optional[int] = ..., cache_policy: _Optional[_Union[_cache_pb2.CachePolicy, _Mapping]] = ..., constraint: _Optional[_Union[_sampling_pb2.Constraint, _Mapping]] = ..., resume_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class SpecStats(_message.Message):
    __slots__ = ("acceptance_lengths", "mean_acceptance", "decode_tok_s", "prefill_s", "drafter_fallback", "verifier_kv_bytes_sliding", "verifier_kv_bytes_full", "degenerate", "decode_s", "total_s", "block_size", "cache_kind", "cache_policy", "cache_bounded", "block_sizes", "copied_blocks", "forced_blocks")
    ACCEPTANCE_LENGTHS_FIELD_NUMBER: _ClassVar[int]
    MEAN_ACCEPTANCE_FIELD_NUMBER: _ClassVar[int]
    DECODE_TOK_S_FIELD_NUMBER: _ClassVar[int]
    PREFILL_S_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_FALLBACK_FIELD_NUMBER: _ClassVar[int]
    VERIFIER_KV_BYTES_SLIDING_FIELD_NUMBER: _ClassVar[int]
    VERIFIER_KV_BYTES_FULL_FIELD_NUMBER: _ClassVar[int]
    DEGENERATE_FIELD_NUMBER: _ClassVar[int]
    DECODE_S_FIELD_NUMBER: _ClassVar[int]
    TOTAL_S_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    CACHE_KIND_FIELD_NUMBER: _ClassVar[int]
    CACHE_POLICY_FIELD_NUMBER: _ClassVar[int]
    CACHE_BOUNDED_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZES_FIELD_NUMBER: _ClassVar[int]
    COPIED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    FORCED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    acceptance_lengths: _containers.RepeatedScalarFieldContainer[int]
    mean_acceptance: float
    decode_tok_s: float
    prefill_s: float
    drafter_fallback: bool
    verifier_kv_bytes_sliding: int
    verifier_kv_bytes_full: int
    degenerate: bool
    decode_s: float
    total_s: float
    block_size: int
    cache_kind: _cache_pb2.CacheKind
    cache_policy: str
    cache_bounded: bool
    block_sizes: _containers.RepeatedScalarFieldContainer[int]
    copied_blocks: int
    forced_blocks: int
    def __init__(self, acceptance_lengths: _Optional[_Iterable[int]] = ..., mean_acceptance: _Optional[float] = ..., decode_tok_s: _Optional[float] = ..., prefill_s: _Optional[float] = ..., drafter_fallback: _Optional[bool] = ..., verifier_kv_bytes_sliding: _Optional[int] = ..., verifier_kv_bytes_full: _Optional[int] = ..., degenerate: _Optional[bool] = ..., decode_s: _Optional[float] = ..., total_s: _Optional[float] = ..., block_size: _Optional[int] = ..., cache_kind: _Optional[_Union[_cache_pb2.CacheKind, str]] = ..., cache_policy: _Optional[str] = ..., cache_bounded: _Optional[bool] = ..., block_sizes: _Optional[_Iterable[int]] = ..., copied_blocks: _Optional[int] = ..., forced_blocks: _Optional[int] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("chunk", "complete")
    class Chunk(_message.Message):
        __slots__ = ("token_ids", "text", "logprobs")
        TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
        TEXT_FIELD_NUMBER: _ClassVar[int]
        LOGPROBS_FIELD_NUMBER: _ClassVar[int]
        token_ids: _containers.RepeatedScalarFieldContainer[int]
        text: str
        logprobs: _containers.RepeatedCompositeFieldContainer[_sampling_pb2.TokenLogprobs]
        def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., logprobs: _Optional[_Iterable[_Union[_sampling_pb2.TokenLogprobs, _Mapping]]] = ...) -> None: ...
    class Complete(_message.Message):
        __slots__ = ("finish_reason", "prompt_tokens", "completion_tokens", "stats", "error_message", "prompt_token_ids", "seed", "cached_tokens", "sampling_rule", "sampling", "tool_calls", "content")
        FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
        PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
        COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
        STATS_FIELD_NUMBER: _ClassVar[int]
        ERROR_MESSAGE_FIELD_NUMBER: _ClassVar[int]
        PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
        SEED_FIELD_NUMBER: _ClassVar[int]
        CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
        SAMPLING_RULE_FIELD_NUMBER: _ClassVar[int]
        SAMPLING_FIELD_NUMBER: _ClassVar[int]
        TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
        CONTENT_FIELD_NUMBER: _ClassVar[int]
        finish_reason: FinishReason
        prompt_tokens: int
        completion_tokens: int
        stats: SpecStats
        error_message: str
        prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
        seed: int
        cached_tokens: int
        sampling_rule: _sampling_pb2.SamplingRule
        sampling: _sampling_pb2.Sampling
        tool_calls: _containers.RepeatedCompositeFieldContainer[ToolCall]
        content: str
        def __init__(self, finish_reason: _Optional[_Union[FinishReason, str]] = ..., prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., stats: _Optional[_Union[SpecStats, _Mapping]] = ..., error_message: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., seed: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., sampling_rule: _Optional[_Union[_sampling_pb2.SamplingRule, str]] = ..., sampling: _Optional[_Union[_sampling_pb2.Sampling, _Mapping]] = ..., tool_calls: _Optional[_Iterable[_Union[ToolCall, _Mapping]]] = ..., content: _Optional[str] = ...) -> None: ...
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    COMPLETE_FIELD_NUMBER: _ClassVar[int]
    chunk: GenerateResponse.Chunk
    complete: GenerateResponse.Complete
    def __init__(self, chunk: _Optional[_Union[GenerateResponse.Chunk, _Mapping]] = ..., complete: _Optional[_Union[GenerateResponse.Complete, _Mapping]] = ...) -> None: ...

class GetModelInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("target_model", "draft_model", "vocab_size", "eos_token_ids", "sliding_window", "default_block_size", "max_block_size", "max_tokens_limit", "default_max_tokens", "has_tokenizer", "default_cache_policy", "target_layer_ids", "max_prompt_tokens", "max_position_embeddings", "has_chat_template")
    TARGET_MODEL_FIELD_NUMBER: _ClassVar[int]
    DRAFT_MODEL_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SLIDING_WINDOW_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_LIMIT_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    HAS_TOKENIZER_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_CACHE_POLICY_FIELD_NUMBER: _ClassVar[int]
    TARGET_LAYER_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_POSITION_EMBEDDINGS_FIELD_NUMBER: _ClassVar[int]
    HAS_CHAT_TEMPLATE_FIELD_NUMBER: _ClassVar[int]
    target_model: str
    draft_model: str
    vocab_size: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sliding_window: int
    default_block_size: int
    max_block_size: int
    max_tokens_limit: int
    default_max_tokens: int
    has_tokenizer: bool
    default_cache_policy: _cache_pb2.CachePolicy
    target_layer_ids: _containers.RepeatedScalarFieldContainer[int]
    max_prompt_tokens: int
    max_position_embeddings: int
    has_chat_template: bool
    def __init__(self, target_model: _Optional[str] = ..., draft_model: _Optional[str] = ..., vocab_size: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., sliding_window: _Optional[int] = ..., default_block_size: _Optional[int] = ..., max_block_size: _Optional[int] = ..., max_tokens_limit: _Optional[int] = ..., default_max_tokens: _Optional[int] = ..., has_tokenizer: _Optional[bool] = ..., default_cache_policy: _Optional[_Union[_cache_pb2.CachePolicy, _Mapping]] = ..., target_layer_ids: _Optional[_Iterable[int]] = ..., max_prompt_tokens: _Optional[int] = ..., max_position_embeddings: _Optional[int] = ..., has_chat_template: _Optional[bool] = ...) -> None: ...

class GetServerInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ServerInfo(_message.Message):
    __slots__ = ("version", "verifier_backend", "drafter_backend", "deployment", "active_requests", "total_requests", "uptime_s", "extra")
    class ExtraEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    VERSION_FIELD_NUMBER: _ClassVar[int]
    VERIFIER_BACKEND_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_BACKEND_FIELD_NUMBER: _ClassVar[int]
    DEPLOYMENT_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    UPTIME_S_FIELD_NUMBER: _ClassVar[int]
    EXTRA_FIELD_NUMBER: _ClassVar[int]
    version: str
    verifier_backend: str
    drafter_backend: str
    deployment: str
    active_requests: int
    total_requests: int
    uptime_s: float
    extra: _containers.ScalarMap[str, str]
    def __init__(self, version: _Optional[str] = ..., verifier_backend: _Optional[str] = ..., drafter_backend: _Optional[str] = ..., deployment: _Optional[str] = ..., active_requests: _Optional[int] = ..., total_requests: _Optional[int] = ..., uptime_s: _Optional[float] = ..., extra: _Optional[_Mapping[str, str]] = ...) -> None: ...
