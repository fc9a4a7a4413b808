import datetime

from google.protobuf import timestamp_pb2 as _timestamp_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GenerateRequest(_message.Message):
    __slots__ = ("token", "rollout_id", "model", "text", "token_ids", "max_tokens", "temperature", "top_p", "seed", "stop", "logprobs", "no_fallback")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    ROLLOUT_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    NO_FALLBACK_FIELD_NUMBER: _ClassVar[int]
    token: str
    rollout_id: str
    model: str
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    max_tokens: int
    temperature: float
    top_p: float
    seed: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    logprobs: bool
    no_fallback: bool
    def __init__(self, token: _Optional[str] = ..., rollout_id: _Optional[str] = ..., model: _Optional[str] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., seed: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., logprobs: _Optional[bool] = ..., no_fallback: _Optional[bool] = ...) -> None: ...

class GenerateEvent(_message.Message):
    __slots__ = ("token", "end", "served_by", "device", "dtype", "degraded")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    SERVED_BY_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DEGRADED_FIELD_NUMBER: _ClassVar[int]
    token: GenerateToken
    end: GenerateEnd
    served_by: str
    device: str
    dtype: str
    degraded: bool
    def __init__(self, token: _Optional[_Union[GenerateToken, _Mapping]] = ..., end: _Optional[_Union[GenerateEnd, _Mapping]] = ..., served_by: _Optional[str] = ..., device: _Optional[str] = ..., dtype: _Optional[str] = ..., degraded: _Optional[bool] = ...) -> None: ...

class GenerateToken(_message.Message):
    __slots__ = ("token_id", "text", "logprob")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    text: str
    logprob: float
    def __init__(self, token_id: _Optional[int] = ..., text: _Optional[str] = ..., logprob: _Optional[float] = ...) -> None: ...

class GenerateEnd(_message.Message):
    __slots__ = ("finish_reason", "prompt_tokens", "completion_tokens", "error", "resumable", "tokens_sent", "last_token_id", "failovers")
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    RESUMABLE_FIELD_NUMBER: _ClassVar[int]
    TOKENS_SENT_FIELD_NUMBER: _ClassVar[int]
    LAST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    FAILOVERS_FIELD_NUMBER: _ClassVar[int]
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    error: InferError
    resumable: bool
    tokens_sent: int
    last_token_id: int
    failovers: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, finish_reason: _Optional[str] = ..., prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., error: _Optional[_Union[InferError, _Mapping]] = ..., resumable: _Optional[bool] = ..., tokens_sent: _Optional[int] = ..., last_token_id: _Optional[int] = ..., failovers: _Optional[_Iterable[str]] = ...) -> None: ...

class Tensor(_message.Message):
    __slots__ = ("shape", "values")
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    shape: _containers.RepeatedScalarFieldContainer[int]
    values: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, shape: _Optional[_Iterable[int]] = ..., values: _Optional[_Iterable[float]] = ...) -> None: ...

