import datetime

from google.protobuf import timestamp_pb2 as _timestamp_pb2
from fleet.api._proto.fleet.v1 import types_pb2 as _types_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SessionCommand(_message.Message):
    __slots__ = ("call_id", "work_id", "exec", "close", "stdin", "park")
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    WORK_ID_FIELD_NUMBER: _ClassVar[int]
    EXEC_FIELD_NUMBER: _ClassVar[int]
    CLOSE_FIELD_NUMBER: _ClassVar[int]
    STDIN_FIELD_NUMBER: _ClassVar[int]
    PARK_FIELD_NUMBER: _ClassVar[int]
    call_id: str
    work_id: str
    exec: SessionExec
    close: SessionClose
    stdin: SessionStdin
    park: SessionPark
    def __init__(self, call_id: _Optional[str] = ..., work_id: _Optional[str] = ..., exec: _Optional[_Union[SessionExec, _Mapping]] = ..., close: _Optional[_Union[SessionClose, _Mapping]] = ..., stdin: _Optional[_Union[SessionStdin, _Mapping]] = ..., park: _Optional[_Union[SessionPark, _Mapping]] = ...) -> None: ...

class SessionPark(_message.Message):
    __slots__ = ("reason",)
    REASON_FIELD_NUMBER: _ClassVar[int]
    reason: str
    def __init__(self, reason: _Optional[str] = ...) -> None: ...

class SessionParked(_message.Message):
    __slots__ = ("digest", "size")
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    digest: str
    size: int
    def __init__(self, digest: _Optional[str] = ..., size: _Optional[int] = ...) -> None: ...

class SessionStdin(_message.Message):
    __slots__ = ("data", "eof")
    DATA_FIELD_NUMBER: _ClassVar[int]
    EOF_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    eof: bool
    def __init__(self, data: _Optional[bytes] = ..., eof: _Optional[bool] = ...) -> None: ...

class SessionExec(_message.Message):
    __slots__ = ("argv", "env", "cwd", "stdin", "timeout_s", "max_output_bytes", "stdin_follows")
    class EnvEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    ARGV_FIELD_NUMBER: _ClassVar[int]
    ENV_FIELD_NUMBER: _ClassVar[int]
    CWD_FIELD_NUMBER: _ClassVar[int]
    STDIN_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    MAX_OUTPUT_BYTES_FIELD_NUMBER: _ClassVar[int]
    STDIN_FOLLOWS_FIELD_NUMBER: _ClassVar[int]
    argv: _containers.RepeatedScalarFieldContainer[str]
    env: _containers.ScalarMap[str, str]
    cwd: str
    stdin: bytes
    timeout_s: float
    max_output_bytes: int
    stdin_follows: bool
    def __init__(self, argv: _Optional[_Iterable[str]] = ..., env: _Optional[_Mapping[str, str]] = ..., cwd: _Optional[str] = ..., stdin: _Optional[bytes] = ..., timeout_s: _Optional[float] = ..., max_output_bytes: _Optional[int] = ..., stdin_follows: _Optional[bool] = ...) -> None: ...

class SessionClose(_message.Message):
    __slots__ = ("reason",)
    REASON_FIELD_NUMBER: _ClassVar[int]
    reason: str
    def __init__(self, reason: _Optional[str] = ...) -> None: ...

class SessionReply(_message.Message):
    __slots__ = ("call_id", "work_id", "stdout", "stderr", "exit", "error", "ready", "host_id", "parked")
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    WORK_ID_FIELD_NUMBER: _ClassVar[int]
    STDOUT_FIELD_NUMBER: _ClassVar[int]
    STDERR_FIELD_NUMBER: _ClassVar[int]
    EXIT_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    READY_FIELD_NUMBER: _ClassVar[int]
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    PARKED_FIELD_NUMBER: _ClassVar[int]
    call_id: str
    work_id: str
    stdout: bytes
    stderr: bytes
    exit: _types_pb2.ExecExit
    error: str
    ready: bool
    host_id: str
    parked: SessionParked
    def __init__(self, call_id: _Optional[str] = ..., work_id: _Optional[str] = ..., stdout: _Optional[bytes] = ..., stderr: _Optional[bytes] = ..., exit: _Optional[_Union[_types_pb2.ExecExit, _Mapping]] = ..., error: _Optional[str] = ..., ready: _Optional[bool] = ..., host_id: _Optional[str] = ..., parked: _Optional[_Union[SessionParked, _Mapping]] = ...) -> None: ...

