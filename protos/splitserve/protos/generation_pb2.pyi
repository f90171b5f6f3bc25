from splitserve.protos import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ChatMessage(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ...) -> None: ...

class ChatMessages(_message.Message):
    __slots__ = ("messages",)
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    def __init__(self, messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "model", "text", "token_ids", "chat", "sampling", "stop", "include_stop_str_in_output", "skip_special_tokens", "priority", "echo", "n", "best_of")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_STOP_STR_IN_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    SKIP_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    ECHO_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    BEST_OF_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    model: str
    text: str
    token_ids: TokenIds
    chat: ChatMessages
    sampling: _common_pb2.SamplingParams
    stop: _containers.RepeatedScalarFieldContainer[str]
    include_stop_str_in_output: bool
    skip_special_tokens: bool
    priority: int
    echo: bool
    n: int
    best_of: int
    def __init__(self, request_id: _Optional[str] = ..., model: _Optional[str] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., chat: _Optional[_Union[ChatMessages, _Mapping]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., stop: _Optional[_Iterable[str]] = ..., include_stop_str_in_output: _Optional[bool] = ..., skip_special_tokens: _Optional[bool] = ..., priority: _Optional[int] = ..., echo: _Optional[bool] = ..., n: _Optional[int] = ..., best_of: _Optional[int] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "text", "token_ids", "logprobs", "finish_reason", "usage", "timings", "stop_reason", "error", "prompt_logprobs", "prompt_token_ids", "index")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    STOP_REASON_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprobs]
    finish_reason: _common_pb2.FinishReason
    usage: _common_pb2.Usage
    timings: _common_pb2.Timings
    stop_reason: str
    error: str
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprobs]
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    index: int
    def __init__(self, request_id: _Optional[str] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprobs, _Mapping]]] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., usage: _Optional[_Union[_common_pb2.Usage, _Mapping]] = ..., timings: _Optional[_Union[_common_pb2.Timings, _Mapping]] = ..., stop_reason: _Optional[str] = ..., error: _Optional[str] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprobs, _Mapping]]] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., index: _Optional[int] = ...) -> None: ...

class TokenizeRequest(_message.Message):
    __slots__ = ("model", "text", "chat", "add_special_tokens")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    ADD_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    model: str
    text: str
    chat: ChatMessages
    add_special_tokens: bool
    def __init__(self, model: _Optional[str] = ..., text: _Optional[str] = ..., chat: _Optional[_Union[ChatMessages, _Mapping]] = ..., add_special_tokens: _Optional[bool] = ...) -> None: ...

class TokenizeResponse(_message.Message):
    __slots__ = ("token_ids", "max_model_len")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    max_model_len: int
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., max_model_len: _Optional[int] = ...) -> None: ...

class DetokenizeRequest(_message.Message):
    __slots__ = ("model", "token_ids", "skip_special_tokens")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SKIP_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    model: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    skip_special_tokens: bool
    def __init__(self, model: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., skip_special_tokens: _Optional[bool] = ...) -> None: ...

class DetokenizeResponse(_message.Message):
    __slots__ = ("text",)
    TEXT_FIELD_NUMBER: _ClassVar[int]
    text: str
    def __init__(self, text: _Optional[str] = ...) -> None: ...

class ListModelsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("id", "max_model_len")
    ID_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    id: str
    max_model_len: int
    def __init__(self, id: _Optional[str] = ..., max_model_len: _Optional[int] = ...) -> None: ...

class ListModelsResponse(_message.Message):
    __slots__ = ("models",)
    MODELS_FIELD_NUMBER: _ClassVar[int]
    models: _containers.RepeatedCompositeFieldContainer[ModelInfo]
    def __init__(self, models: _Optional[_Iterable[_Union[ModelInfo, _Mapping]]] = ...) -> None: ...
