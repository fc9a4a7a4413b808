import datetime

from google.protobuf import timestamp_pb2 as _timestamp_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class HostClass(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    HOST_CLASS_UNSPECIFIED: _ClassVar[HostClass]
    HOST_CLASS_GPU: _ClassVar[HostClass]
    HOST_CLASS_CPU: _ClassVar[HostClass]

class Isolation(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ISOLATION_UNSPECIFIED: _ClassVar[Isolation]
    ISOLATION_NAMESPACE: _ClassVar[Isolation]
    ISOLATION_VM: _ClassVar[Isolation]

class RuntimeKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    RUNTIME_KIND_UNSPECIFIED: _ClassVar[RuntimeKind]
    RUNTIME_KIND_SMOL: _ClassVar[RuntimeKind]
    RUNTIME_KIND_NAMESPACE: _ClassVar[RuntimeKind]

class RolloutState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ROLLOUT_STATE_UNSPECIFIED: _ClassVar[RolloutState]
    ROLLOUT_STATE_QUEUED: _ClassVar[RolloutState]
    ROLLOUT_STATE_RUNNING: _ClassVar[RolloutState]
    ROLLOUT_STATE_SUCCEEDED: _ClassVar[RolloutState]
    ROLLOUT_STATE_FAILED: _ClassVar[RolloutState]
    ROLLOUT_STATE_CANCELLED: _ClassVar[RolloutState]
    ROLLOUT_STATE_QUARANTINED: _ClassVar[RolloutState]

class Outcome(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    OUTCOME_UNSPECIFIED: _ClassVar[Outcome]
    OUTCOME_SUCCEEDED: _ClassVar[Outcome]
    OUTCOME_STEP_FAILED: _ClassVar[Outcome]
    OUTCOME_TRANSIENT_ERROR: _ClassVar[Outcome]
    OUTCOME_CANCELLED: _ClassVar[Outcome]
    OUTCOME_MALFORMED_INPUT: _ClassVar[Outcome]
    OUTCOME_INCOMPATIBLE: _ClassVar[Outcome]
HOST_CLASS_UNSPECIFIED: HostClass
HOST_CLASS_GPU: HostClass
HOST_CLASS_CPU: HostClass
ISOLATION_UNSPECIFIED: Isolation
ISOLATION_NAMESPACE: Isolation
ISOLATION_VM: Isolation
RUNTIME_KIND_UNSPECIFIED: RuntimeKind
RUNTIME_KIND_SMOL: RuntimeKind
RUNTIME_KIND_NAMESPACE: RuntimeKind
ROLLOUT_STATE_UNSPECIFIED: RolloutState
ROLLOUT_STATE_QUEUED: RolloutState
ROLLOUT_STATE_RUNNING: RolloutState
ROLLOUT_STATE_SUCCEEDED: RolloutState
ROLLOUT_STATE_FAILED: RolloutState
ROLLOUT_STATE_CANCELLED: RolloutState
ROLLOUT_STATE_QUARANTINED: RolloutState
OUTCOME_UNSPECIFIED: Outcome
OUTCOME_SUCCEEDED: Outcome
OUTCOME_STEP_FAILED: Outcome
OUTCOME_TRANSIENT_ERROR: Outcome
OUTCOME_CANCELLED: Outcome
OUTCOME_MALFORMED_INPUT: Outcome
OUTCOME_INCOMPATIBLE: Outcome

class Step(_message.Message):
    __slots__ = ("argv", "env", "workdir", "timeout_s", "name")
    class EnvEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    ARGV_FIELD_NUMBER: _ClassVar[int]
    ENV_FIELD_NUMBER: _ClassVar[int]
    WORKDIR_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    argv: _containers.RepeatedScalarFieldContainer[str]
    env: _containers.ScalarMap[str, str]
    workdir: str
    timeout_s: float
    name: str
    def __init__(self, argv: _Optional[_Iterable[str]] = ..., env: _Optional[_Mapping[str, str]] = ..., workdir: _Optional[str] = ..., timeout_s: _Optional[float] = ..., name: _Optional[str] = ...) -> None: ...

class RetryPolicy(_message.Message):
    __slots__ = ("max_attempts", "initial_backoff_s", "max_backoff_s")
    MAX_ATTEMPTS_FIELD_NUMBER: _ClassVar[int]
    INITIAL_BACKOFF_S_FIELD_NUMBER: _ClassVar[int]
    MAX_BACKOFF_S_FIELD_NUMBER: _ClassVar[int]
    max_attempts: int
    initial_backoff_s: float
    max_backoff_s: float
    def __init__(self, max_attempts: _Optional[int] = ..., initial_backoff_s: _Optional[float] = ..., max_backoff_s: _Optional[float] = ...) -> None: ...

class Versions(_message.Message):
    __slots__ = ("policy", "environment", "evaluator")
    POLICY_FIELD_NUMBER: _ClassVar[int]
    ENVIRONMENT_FIELD_NUMBER: _ClassVar[int]
    EVALUATOR_FIELD_NUMBER: _ClassVar[int]
    policy: str
    environment: str
    evaluator: str
    def __init__(self, policy: _Optional[str] = ..., environment: _Optional[str] = ..., evaluator: _Optional[str] = ...) -> None: ...

class Requirements(_message.Message):
    __slots__ = ("isolation", "cuda_device", "inference", "near_gateway")
    ISOLATION_FIELD_NUMBER: _ClassVar[int]
    CUDA_DEVICE_FIELD_NUMBER: _ClassVar[int]
    INFERENCE_FIELD_NUMBER: _ClassVar[int]
    NEAR_GATEWAY_FIELD_NUMBER: _ClassVar[int]
    isolation: Isolation
    cuda_device: bool
    inference: bool
    near_gateway: bool
    def __init__(self, isolation: _Optional[_Union[Isolation, str]] = ..., cuda_device: _Optional[bool] = ..., inference: _Optional[bool] = ..., near_gateway: _Optional[bool] = ...) -> None: ...

class Manifest(_message.Message):
    __slots__ = ("digest", "smolfile", "smolfile_name", "smolfile_digest", "image_ref", "image_digest", "steps", "deadline", "retry", "versions", "requirements", "host_class", "inputs", "outputs", "session", "models", "max_prompt_tokens", "max_completion_tokens")
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    SMOLFILE_FIELD_NUMBER: _ClassVar[int]
    SMOLFILE_NAME_FIELD_NUMBER: _ClassVar[int]
    SMOLFILE_DIGEST_FIELD_NUMBER: _ClassVar[int]
    IMAGE_REF_FIELD_NUMBER: _ClassVar[int]
    IMAGE_DIGEST_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_FIELD_NUMBER: _ClassVar[int]
    RETRY_FIELD_NUMBER: _ClassVar[int]
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    REQUIREMENTS_FIELD_NUMBER: _ClassVar[int]
    HOST_CLASS_FIELD_NUMBER: _ClassVar[int]
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    MODELS_FIELD_NUMBER: _ClassVar[int]
    MAX_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    digest: str
    smolfile: str
    smolfile_name: str
    smolfile_digest: str
    image_ref: str
    image_digest: str
    steps: _containers.RepeatedCompositeFieldContainer[Step]
    deadline: _timestamp_pb2.Timestamp
    retry: RetryPolicy
    versions: Versions
    requirements: Requirements
    host_class: HostClass
    inputs: _containers.RepeatedCompositeFieldContainer[InputFile]
    outputs: _containers.RepeatedScalarFieldContainer[str]
    session: SessionSpec
    models: _containers.RepeatedScalarFieldContainer[str]
    max_prompt_tokens: int
    max_completion_tokens: int
    def __init__(self, digest: _Optional[str] = ..., smolfile: _Optional[str] = ..., smolfile_name: _Optional[str] = ..., smolfile_digest: _Optional[str] = ..., image_ref: _Optional[str] = ..., image_digest: _Optional[str] = ..., steps: _Optional[_Iterable[_Union[Step, _Mapping]]] = ..., deadline: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., retry: _Optional[_Union[RetryPolicy, _Mapping]] = ..., versions: _Optional[_Union[Versions, _Mapping]] = ..., requirements: _Optional[_Union[Requirements, _Mapping]] = ..., host_class: _Optional[_Union[HostClass, str]] = ..., inputs: _Optional[_Iterable[_Union[InputFile, _Mapping]]] = ..., outputs: _Optional[_Iterable[str]] = ..., session: _Optional[_Union[SessionSpec, _Mapping]] = ..., models: _Optional[_Iterable[str]] = ..., max_prompt_tokens: _Optional[int] = ..., max_completion_tokens: _Optional[int] = ...) -> None: ...

class SessionSpec(_message.Message):
    __slots__ = ("idle_timeout_s", "fork_of", "host", "layer", "layer_size", "on_idle")
    IDLE_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    FORK_OF_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    LAYER_FIELD_NUMBER: _ClassVar[int]
    LAYER_SIZE_FIELD_NUMBER: _ClassVar[int]
    ON_IDLE_FIELD_NUMBER: _ClassVar[int]
    idle_timeout_s: float
    fork_of: str
    host: str
    layer: str
    layer_size: int
    on_idle: str
    def __init__(self, idle_timeout_s: _Optional[float] = ..., fork_of: _Optional[str] = ..., host: _Optional[str] = ..., layer: _Optional[str] = ..., layer_size: _Optional[int] = ..., on_idle: _Optional[str] = ...) -> None: ...

class ExecExit(_message.Message):
    __slots__ = ("exit_code", "timed_out", "oom_killed", "duration_s", "stdout_truncated", "stderr_truncated")
    EXIT_CODE_FIELD_NUMBER: _ClassVar[int]
    TIMED_OUT_FIELD_NUMBER: _ClassVar[int]
    OOM_KILLED_FIELD_NUMBER: _ClassVar[int]
    DURATION_S_FIELD_NUMBER: _ClassVar[int]
    STDOUT_TRUNCATED_FIELD_NUMBER: _ClassVar[int]
    STDERR_TRUNCATED_FIELD_NUMBER: _ClassVar[int]
    exit_code: int
    timed_out: bool
    oom_killed: bool
    duration_s: float
    stdout_truncated: bool
    stderr_truncated: bool
    def __init__(self, exit_code: _Optional[int] = ..., timed_out: _Optional[bool] = ..., oom_killed: _Optional[bool] = ..., duration_s: _Optional[float] = ..., stdout_truncated: _Optional[bool] = ..., stderr_truncated: _Optional[bool] = ...) -> None: ...

class InputFile(_message.Message):
    __slots__ = ("path", "digest", "size", "directory")
    PATH_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    DIRECTORY_FIELD_NUMBER: _ClassVar[int]
    path: str
    digest: str
    size: int
    directory: bool
    def __init__(self, path: _Optional[str] = ..., digest: _Optional[str] = ..., size: _Optional[int] = ..., directory: _Optional[bool] = ...) -> None: ...

class OutputArtifact(_message.Message):
    __slots__ = ("path", "digest", "size", "directory", "error")
    PATH_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    DIRECTORY_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    path: str
    digest: str
    size: int
    directory: bool
    error: str
    def __init__(self, path: _Optional[str] = ..., digest: _Optional[str] = ..., size: _Optional[int] = ..., directory: _Optional[bool] = ..., error: _Optional[str] = ...) -> None: ...

class StepResult(_message.Message):
    __slots__ = ("index", "name", "exit_code", "timed_out", "duration_s", "stdout", "stderr", "stdout_truncated", "stderr_truncated", "stdout_digest", "stderr_digest")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    EXIT_CODE_FIELD_NUMBER: _ClassVar[int]
    TIMED_OUT_FIELD_NUMBER: _ClassVar[int]
    DURATION_S_FIELD_NUMBER: _ClassVar[int]
    STDOUT_FIELD_NUMBER: _ClassVar[int]
    STDERR_FIELD_NUMBER: _ClassVar[int]
    STDOUT_TRUNCATED_FIELD_NUMBER: _ClassVar[int]
    STDERR_TRUNCATED_FIELD_NUMBER: _ClassVar[int]
    STDOUT_DIGEST_FIELD_NUMBER: _ClassVar[int]
    STDERR_DIGEST_FIELD_NUMBER: _ClassVar[int]
    index: int
    name: str
    exit_code: int
    timed_out: bool
    duration_s: float
    stdout: bytes
    stderr: bytes
    stdout_truncated: bool
    stderr_truncated: bool
    stdout_digest: str
    stderr_digest: str
    def __init__(self, index: _Optional[int] = ..., name: _Optional[str] = ..., exit_code: _Optional[int] = ..., timed_out: _Optional[bool] = ..., duration_s: _Optional[float] = ..., stdout: _Optional[bytes] = ..., stderr: _Optional[bytes] = ..., stdout_truncated: _Optional[bool] = ..., stderr_truncated: _Optional[bool] = ..., stdout_digest: _Optional[str] = ..., stderr_digest: _Optional[str] = ...) -> None: ...

class EgressPolicy(_message.Message):
    __slots__ = ("mode", "allow_hosts", "allow_cidrs", "enforced_by")
    class Mode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        MODE_UNSPECIFIED: _ClassVar[EgressPolicy.Mode]
        MODE_OFF: _ClassVar[EgressPolicy.Mode]
        MODE_ALLOWLIST: _ClassVar[EgressPolicy.Mode]
        MODE_OPEN: _ClassVar[EgressPolicy.Mode]
    MODE_UNSPECIFIED: EgressPolicy.Mode
    MODE_OFF: EgressPolicy.Mode
    MODE_ALLOWLIST: EgressPolicy.Mode
    MODE_OPEN: EgressPolicy.Mode
    MODE_FIELD_NUMBER: _ClassVar[int]
    ALLOW_HOSTS_FIELD_NUMBER: _ClassVar[int]
    ALLOW_CIDRS_FIELD_NUMBER: _ClassVar[int]
    ENFORCED_BY_FIELD_NUMBER: _ClassVar[int]
    mode: EgressPolicy.Mode
    allow_hosts: _containers.RepeatedScalarFieldContainer[str]
    allow_cidrs: _containers.RepeatedScalarFieldContainer[str]
    enforced_by: str
    def __init__(self, mode: _Optional[_Union[EgressPolicy.Mode, str]] = ..., allow_hosts: _Optional[_Iterable[str]] = ..., allow_cidrs: _Optional[_Iterable[str]] = ..., enforced_by: _Optional[str] = ...) -> None: ...

class Attempt(_message.Message):
    __slots__ = ("attempt", "host_id", "started_at", "ended_at", "outcome", "error")
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    STARTED_AT_FIELD_NUMBER: _ClassVar[int]
    ENDED_AT_FIELD_NUMBER: _ClassVar[int]
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    attempt: int
    host_id: str
    started_at: _timestamp_pb2.Timestamp
    ended_at: _timestamp_pb2.Timestamp
    outcome: str
    error: str
    def __init__(self, attempt: _Optional[int] = ..., host_id: _Optional[str] = ..., started_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., ended_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., outcome: _Optional[str] = ..., error: _Optional[str] = ...) -> None: ...

class Rollout(_message.Message):
    __slots__ = ("id", "state", "tenant", "idempotency_key", "labels", "manifest", "host_class", "attempts", "results", "error", "host_id", "runtime", "device", "created_at", "started_at", "finished_at", "attempt_history", "priority", "egress", "outputs")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    IDEMPOTENCY_KEY_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    HOST_CLASS_FIELD_NUMBER: _ClassVar[int]
    ATTEMPTS_FIELD_NUMBER: _ClassVar[int]
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    RUNTIME_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    STARTED_AT_FIELD_NUMBER: _ClassVar[int]
    FINISHED_AT_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_HISTORY_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    EGRESS_FIELD_NUMBER: _ClassVar[int]
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    id: str
    state: RolloutState
    tenant: str
    idempotency_key: str
    labels: _containers.ScalarMap[str, str]
    manifest: Manifest
    host_class: HostClass
    attempts: int
    results: _containers.RepeatedCompositeFieldContainer[StepResult]
    error: str
    host_id: str
    runtime: RuntimeKind
    device: str
    created_at: _timestamp_pb2.Timestamp
    started_at: _timestamp_pb2.Timestamp
    finished_at: _timestamp_pb2.Timestamp
    attempt_history: _containers.RepeatedCompositeFieldContainer[Attempt]
    priority: int
    egress: EgressPolicy
    outputs: _containers.RepeatedCompositeFieldContainer[OutputArtifact]
    def __init__(self, id: _Optional[str] = ..., state: _Optional[_Union[RolloutState, str]] = ..., tenant: _Optional[str] = ..., idempotency_key: _Optional[str] = ..., labels: _Optional[_Mapping[str, str]] = ..., manifest: _Optional[_Union[Manifest, _Mapping]] = ..., host_class: _Optional[_Union[HostClass, str]] = ..., attempts: _Optional[int] = ..., results: _Optional[_Iterable[_Union[StepResult, _Mapping]]] = ..., error: _Optional[str] = ..., host_id: _Optional[str] = ..., runtime: _Optional[_Union[RuntimeKind, str]] = ..., device: _Optional[str] = ..., created_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., started_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., finished_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., attempt_history: _Optional[_Iterable[_Union[Attempt, _Mapping]]] = ..., priority: _Optional[int] = ..., egress: _Optional[_Union[EgressPolicy, _Mapping]] = ..., outputs: _Optional[_Iterable[_Union[OutputArtifact, _Mapping]]] = ...) -> None: ...

class RolloutEvent(_message.Message):
    __slots__ = ("sequence", "rollout_id", "kind", "from_state", "to_state", "actor", "at", "message", "attempt")
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    ROLLOUT_ID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    FROM_STATE_FIELD_NUMBER: _ClassVar[int]
    TO_STATE_FIELD_NUMBER: _ClassVar[int]
    ACTOR_FIELD_NUMBER: _ClassVar[int]
    AT_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    sequence: int
    rollout_id: str
    kind: str
    from_state: RolloutState
    to_state: RolloutState
    actor: str
    at: _timestamp_pb2.Timestamp
    message: str
    attempt: int
    def __init__(self, sequence: _Optional[int] = ..., rollout_id: _Optional[str] = ..., kind: _Optional[str] = ..., from_state: _Optional[_Union[RolloutState, str]] = ..., to_state: _Optional[_Union[RolloutState, str]] = ..., actor: _Optional[str] = ..., at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., message: _Optional[str] = ..., attempt: _Optional[int] = ...) -> None: ...

class EgressEvent(_message.Message):
    __slots__ = ("rollout_id", "attempt", "machine", "at", "kind", "destination", "decision", "reason")
    ROLLOUT_ID_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    MACHINE_FIELD_NUMBER: _ClassVar[int]
    AT_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    DESTINATION_FIELD_NUMBER: _ClassVar[int]
    DECISION_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    rollout_id: str
    attempt: int
    machine: str
    at: _timestamp_pb2.Timestamp
    kind: str
    destination: str
    decision: str
    reason: str
    def __init__(self, rollout_id: _Optional[str] = ..., attempt: _Optional[int] = ..., machine: _Optional[str] = ..., at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., kind: _Optional[str] = ..., destination: _Optional[str] = ..., decision: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...