class ArtifactPart(_message.Message):
    __slots__ = ("work_id", "fencing_token", "data")
    WORK_ID_FIELD_NUMBER: _ClassVar[int]
    FENCING_TOKEN_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    work_id: str
    fencing_token: int
    data: bytes
    def __init__(self, work_id: _Optional[str] = ..., fencing_token: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class PutArtifactResponse(_message.Message):
    __slots__ = ("digest", "size")
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    digest: str
    size: int
    def __init__(self, digest: _Optional[str] = ..., size: _Optional[int] = ...) -> None: ...

class GetBlobRequest(_message.Message):
    __slots__ = ("digest", "offset", "work_id")
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    WORK_ID_FIELD_NUMBER: _ClassVar[int]
    digest: str
    offset: int
    work_id: str
    def __init__(self, digest: _Optional[str] = ..., offset: _Optional[int] = ..., work_id: _Optional[str] = ...) -> None: ...

class BlobChunk(_message.Message):
    __slots__ = ("offset", "data", "total_size")
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    TOTAL_SIZE_FIELD_NUMBER: _ClassVar[int]
    offset: int
    data: bytes
    total_size: int
    def __init__(self, offset: _Optional[int] = ..., data: _Optional[bytes] = ..., total_size: _Optional[int] = ...) -> None: ...

class ReclaimWorkRequest(_message.Message):
    __slots__ = ("request_id", "host_id", "leases")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    LEASES_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    host_id: str
    leases: _containers.RepeatedCompositeFieldContainer[LeaseRef]
    def __init__(self, request_id: _Optional[str] = ..., host_id: _Optional[str] = ..., leases: _Optional[_Iterable[_Union[LeaseRef, _Mapping]]] = ...) -> None: ...

class ReclaimWorkResponse(_message.Message):
    __slots__ = ("items", "released_work_ids")
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    RELEASED_WORK_IDS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[WorkAssignment]
    released_work_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, items: _Optional[_Iterable[_Union[WorkAssignment, _Mapping]]] = ..., released_work_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class PutCheckpointRequest(_message.Message):
    __slots__ = ("host_id", "work_id", "fencing_token", "sequence", "data")
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    WORK_ID_FIELD_NUMBER: _ClassVar[int]
    FENCING_TOKEN_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    host_id: str
    work_id: str
    fencing_token: int
    sequence: int
    data: bytes
    def __init__(self, host_id: _Optional[str] = ..., work_id: _Optional[str] = ..., fencing_token: _Optional[int] = ..., sequence: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class PutCheckpointResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PutCheckpointsRequest(_message.Message):
    __slots__ = ("checkpoints",)
    CHECKPOINTS_FIELD_NUMBER: _ClassVar[int]
    checkpoints: _containers.RepeatedCompositeFieldContainer[PutCheckpointRequest]
    def __init__(self, checkpoints: _Optional[_Iterable[_Union[PutCheckpointRequest, _Mapping]]] = ...) -> None: ...

class PutCheckpointsResponse(_message.Message):
    __slots__ = ("outcomes",)
    OUTCOMES_FIELD_NUMBER: _ClassVar[int]
    outcomes: _containers.RepeatedCompositeFieldContainer[CheckpointOutcome]
    def __init__(self, outcomes: _Optional[_Iterable[_Union[CheckpointOutcome, _Mapping]]] = ...) -> None: ...

class CheckpointOutcome(_message.Message):
    __slots__ = ("code", "message")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    code: str
    message: str
    def __init__(self, code: _Optional[str] = ..., message: _Optional[str] = ...) -> None: ...

class Capabilities(_message.Message):
    __slots__ = ("runtime", "isolation", "cpus", "memory_mib", "cuda_devices", "slots", "runtime_reason", "device", "gateway", "labels")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    RUNTIME_FIELD_NUMBER: _ClassVar[int]
    ISOLATION_FIELD_NUMBER: _ClassVar[int]
    CPUS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_MIB_FIELD_NUMBER: _ClassVar[int]
    CUDA_DEVICES_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    RUNTIME_REASON_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    GATEWAY_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    runtime: _types_pb2.RuntimeKind
    isolation: _types_pb2.Isolation
    cpus: int
    memory_mib: int
    cuda_devices: int
    slots: int
    runtime_reason: str
    device: str
    gateway: bool
    labels: _containers.ScalarMap[str, str]
    def __init__(self, runtime: _Optional[_Union[_types_pb2.RuntimeKind, str]] = ..., isolation: _Optional[_Union[_types_pb2.Isolation, str]] = ..., cpus: _Optional[int] = ..., memory_mib: _Optional[int] = ..., cuda_devices: _Optional[int] = ..., slots: _Optional[int] = ..., runtime_reason: _Optional[str] = ..., device: _Optional[str] = ..., gateway: _Optional[bool] = ..., labels: _Optional[_Mapping[str, str]] = ...) -> None: ...

class RegisterHostRequest(_message.Message):
    __slots__ = ("request_id", "host_id", "host_class", "capabilities", "agent_version")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    HOST_CLASS_FIELD_NUMBER: _ClassVar[int]
    CAPABILITIES_FIELD_NUMBER: _ClassVar[int]
    AGENT_VERSION_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    host_id: str
    host_class: _types_pb2.HostClass
    capabilities: Capabilities
    agent_version: str
    def __init__(self, request_id: _Optional[str] = ..., host_id: _Optional[str] = ..., host_class: _Optional[_Union[_types_pb2.HostClass, str]] = ..., capabilities: _Optional[_Union[Capabilities, _Mapping]] = ..., agent_version: _Optional[str] = ...) -> None: ...

class RegisterHostResponse(_message.Message):
    __slots__ = ("host_id", "lease_ttl_s", "heartbeat_interval_s", "registry")
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_S_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    REGISTRY_FIELD_NUMBER: _ClassVar[int]
    host_id: str
    lease_ttl_s: float
    heartbeat_interval_s: float
    registry: str
    def __init__(self, host_id: _Optional[str] = ..., lease_ttl_s: _Optional[float] = ..., heartbeat_interval_s: _Optional[float] = ..., registry: _Optional[str] = ...) -> None: ...

class LeaseRef(_message.Message):
    __slots__ = ("work_id", "fencing_token")
    WORK_ID_FIELD_NUMBER: _ClassVar[int]
    FENCING_TOKEN_FIELD_NUMBER: _ClassVar[int]
    work_id: str
    fencing_token: int
    def __init__(self, work_id: _Optional[str] = ..., fencing_token: _Optional[int] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("request_id", "host_id", "leases", "drain_deadline_s", "images_cached", "images_changed")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    LEASES_FIELD_NUMBER: _ClassVar[int]
    DRAIN_DEADLINE_S_FIELD_NUMBER: _ClassVar[int]
    IMAGES_CACHED_FIELD_NUMBER: _ClassVar[int]
    IMAGES_CHANGED_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    host_id: str
    leases: _containers.RepeatedCompositeFieldContainer[LeaseRef]
    drain_deadline_s: float
    images_cached: _containers.RepeatedScalarFieldContainer[str]
    images_changed: bool
    def __init__(self, request_id: _Optional[str] = ..., host_id: _Optional[str] = ..., leases: _Optional[_Iterable[_Union[LeaseRef, _Mapping]]] = ..., drain_deadline_s: _Optional[float] = ..., images_cached: _Optional[_Iterable[str]] = ..., images_changed: _Optional[bool] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("renewed", "stop_work_ids", "lease_expires_at", "heartbeat_interval_s")
    RENEWED_FIELD_NUMBER: _ClassVar[int]
    STOP_WORK_IDS_FIELD_NUMBER: _ClassVar[int]
    LEASE_EXPIRES_AT_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    renewed: _containers.RepeatedCompositeFieldContainer[LeaseRef]
    stop_work_ids: _containers.RepeatedScalarFieldContainer[str]
    lease_expires_at: _timestamp_pb2.Timestamp
    heartbeat_interval_s: float
    def __init__(self, renewed: _Optional[_Iterable[_Union[LeaseRef, _Mapping]]] = ..., stop_work_ids: _Optional[_Iterable[str]] = ..., lease_expires_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., heartbeat_interval_s: _Optional[float] = ...) -> None: ...

class ClaimWorkRequest(_message.Message):
    __slots__ = ("request_id", "host_id", "max_items", "wait_s")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    MAX_ITEMS_FIELD_NUMBER: _ClassVar[int]
    WAIT_S_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    host_id: str
    max_items: int
    wait_s: float
    def __init__(self, request_id: _Optional[str] = ..., host_id: _Optional[str] = ..., max_items: _Optional[int] = ..., wait_s: _Optional[float] = ...) -> None: ...

class WorkAssignment(_message.Message):
    __slots__ = ("work_id", "rollout_id", "attempt", "fencing_token", "lease_expires_at", "manifest", "inference_token", "checkpoint_sequence", "checkpoint", "tenant")
    WORK_ID_FIELD_NUMBER: _ClassVar[int]
    ROLLOUT_ID_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    FENCING_TOKEN_FIELD_NUMBER: _ClassVar[int]
    LEASE_EXPIRES_AT_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    INFERENCE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    work_id: str
    rollout_id: str
    attempt: int
    fencing_token: int
    lease_expires_at: _timestamp_pb2.Timestamp
    manifest: _types_pb2.Manifest
    inference_token: str
    checkpoint_sequence: int
    checkpoint: bytes
    tenant: str
    def __init__(self, work_id: _Optional[str] = ..., rollout_id: _Optional[str] = ..., attempt: _Optional[int] = ..., fencing_token: _Optional[int] = ..., lease_expires_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., manifest: _Optional[_Union[_types_pb2.Manifest, _Mapping]] = ..., inference_token: _Optional[str] = ..., checkpoint_sequence: _Optional[int] = ..., checkpoint: _Optional[bytes] = ..., tenant: _Optional[str] = ...) -> None: ...

class ClaimWorkResponse(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[WorkAssignment]
    def __init__(self, items: _Optional[_Iterable[_Union[WorkAssignment, _Mapping]]] = ...) -> None: ...

class CompleteWorkRequest(_message.Message):
    __slots__ = ("request_id", "host_id", "work_id", "fencing_token", "outcome", "results", "error", "runtime", "device", "egress", "egress_events", "cpu_seconds", "outputs", "peak_memory_mib", "artifact_failed", "claim_max_items")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    WORK_ID_FIELD_NUMBER: _ClassVar[int]
    FENCING_TOKEN_FIELD_NUMBER: _ClassVar[int]
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    RUNTIME_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    EGRESS_FIELD_NUMBER: _ClassVar[int]
    EGRESS_EVENTS_FIELD_NUMBER: _ClassVar[int]
    CPU_SECONDS_FIELD_NUMBER: _ClassVar[int]
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    PEAK_MEMORY_MIB_FIELD_NUMBER: _ClassVar[int]
    ARTIFACT_FAILED_FIELD_NUMBER: _ClassVar[int]
    CLAIM_MAX_ITEMS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    host_id: str
    work_id: str
    fencing_token: int
    outcome: _types_pb2.Outcome
    results: _containers.RepeatedCompositeFieldContainer[_types_pb2.StepResult]
    error: str
    runtime: _types_pb2.RuntimeKind
    device: str
    egress: _types_pb2.EgressPolicy
    egress_events: _containers.RepeatedCompositeFieldContainer[_types_pb2.EgressEvent]
    cpu_seconds: float
    outputs: _containers.RepeatedCompositeFieldContainer[_types_pb2.OutputArtifact]
    peak_memory_mib: float
    artifact_failed: bool
    claim_max_items: int
    def __init__(self, request_id: _Optional[str] = ..., host_id: _Optional[str] = ..., work_id: _Optional[str] = ..., fencing_token: _Optional[int] = ..., outcome: _Optional[_Union[_types_pb2.Outcome, str]] = ..., results: _Optional[_Iterable[_Union[_types_pb2.StepResult, _Mapping]]] = ..., error: _Optional[str] = ..., runtime: _Optional[_Union[_types_pb2.RuntimeKind, str]] = ..., device: _Optional[str] = ..., egress: _Optional[_Union[_types_pb2.EgressPolicy, _Mapping]] = ..., egress_events: _Optional[_Iterable[_Union[_types_pb2.EgressEvent, _Mapping]]] = ..., cpu_seconds: _Optional[float] = ..., outputs: _Optional[_Iterable[_Union[_types_pb2.OutputArtifact, _Mapping]]] = ..., peak_memory_mib: _Optional[float] = ..., artifact_failed: _Optional[bool] = ..., claim_max_items: _Optional[int] = ...) -> None: ...

class CompleteWorkResponse(_message.Message):
    __slots__ = ("state", "items")
    STATE_FIELD_NUMBER: _ClassVar[int]
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    state: _types_pb2.RolloutState
    items: _containers.RepeatedCompositeFieldContainer[WorkAssignment]
    def __init__(self, state: _Optional[_Union[_types_pb2.RolloutState, str]] = ..., items: _Optional[_Iterable[_Union[WorkAssignment, _Mapping]]] = ...) -> None: ...

class EnrollHostRequest(_message.Message):
    __slots__ = ("join_token", "host_id", "csr_pem", "capabilities")
    JOIN_TOKEN_FIELD_NUMBER: _ClassVar[int]
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    CSR_PEM_FIELD_NUMBER: _ClassVar[int]
    CAPABILITIES_FIELD_NUMBER: _ClassVar[int]
    join_token: str
    host_id: str
    csr_pem: bytes
    capabilities: Capabilities
    def __init__(self, join_token: _Optional[str] = ..., host_id: _Optional[str] = ..., csr_pem: _Optional[bytes] = ..., capabilities: _Optional[_Union[Capabilities, _Mapping]] = ...) -> None: ...

class EnrollHostResponse(_message.Message):
    __slots__ = ("host_id", "host_class", "certificate_pem", "ca_pem", "host_port", "expires_at")
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    HOST_CLASS_FIELD_NUMBER: _ClassVar[int]
    CERTIFICATE_PEM_FIELD_NUMBER: _ClassVar[int]
    CA_PEM_FIELD_NUMBER: _ClassVar[int]
    HOST_PORT_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_AT_FIELD_NUMBER: _ClassVar[int]
    host_id: str
    host_class: _types_pb2.HostClass
    certificate_pem: bytes
    ca_pem: bytes
    host_port: int
    expires_at: _timestamp_pb2.Timestamp
    def __init__(self, host_id: _Optional[str] = ..., host_class: _Optional[_Union[_types_pb2.HostClass, str]] = ..., certificate_pem: _Optional[bytes] = ..., ca_pem: _Optional[bytes] = ..., host_port: _Optional[int] = ..., expires_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class RenewCertificateRequest(_message.Message):
    __slots__ = ("csr_pem",)
    CSR_PEM_FIELD_NUMBER: _ClassVar[int]
    csr_pem: bytes
    def __init__(self, csr_pem: _Optional[bytes] = ...) -> None: ...

class RenewCertificateResponse(_message.Message):
    __slots__ = ("certificate_pem", "expires_at")
    CERTIFICATE_PEM_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_AT_FIELD_NUMBER: _ClassVar[int]
    certificate_pem: bytes
    expires_at: _timestamp_pb2.Timestamp
    def __init__(self, certificate_pem: _Optional[bytes] = ..., expires_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...
