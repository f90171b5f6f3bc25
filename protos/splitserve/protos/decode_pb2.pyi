from splitserve.protos import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ConfirmPairRequest(_message.Message):
    __slots__ = ("prefill_instance", "decode_instance", "store_host", "store_port")
    PREFILL_INSTANCE_FIELD_NUMBER: _ClassVar[int]
    DECODE_INSTANCE_FIELD_NUMBER: _ClassVar[int]
    STORE_HOST_FIELD_NUMBER: _ClassVar[int]
    STORE_PORT_FIELD_NUMBER: _ClassVar[int]
    prefill_instance: str
    decode_instance: str
    store_host: str
    store_port: int
    def __init__(self, prefill_instance: _Optional[str] = ..., decode_instance: _Optional[str] = ..., store_host: _Optional[str] = ..., store_port: _Optional[int] = ...) -> None: ...

class ConfirmPairResponse(_message.Message):
    __slots__ = ("confirmed",)
    CONFIRMED_FIELD_NUMBER: _ClassVar[int]
    confirmed: bool
    def __init__(self, confirmed: _Optional[bool] = ...) -> None: ...

class DecodeRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "seed", "first_token_id", "first_logprobs", "kv", "priority", "trace_context", "fork_ids", "share")
    class TraceContextEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    KV_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    TRACE_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    FORK_IDS_FIELD_NUMBER: _ClassVar[int]
    SHARE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    seed: int
    first_token_id: int
    first_logprobs: _common_pb2.TokenLogprobs
    kv: _common_pb2.KvHandle
    priority: int
    trace_context: _containers.ScalarMap[str, str]
    fork_ids: _containers.RepeatedScalarFieldContainer[str]
    share: int
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., seed: _Optional[int] = ..., first_token_id: _Optional[int] = ..., first_logprobs: _Optional[_Union[_common_pb2.TokenLogprobs, _Mapping]] = ..., kv: _Optional[_Union[_common_pb2.KvHandle, _Mapping]] = ..., priority: _Optional[int] = ..., trace_context: _Optional[_Mapping[str, str]] = ..., fork_ids: _Optional[_Iterable[str]] = ..., share: _Optional[int] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class DecodeIn(_message.Message):
    __slots__ = ("request", "abort", "outputs_read", "reserve")
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    ABORT_FIELD_NUMBER: _ClassVar[int]
    OUTPUTS_READ_FIELD_NUMBER: _ClassVar[int]
    RESERVE_FIELD_NUMBER: _ClassVar[int]
    request: DecodeRequest
    abort: AbortRequest
    outputs_read: OutputsRead
    reserve: SeatRequest
    def __init__(self, request: _Optional[_Union[DecodeRequest, _Mapping]] = ..., abort: _Optional[_Union[AbortRequest, _Mapping]] = ..., outputs_read: _Optional[_Union[OutputsRead, _Mapping]] = ..., reserve: _Optional[_Union[SeatRequest, _Mapping]] = ...) -> None: ...

class SeatRequest(_message.Message):
    __slots__ = ("request_id", "num_seqs", "hold_ms", "share")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_SEQS_FIELD_NUMBER: _ClassVar[int]
    HOLD_MS_FIELD_NUMBER: _ClassVar[int]
    SHARE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    num_seqs: int
    hold_ms: int
    share: int
    def __init__(self, request_id: _Optional[str] = ..., num_seqs: _Optional[int] = ..., hold_ms: _Optional[int] = ..., share: _Optional[int] = ...) -> None: ...

class OutputsRead(_message.Message):
    __slots__ = ("num_outputs",)
    NUM_OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    num_outputs: int
    def __init__(self, num_outputs: _Optional[int] = ...) -> None: ...

class TokenDelta(_message.Message):
    __slots__ = ("request_id", "token_ids", "logprobs", "finish_reason", "error", "timings", "cached_prompt_tokens", "num_blocks_pulled", "prompt_logprobs", "refused", "unavailable")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_PULLED_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    UNAVAILABLE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprobs]
    finish_reason: _common_pb2.FinishReason
    error: str
    timings: _common_pb2.Timings
    cached_prompt_tokens: int
    num_blocks_pulled: int
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprobs]
    refused: bool
    unavailable: bool
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprobs, _Mapping]]] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., error: _Optional[str] = ..., timings: _Optional[_Union[_common_pb2.Timings, _Mapping]] = ..., cached_prompt_tokens: _Optional[int] = ..., num_blocks_pulled: _Optional[int] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprobs, _Mapping]]] = ..., refused: _Optional[bool] = ..., unavailable: _Optional[bool] = ...) -> None: ...

class DecodeOut(_message.Message):
    __slots__ = ("deltas", "step_ns", "seats_granted")
    DELTAS_FIELD_NUMBER: _ClassVar[int]
    STEP_NS_FIELD_NUMBER: _ClassVar[int]
    SEATS_GRANTED_FIELD_NUMBER: _ClassVar[int]
    deltas: _containers.RepeatedCompositeFieldContainer[TokenDelta]
    step_ns: int
    seats_granted: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, deltas: _Optional[_Iterable[_Union[TokenDelta, _Mapping]]] = ..., step_ns: _Optional[int] = ..., seats_granted: _Optional[_Iterable[str]] = ...) -> None: ...
