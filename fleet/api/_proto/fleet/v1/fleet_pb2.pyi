import datetime

from google.protobuf import timestamp_pb2 as _timestamp_pb2
from fleet.api._proto.fleet.v1 import types_pb2 as _types_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class OpenSessionRequest(_message.Message):
    __slots__ = ("request_id", "idempotency_key", "smolfile", "smolfile_name", "requirements", "labels", "tenant", "idle_timeout_s", "max_lifetime_s", "ready_timeout_s", "models", "max_prompt_tokens", "max_completion_tokens", "on_idle")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    IDEMPOTENCY_KEY_FIELD_NUMBER: _ClassVar[int]
    SMOLFILE_FIELD_NUMBER: _ClassVar[int]
    SMOLFILE_NAME_FIELD_NUMBER: _ClassVar[int]
    REQUIREMENTS_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    IDLE_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    MAX_LIFETIME_S_FIELD_NUMBER: _ClassVar[int]
    READY_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    MODELS_FIELD_NUMBER: _ClassVar[int]
    MAX_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ON_IDLE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    idempotency_key: str
    smolfile: str
    smolfile_name: str
    requirements: _types_pb2.Requirements
    labels: _containers.ScalarMap[str, str]
    tenant: str
    idle_timeout_s: float
    max_lifetime_s: float
    ready_timeout_s: float
    models: _containers.RepeatedScalarFieldContainer[str]
    max_prompt_tokens: int
    max_completion_tokens: int
    on_idle: str
    def __init__(self, request_id: _Optional[str] = ..., idempotency_key: _Optional[str] = ..., smolfile: _Optional[str] = ..., smolfile_name: _Optional[str] = ..., requirements: _Optional[_Union[_types_pb2.Requirements, _Mapping]] = ..., labels: _Optional[_Mapping[str, str]] = ..., tenant: _Optional[str] = ..., idle_timeout_s: _Optional[float] = ..., max_lifetime_s: _Optional[float] = ..., ready_timeout_s: _Optional[float] = ..., models: _Optional[_Iterable[str]] = ..., max_prompt_tokens: _Optional[int] = ..., max_completion_tokens: _Optional[int] = ..., on_idle: _Optional[str] = ...) -> None: ...

class ParkSessionRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class ResumeSessionRequest(_message.Message):
    __slots__ = ("session_id", "ready_timeout_s")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    READY_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    ready_timeout_s: float
    def __init__(self, session_id: _Optional[str] = ..., ready_timeout_s: _Optional[float] = ...) -> None: ...

class ForkSessionRequest(_message.Message):
    __slots__ = ("request_id", "session_id", "count", "idempotency_key", "labels", "idle_timeout_s", "max_lifetime_s", "ready_timeout_s")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    IDEMPOTENCY_KEY_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    IDLE_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    MAX_LIFETIME_S_FIELD_NUMBER: _ClassVar[int]
    READY_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    session_id: str
    count: int
    idempotency_key: str
    labels: _containers.ScalarMap[str, str]
    idle_timeout_s: float
    max_lifetime_s: float
    ready_timeout_s: float
    def __init__(self, request_id: _Optional[str] = ..., session_id: _Optional[str] = ..., count: _Optional[int] = ..., idempotency_key: _Optional[str] = ..., labels: _Optional[_Mapping[str, str]] = ..., idle_timeout_s: _Optional[float] = ..., max_lifetime_s: _Optional[float] = ..., ready_timeout_s: _Optional[float] = ...) -> None: ...

class ForkSessionResponse(_message.Message):
    __slots__ = ("sessions",)
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    sessions: _containers.RepeatedCompositeFieldContainer[Session]
    def __init__(self, sessions: _Optional[_Iterable[_Union[Session, _Mapping]]] = ...) -> None: ...

class Session(_message.Message):
    __slots__ = ("id", "state", "host_id", "tenant", "error", "opened_at", "layer_digest", "layer_size")
    ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    OPENED_AT_FIELD_NUMBER: _ClassVar[int]
    LAYER_DIGEST_FIELD_NUMBER: _ClassVar[int]
    LAYER_SIZE_FIELD_NUMBER: _ClassVar[int]
    id: str
    state: str
    host_id: str
    tenant: str
    error: str
    opened_at: _timestamp_pb2.Timestamp
    layer_digest: str
    layer_size: int
    def __init__(self, id: _Optional[str] = ..., state: _Optional[str] = ..., host_id: _Optional[str] = ..., tenant: _Optional[str] = ..., error: _Optional[str] = ..., opened_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., layer_digest: _Optional[str] = ..., layer_size: _Optional[int] = ...) -> None: ...

