import datetime

from google.protobuf import timestamp_pb2 as _timestamp_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

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
    __slots__ = ("running",)
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    running: RunningRollouts
    def __init__(self, running: _Optional[_Union[RunningRollouts, _Mapping]] = ...) -> None: ...

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
    __slots__ = ("models", "breaker", "queue_depth", "oldest_queued_ms", "served", "failovers", "oom_faults", "p95_latency_ms", "latency_window_s", "device_seconds")
    class DeviceSecondsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
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
    def __init__(self, models: _Optional[_Iterable[_Union[ModelInfo, _Mapping]]] = ..., breaker: _Optional[str] = ..., queue_depth: _Optional[int] = ..., oldest_queued_ms: _Optional[float] = ..., served: _Optional[int] = ..., failovers: _Optional[int] = ..., oom_faults: _Optional[int] = ..., p95_latency_ms: _Optional[float] = ..., latency_window_s: _Optional[float] = ..., device_seconds: _Optional[_Mapping[str, float]] = ...) -> None: ...