class InferRequest(_message.Message):
    __slots__ = ("token", "rollout_id", "request_id", "idempotency_key", "model", "revision", "input", "deadline")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    ROLLOUT_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    IDEMPOTENCY_KEY_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    REVISION_FIELD_NUMBER: _ClassVar[int]
    INPUT_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_FIELD_NUMBER: _ClassVar[int]
    token: str
    rollout_id: str
    request_id: str
    idempotency_key: str
    model: str
    revision: str
    input: Tensor
    deadline: _timestamp_pb2.Timestamp
    def __init__(self, token: _Optional[str] = ..., rollout_id: _Optional[str] = ..., request_id: _Optional[str] = ..., idempotency_key: _Optional[str] = ..., model: _Optional[str] = ..., revision: _Optional[str] = ..., input: _Optional[_Union[Tensor, _Mapping]] = ..., deadline: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class InferResponse(_message.Message):
    __slots__ = ("output", "model", "revision", "device", "batch_size", "queue_ms", "degraded", "replayed")
    OUTPUT_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    REVISION_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    QUEUE_MS_FIELD_NUMBER: _ClassVar[int]
    DEGRADED_FIELD_NUMBER: _ClassVar[int]
    REPLAYED_FIELD_NUMBER: _ClassVar[int]
    output: Tensor
    model: str
    revision: str
    device: str
    batch_size: int
    queue_ms: float
    degraded: bool
    replayed: bool
    def __init__(self, output: _Optional[_Union[Tensor, _Mapping]] = ..., model: _Optional[str] = ..., revision: _Optional[str] = ..., device: _Optional[str] = ..., batch_size: _Optional[int] = ..., queue_ms: _Optional[float] = ..., degraded: _Optional[bool] = ..., replayed: _Optional[bool] = ...) -> None: ...

class InferError(_message.Message):
    __slots__ = ("code", "message", "retry_after_s")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    RETRY_AFTER_S_FIELD_NUMBER: _ClassVar[int]
    code: str
    message: str
    retry_after_s: float
    def __init__(self, code: _Optional[str] = ..., message: _Optional[str] = ..., retry_after_s: _Optional[float] = ...) -> None: ...

class InferStreamResponse(_message.Message):
    __slots__ = ("request_id", "answer", "error")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ANSWER_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    answer: InferResponse
    error: InferError
    def __init__(self, request_id: _Optional[str] = ..., answer: _Optional[_Union[InferResponse, _Mapping]] = ..., error: _Optional[_Union[InferError, _Mapping]] = ...) -> None: ...

class GatewayStatusRequest(_message.Message):
    __slots__ = ("running", "charged")
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    CHARGED_FIELD_NUMBER: _ClassVar[int]
    running: RunningRollouts
    charged: UsageMark
    def __init__(self, running: _Optional[_Union[RunningRollouts, _Mapping]] = ..., charged: _Optional[_Union[UsageMark, _Mapping]] = ...) -> None: ...

class UsageMark(_message.Message):
    __slots__ = ("gateway", "seq")
    GATEWAY_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    gateway: str
    seq: int
    def __init__(self, gateway: _Optional[str] = ..., seq: _Optional[int] = ...) -> None: ...

class TokenCount(_message.Message):
    __slots__ = ("model", "prompt", "completion")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_FIELD_NUMBER: _ClassVar[int]
    model: str
    prompt: int
    completion: int
    def __init__(self, model: _Optional[str] = ..., prompt: _Optional[int] = ..., completion: _Optional[int] = ...) -> None: ...

class RolloutTokens(_message.Message):
    __slots__ = ("counts",)
    COUNTS_FIELD_NUMBER: _ClassVar[int]
    counts: _containers.RepeatedCompositeFieldContainer[TokenCount]
    def __init__(self, counts: _Optional[_Iterable[_Union[TokenCount, _Mapping]]] = ...) -> None: ...

class RunningRollouts(_message.Message):
    __slots__ = ("rollout_ids", "as_of", "signature")
    ROLLOUT_IDS_FIELD_NUMBER: _ClassVar[int]
    AS_OF_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    rollout_ids: _containers.RepeatedScalarFieldContainer[str]
    as_of: float
    signature: str
    def __init__(self, rollout_ids: _Optional[_Iterable[str]] = ..., as_of: _Optional[float] = ..., signature: _Optional[str] = ...) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("name", "revision", "sha256", "primary_device", "dtype")
    NAME_FIELD_NUMBER: _ClassVar[int]
    REVISION_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    PRIMARY_DEVICE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    name: str
    revision: str
    sha256: str
    primary_device: str
    dtype: str
    def __init__(self, name: _Optional[str] = ..., revision: _Optional[str] = ..., sha256: _Optional[str] = ..., primary_device: _Optional[str] = ..., dtype: _Optional[str] = ...) -> None: ...

class GatewayStatus(_message.Message):
    __slots__ = ("models", "breaker", "queue_depth", "oldest_queued_ms", "served", "failovers", "oom_faults", "p95_latency_ms", "latency_window_s", "device_seconds", "tokens", "usage_mark")
    class DeviceSecondsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    class TokensEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: RolloutTokens
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[RolloutTokens, _Mapping]] = ...) -> None: ...
    MODELS_FIELD_NUMBER: _ClassVar[int]
    BREAKER_FIELD_NUMBER: _ClassVar[int]
    QUEUE_DEPTH_FIELD_NUMBER: _ClassVar[int]
    OLDEST_QUEUED_MS_FIELD_NUMBER: _ClassVar[int]
    SERVED_FIELD_NUMBER: _ClassVar[int]
    FAILOVERS_FIELD_NUMBER: _ClassVar[int]
    OOM_FAULTS_FIELD_NUMBER: _ClassVar[int]
    P95_LATENCY_MS_FIELD_NUMBER: _ClassVar[int]
    LATENCY_WINDOW_S_FIELD_NUMBER: _ClassVar[int]
    DEVICE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    USAGE_MARK_FIELD_NUMBER: _ClassVar[int]
    models: _containers.RepeatedCompositeFieldContainer[ModelInfo]
    breaker: str
    queue_depth: int
    oldest_queued_ms: float
    served: int
    failovers: int
    oom_faults: int
    p95_latency_ms: float
    latency_window_s: float
    device_seconds: _containers.ScalarMap[str, float]
    tokens: _containers.MessageMap[str, RolloutTokens]
    usage_mark: UsageMark
    def __init__(self, models: _Optional[_Iterable[_Union[ModelInfo, _Mapping]]] = ..., breaker: _Optional[str] = ..., queue_depth: _Optional[int] = ..., oldest_queued_ms: _Optional[float] = ..., served: _Optional[int] = ..., failovers: _Optional[int] = ..., oom_faults: _Optional[int] = ..., p95_latency_ms: _Optional[float] = ..., latency_window_s: _Optional[float] = ..., device_seconds: _Optional[_Mapping[str, float]] = ..., tokens: _Optional[_Mapping[str, RolloutTokens]] = ..., usage_mark: _Optional[_Union[UsageMark, _Mapping]] = ...) -> None: ...
