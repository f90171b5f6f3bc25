from splitserve.protos import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "seed", "priority", "lease_ms", "share")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    SHARE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    seed: int
    priority: int
    lease_ms: int
    share: int
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., seed: _Optional[int] = ..., priority: _Optional[int] = ..., lease_ms: _Optional[int] = ..., share: _Optional[int] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("request_id", "first_token_id", "first_logprobs", "kv", "finish_reason", "cached_prompt_tokens", "timings", "prompt_logprobs")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    KV_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    first_token_id: int
    first_logprobs: _common_pb2.TokenLogprobs
    kv: _common_pb2.KvHandle
    finish_reason: _common_pb2.FinishReason
    cached_prompt_tokens: int
    timings: _common_pb2.Timings
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprobs]
    def __init__(self, request_id: _Optional[str] = ..., first_token_id: _Optional[int] = ..., first_logprobs: _Optional[_Union[_common_pb2.TokenLogprobs, _Mapping]] = ..., kv: _Optional[_Union[_common_pb2.KvHandle, _Mapping]] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., cached_prompt_tokens: _Optional[int] = ..., timings: _Optional[_Union[_common_pb2.Timings, _Mapping]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprobs, _Mapping]]] = ...) -> None: ...

class ReleaseKvRequest(_message.Message):
    __slots__ = ("lease_id", "epoch")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    epoch: int
    def __init__(self, lease_id: _Optional[str] = ..., epoch: _Optional[int] = ...) -> None: ...

class ReleaseKvResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: bool
    def __init__(self, released: _Optional[bool] = ...) -> None: ...

class PairKvRequest(_message.Message):
    __slots__ = ("decode_instance", "store_host", "store_port", "backend", "generation")
    DECODE_INSTANCE_FIELD_NUMBER: _ClassVar[int]
    STORE_HOST_FIELD_NUMBER: _ClassVar[int]
    STORE_PORT_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    decode_instance: str
    store_host: str
    store_port: int
    backend: str
    generation: int
    def __init__(self, decode_instance: _Optional[str] = ..., store_host: _Optional[str] = ..., store_port: _Optional[int] = ..., backend: _Optional[str] = ..., generation: _Optional[int] = ...) -> None: ...

class PairKvResponse(_message.Message):
    __slots__ = ("paired",)
    PAIRED_FIELD_NUMBER: _ClassVar[int]
    paired: bool
    def __init__(self, paired: _Optional[bool] = ...) -> None: ...

class SendKvRequest(_message.Message):
    __slots__ = ("decode_instance", "lease_id", "epoch", "block_indices", "generation")
    DECODE_INSTANCE_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    BLOCK_INDICES_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    decode_instance: str
    lease_id: str
    epoch: int
    block_indices: _containers.RepeatedScalarFieldContainer[int]
    generation: int
    def __init__(self, decode_instance: _Optional[str] = ..., lease_id: _Optional[str] = ..., epoch: _Optional[int] = ..., block_indices: _Optional[_Iterable[int]] = ..., generation: _Optional[int] = ...) -> None: ...

class SendKvResponse(_message.Message):
    __slots__ = ("num_bytes", "transfer_ns")
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_NS_FIELD_NUMBER: _ClassVar[int]
    num_bytes: int
    transfer_ns: int
    def __init__(self, num_bytes: _Optional[int] = ..., transfer_ns: _Optional[int] = ...) -> None: ...