class ExecRequest(_message.Message):
    __slots__ = ("session_id", "argv", "shell", "env", "cwd", "stdin", "timeout_s")
    class EnvEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    ARGV_FIELD_NUMBER: _ClassVar[int]
    SHELL_FIELD_NUMBER: _ClassVar[int]
    ENV_FIELD_NUMBER: _ClassVar[int]
    CWD_FIELD_NUMBER: _ClassVar[int]
    STDIN_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    argv: _containers.RepeatedScalarFieldContainer[str]
    shell: str
    env: _containers.ScalarMap[str, str]
    cwd: str
    stdin: bytes
    timeout_s: float
    def __init__(self, session_id: _Optional[str] = ..., argv: _Optional[_Iterable[str]] = ..., shell: _Optional[str] = ..., env: _Optional[_Mapping[str, str]] = ..., cwd: _Optional[str] = ..., stdin: _Optional[bytes] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class ExecOutput(_message.Message):
    __slots__ = ("stdout", "stderr", "exit")
    STDOUT_FIELD_NUMBER: _ClassVar[int]
    STDERR_FIELD_NUMBER: _ClassVar[int]
    EXIT_FIELD_NUMBER: _ClassVar[int]
    stdout: bytes
    stderr: bytes
    exit: _types_pb2.ExecExit
    def __init__(self, stdout: _Optional[bytes] = ..., stderr: _Optional[bytes] = ..., exit: _Optional[_Union[_types_pb2.ExecExit, _Mapping]] = ...) -> None: ...

class WriteFileChunk(_message.Message):
    __slots__ = ("session_id", "path", "data", "mode", "tar")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    TAR_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    path: str
    data: bytes
    mode: int
    tar: bool
    def __init__(self, session_id: _Optional[str] = ..., path: _Optional[str] = ..., data: _Optional[bytes] = ..., mode: _Optional[int] = ..., tar: _Optional[bool] = ...) -> None: ...

class WriteFileResponse(_message.Message):
    __slots__ = ("size",)
    SIZE_FIELD_NUMBER: _ClassVar[int]
    size: int
    def __init__(self, size: _Optional[int] = ...) -> None: ...

class ReadFileRequest(_message.Message):
    __slots__ = ("session_id", "path", "tar")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    TAR_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    path: str
    tar: bool
    def __init__(self, session_id: _Optional[str] = ..., path: _Optional[str] = ..., tar: _Optional[bool] = ...) -> None: ...

class FileChunk(_message.Message):
    __slots__ = ("data",)
    DATA_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    def __init__(self, data: _Optional[bytes] = ...) -> None: ...

class CloseSessionRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class ListSessionsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListSessionsResponse(_message.Message):
    __slots__ = ("sessions",)
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    sessions: _containers.RepeatedCompositeFieldContainer[Session]
    def __init__(self, sessions: _Optional[_Iterable[_Union[Session, _Mapping]]] = ...) -> None: ...

class ListEgressEventsRequest(_message.Message):
    __slots__ = ("rollout_id",)
    ROLLOUT_ID_FIELD_NUMBER: _ClassVar[int]
    rollout_id: str
    def __init__(self, rollout_id: _Optional[str] = ...) -> None: ...

class ListEgressEventsResponse(_message.Message):
    __slots__ = ("events",)
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    events: _containers.RepeatedCompositeFieldContainer[_types_pb2.EgressEvent]
    def __init__(self, events: _Optional[_Iterable[_Union[_types_pb2.EgressEvent, _Mapping]]] = ...) -> None: ...

class SubmitRolloutRequest(_message.Message):
    __slots__ = ("request_id", "idempotency_key", "smolfile", "smolfile_name", "steps", "deadline", "retry", "versions", "labels", "tenant", "requirements", "priority", "inputs", "outputs", "image_upload", "models", "max_prompt_tokens", "max_completion_tokens")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    IDEMPOTENCY_KEY_FIELD_NUMBER: _ClassVar[int]
    SMOLFILE_FIELD_NUMBER: _ClassVar[int]
    SMOLFILE_NAME_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_FIELD_NUMBER: _ClassVar[int]
    RETRY_FIELD_NUMBER: _ClassVar[int]
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    REQUIREMENTS_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    IMAGE_UPLOAD_FIELD_NUMBER: _ClassVar[int]
    MODELS_FIELD_NUMBER: _ClassVar[int]
    MAX_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    idempotency_key: str
    smolfile: str
    smolfile_name: str
    steps: _containers.RepeatedCompositeFieldContainer[_types_pb2.Step]
    deadline: _timestamp_pb2.Timestamp
    retry: _types_pb2.RetryPolicy
    versions: _types_pb2.Versions
    labels: _containers.ScalarMap[str, str]
    tenant: str
    requirements: _types_pb2.Requirements
    priority: int
    inputs: _containers.RepeatedCompositeFieldContainer[_types_pb2.InputFile]
    outputs: _containers.RepeatedScalarFieldContainer[str]
    image_upload: str
    models: _containers.RepeatedScalarFieldContainer[str]
    max_prompt_tokens: int
    max_completion_tokens: int
    def __init__(self, request_id: _Optional[str] = ..., idempotency_key: _Optional[str] = ..., smolfile: _Optional[str] = ..., smolfile_name: _Optional[str] = ..., steps: _Optional[_Iterable[_Union[_types_pb2.Step, _Mapping]]] = ..., deadline: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., retry: _Optional[_Union[_types_pb2.RetryPolicy, _Mapping]] = ..., versions: _Optional[_Union[_types_pb2.Versions, _Mapping]] = ..., labels: _Optional[_Mapping[str, str]] = ..., tenant: _Optional[str] = ..., requirements: _Optional[_Union[_types_pb2.Requirements, _Mapping]] = ..., priority: _Optional[int] = ..., inputs: _Optional[_Iterable[_Union[_types_pb2.InputFile, _Mapping]]] = ..., outputs: _Optional[_Iterable[str]] = ..., image_upload: _Optional[str] = ..., models: _Optional[_Iterable[str]] = ..., max_prompt_tokens: _Optional[int] = ..., max_completion_tokens: _Optional[int] = ...) -> None: ...

class SubmitRolloutResponse(_message.Message):
    __slots__ = ("rollout", "created")
    ROLLOUT_FIELD_NUMBER: _ClassVar[int]
    CREATED_FIELD_NUMBER: _ClassVar[int]
    rollout: _types_pb2.Rollout
    created: bool
    def __init__(self, rollout: _Optional[_Union[_types_pb2.Rollout, _Mapping]] = ..., created: _Optional[bool] = ...) -> None: ...

class SubmitRolloutsRequest(_message.Message):
    __slots__ = ("request_id", "rollouts")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ROLLOUTS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    rollouts: _containers.RepeatedCompositeFieldContainer[SubmitRolloutRequest]
    def __init__(self, request_id: _Optional[str] = ..., rollouts: _Optional[_Iterable[_Union[SubmitRolloutRequest, _Mapping]]] = ...) -> None: ...

class SubmitRolloutsResponse(_message.Message):
    __slots__ = ("rollouts",)
    ROLLOUTS_FIELD_NUMBER: _ClassVar[int]
    rollouts: _containers.RepeatedCompositeFieldContainer[SubmittedRollout]
    def __init__(self, rollouts: _Optional[_Iterable[_Union[SubmittedRollout, _Mapping]]] = ...) -> None: ...

class SubmittedRollout(_message.Message):
    __slots__ = ("id", "created")
    ID_FIELD_NUMBER: _ClassVar[int]
    CREATED_FIELD_NUMBER: _ClassVar[int]
    id: str
    created: bool
    def __init__(self, id: _Optional[str] = ..., created: _Optional[bool] = ...) -> None: ...

class GetRolloutRequest(_message.Message):
    __slots__ = ("id",)
    ID_FIELD_NUMBER: _ClassVar[int]
    id: str
    def __init__(self, id: _Optional[str] = ...) -> None: ...

class ListRolloutsRequest(_message.Message):
    __slots__ = ("page_size", "page_token", "labels", "could_reach")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    COULD_REACH_FIELD_NUMBER: _ClassVar[int]
    page_size: int
    page_token: str
    labels: _containers.ScalarMap[str, str]
    could_reach: str
    def __init__(self, page_size: _Optional[int] = ..., page_token: _Optional[str] = ..., labels: _Optional[_Mapping[str, str]] = ..., could_reach: _Optional[str] = ...) -> None: ...

class ListRolloutsResponse(_message.Message):
    __slots__ = ("rollouts", "next_page_token")
    ROLLOUTS_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    rollouts: _containers.RepeatedCompositeFieldContainer[_types_pb2.Rollout]
    next_page_token: str
    def __init__(self, rollouts: _Optional[_Iterable[_Union[_types_pb2.Rollout, _Mapping]]] = ..., next_page_token: _Optional[str] = ...) -> None: ...

class WatchRolloutRequest(_message.Message):
    __slots__ = ("id", "after_sequence")
    ID_FIELD_NUMBER: _ClassVar[int]
    AFTER_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    id: str
    after_sequence: int
    def __init__(self, id: _Optional[str] = ..., after_sequence: _Optional[int] = ...) -> None: ...

class CancelRolloutRequest(_message.Message):
    __slots__ = ("request_id", "id", "reason")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    id: str
    reason: str
    def __init__(self, request_id: _Optional[str] = ..., id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class BlobPart(_message.Message):
    __slots__ = ("data",)
    DATA_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    def __init__(self, data: _Optional[bytes] = ...) -> None: ...

class PutBlobResponse(_message.Message):
    __slots__ = ("digest", "size")
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    digest: str
    size: int
    def __init__(self, digest: _Optional[str] = ..., size: _Optional[int] = ...) -> None: ...

class GetArtifactRequest(_message.Message):
    __slots__ = ("rollout_id", "digest", "offset")
    ROLLOUT_ID_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    rollout_id: str
    digest: str
    offset: int
    def __init__(self, rollout_id: _Optional[str] = ..., digest: _Optional[str] = ..., offset: _Optional[int] = ...) -> None: ...

class ArtifactChunk(_message.Message):
    __slots__ = ("offset", "data", "total_size")
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    TOTAL_SIZE_FIELD_NUMBER: _ClassVar[int]
    offset: int
    data: bytes
    total_size: int
    def __init__(self, offset: _Optional[int] = ..., data: _Optional[bytes] = ..., total_size: _Optional[int] = ...) -> None: ...
