from fleet.api._proto.fleet.v1 import types_pb2 as _types_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ListHostsRequest(_message.Message):
    __slots__ = ("unresponsive_after_s",)
    UNRESPONSIVE_AFTER_S_FIELD_NUMBER: _ClassVar[int]
    unresponsive_after_s: float
    def __init__(self, unresponsive_after_s: _Optional[float] = ...) -> None: ...

class HostInfo(_message.Message):
    __slots__ = ("host_id", "host_class", "state", "agent_version", "slots", "slots_used", "last_heartbeat_at", "cert_expires_at", "labels", "images")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    HOST_CLASS_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    AGENT_VERSION_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    SLOTS_USED_FIELD_NUMBER: _ClassVar[int]
    LAST_HEARTBEAT_AT_FIELD_NUMBER: _ClassVar[int]
    CERT_EXPIRES_AT_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    host_id: str
    host_class: _types_pb2.HostClass
    state: str
    agent_version: str
    slots: int
    slots_used: int
    last_heartbeat_at: float
    cert_expires_at: float
    labels: _containers.ScalarMap[str, str]
    images: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, host_id: _Optional[str] = ..., host_class: _Optional[_Union[_types_pb2.HostClass, str]] = ..., state: _Optional[str] = ..., agent_version: _Optional[str] = ..., slots: _Optional[int] = ..., slots_used: _Optional[int] = ..., last_heartbeat_at: _Optional[float] = ..., cert_expires_at: _Optional[float] = ..., labels: _Optional[_Mapping[str, str]] = ..., images: _Optional[_Iterable[str]] = ...) -> None: ...

class ListHostsResponse(_message.Message):
    __slots__ = ("hosts",)
    HOSTS_FIELD_NUMBER: _ClassVar[int]
    hosts: _containers.RepeatedCompositeFieldContainer[HostInfo]
    def __init__(self, hosts: _Optional[_Iterable[_Union[HostInfo, _Mapping]]] = ...) -> None: ...

class HostRequest(_message.Message):
    __slots__ = ("host_id",)
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    host_id: str
    def __init__(self, host_id: _Optional[str] = ...) -> None: ...

class DrainHostRequest(_message.Message):
    __slots__ = ("host_id", "deadline")
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_FIELD_NUMBER: _ClassVar[int]
    host_id: str
    deadline: float
    def __init__(self, host_id: _Optional[str] = ..., deadline: _Optional[float] = ...) -> None: ...

class HostStateResponse(_message.Message):
    __slots__ = ("host_id", "state", "drain_deadline")
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    DRAIN_DEADLINE_FIELD_NUMBER: _ClassVar[int]
    host_id: str
    state: str
    drain_deadline: float
    def __init__(self, host_id: _Optional[str] = ..., state: _Optional[str] = ..., drain_deadline: _Optional[float] = ...) -> None: ...

class RevokeHostResponse(_message.Message):
    __slots__ = ("host_id", "leases_released")
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    LEASES_RELEASED_FIELD_NUMBER: _ClassVar[int]
    host_id: str
    leases_released: int
    def __init__(self, host_id: _Optional[str] = ..., leases_released: _Optional[int] = ...) -> None: ...

class CreateJoinTokenRequest(_message.Message):
    __slots__ = ("host_class", "labels", "ttl_s", "uses", "runtimes")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    HOST_CLASS_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    USES_FIELD_NUMBER: _ClassVar[int]
    RUNTIMES_FIELD_NUMBER: _ClassVar[int]
    host_class: _types_pb2.HostClass
    labels: _containers.ScalarMap[str, str]
    ttl_s: float
    uses: int
    runtimes: _containers.RepeatedScalarFieldContainer[_types_pb2.RuntimeKind]
    def __init__(self, host_class: _Optional[_Union[_types_pb2.HostClass, str]] = ..., labels: _Optional[_Mapping[str, str]] = ..., ttl_s: _Optional[float] = ..., uses: _Optional[int] = ..., runtimes: _Optional[_Iterable[_Union[_types_pb2.RuntimeKind, str]]] = ...) -> None: ...

class JoinTokenInfo(_message.Message):
    __slots__ = ("id", "host_class", "labels", "runtimes", "uses_left", "created_at", "expires_at", "revoked_at")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    ID_FIELD_NUMBER: _ClassVar[int]
    HOST_CLASS_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    RUNTIMES_FIELD_NUMBER: _ClassVar[int]
    USES_LEFT_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_AT_FIELD_NUMBER: _ClassVar[int]
    REVOKED_AT_FIELD_NUMBER: _ClassVar[int]
    id: str
    host_class: _types_pb2.HostClass
    labels: _containers.ScalarMap[str, str]
    runtimes: _containers.RepeatedScalarFieldContainer[_types_pb2.RuntimeKind]
    uses_left: int
    created_at: float
    expires_at: float
    revoked_at: float
    def __init__(self, id: _Optional[str] = ..., host_class: _Optional[_Union[_types_pb2.HostClass, str]] = ..., labels: _Optional[_Mapping[str, str]] = ..., runtimes: _Optional[_Iterable[_Union[_types_pb2.RuntimeKind, str]]] = ..., uses_left: _Optional[int] = ..., created_at: _Optional[float] = ..., expires_at: _Optional[float] = ..., revoked_at: _Optional[float] = ...) -> None: ...

class CreateJoinTokenResponse(_message.Message):
    __slots__ = ("token", "secret", "ca_fingerprint")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    SECRET_FIELD_NUMBER: _ClassVar[int]
    CA_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    token: JoinTokenInfo
    secret: str
    ca_fingerprint: str
    def __init__(self, token: _Optional[_Union[JoinTokenInfo, _Mapping]] = ..., secret: _Optional[str] = ..., ca_fingerprint: _Optional[str] = ...) -> None: ...

class ListJoinTokensRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListJoinTokensResponse(_message.Message):
    __slots__ = ("tokens",)
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedCompositeFieldContainer[JoinTokenInfo]
    def __init__(self, tokens: _Optional[_Iterable[_Union[JoinTokenInfo, _Mapping]]] = ...) -> None: ...

class RevokeRequest(_message.Message):
    __slots__ = ("id",)
    ID_FIELD_NUMBER: _ClassVar[int]
    id: str
    def __init__(self, id: _Optional[str] = ...) -> None: ...

class RevokeResponse(_message.Message):
    __slots__ = ("id", "revoked_at")
    ID_FIELD_NUMBER: _ClassVar[int]
    REVOKED_AT_FIELD_NUMBER: _ClassVar[int]
    id: str
    revoked_at: float
    def __init__(self, id: _Optional[str] = ..., revoked_at: _Optional[float] = ...) -> None: ...

class CreateKeyRequest(_message.Message):
    __slots__ = ("tenant", "scopes", "expires_at")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    SCOPES_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_AT_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    scopes: _containers.RepeatedScalarFieldContainer[str]
    expires_at: float
    def __init__(self, tenant: _Optional[str] = ..., scopes: _Optional[_Iterable[str]] = ..., expires_at: _Optional[float] = ...) -> None: ...

class KeyInfo(_message.Message):
    __slots__ = ("id", "tenant", "scopes", "created_at", "expires_at", "last_used_at", "revoked_at")
    ID_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    SCOPES_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_AT_FIELD_NUMBER: _ClassVar[int]
    LAST_USED_AT_FIELD_NUMBER: _ClassVar[int]
    REVOKED_AT_FIELD_NUMBER: _ClassVar[int]
    id: str
    tenant: str
    scopes: _containers.RepeatedScalarFieldContainer[str]
    created_at: float
    expires_at: float
    last_used_at: float
    revoked_at: float
    def __init__(self, id: _Optional[str] = ..., tenant: _Optional[str] = ..., scopes: _Optional[_Iterable[str]] = ..., created_at: _Optional[float] = ..., expires_at: _Optional[float] = ..., last_used_at: _Optional[float] = ..., revoked_at: _Optional[float] = ...) -> None: ...

class CreateKeyResponse(_message.Message):
    __slots__ = ("key", "secret")
    KEY_FIELD_NUMBER: _ClassVar[int]
    SECRET_FIELD_NUMBER: _ClassVar[int]
    key: KeyInfo
    secret: str
    def __init__(self, key: _Optional[_Union[KeyInfo, _Mapping]] = ..., secret: _Optional[str] = ...) -> None: ...

class ListKeysRequest(_message.Message):
    __slots__ = ("tenant",)
    TENANT_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    def __init__(self, tenant: _Optional[str] = ...) -> None: ...

class ListKeysResponse(_message.Message):
    __slots__ = ("keys",)
    KEYS_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedCompositeFieldContainer[KeyInfo]
    def __init__(self, keys: _Optional[_Iterable[_Union[KeyInfo, _Mapping]]] = ...) -> None: ...

class PoolGates(_message.Message):
    __slots__ = ("p95_ms", "queue_age_ms", "retry_rate", "artifact_failure_rate", "window_s", "min_attempts")
    P95_MS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_AGE_MS_FIELD_NUMBER: _ClassVar[int]
    RETRY_RATE_FIELD_NUMBER: _ClassVar[int]
    ARTIFACT_FAILURE_RATE_FIELD_NUMBER: _ClassVar[int]
    WINDOW_S_FIELD_NUMBER: _ClassVar[int]
    MIN_ATTEMPTS_FIELD_NUMBER: _ClassVar[int]
    p95_ms: float
    queue_age_ms: float
    retry_rate: float
    artifact_failure_rate: float
    window_s: float
    min_attempts: int
    def __init__(self, p95_ms: _Optional[float] = ..., queue_age_ms: _Optional[float] = ..., retry_rate: _Optional[float] = ..., artifact_failure_rate: _Optional[float] = ..., window_s: _Optional[float] = ..., min_attempts: _Optional[int] = ...) -> None: ...

class PoolAdaptive(_message.Message):
    __slots__ = ("start", "step", "backoff", "interval_s")
    START_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    BACKOFF_FIELD_NUMBER: _ClassVar[int]
    INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    start: int
    step: int
    backoff: float
    interval_s: float
    def __init__(self, start: _Optional[int] = ..., step: _Optional[int] = ..., backoff: _Optional[float] = ..., interval_s: _Optional[float] = ...) -> None: ...

class Pool(_message.Message):
    __slots__ = ("name", "host_class", "labels", "max_running", "gates", "adaptive")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    NAME_FIELD_NUMBER: _ClassVar[int]
    HOST_CLASS_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    MAX_RUNNING_FIELD_NUMBER: _ClassVar[int]
    GATES_FIELD_NUMBER: _ClassVar[int]
    ADAPTIVE_FIELD_NUMBER: _ClassVar[int]
    name: str
    host_class: _types_pb2.HostClass
    labels: _containers.ScalarMap[str, str]
    max_running: int
    gates: PoolGates
    adaptive: PoolAdaptive
    def __init__(self, name: _Optional[str] = ..., host_class: _Optional[_Union[_types_pb2.HostClass, str]] = ..., labels: _Optional[_Mapping[str, str]] = ..., max_running: _Optional[int] = ..., gates: _Optional[_Union[PoolGates, _Mapping]] = ..., adaptive: _Optional[_Union[PoolAdaptive, _Mapping]] = ...) -> None: ...

class SetPoolRequest(_message.Message):
    __slots__ = ("pool",)
    POOL_FIELD_NUMBER: _ClassVar[int]
    pool: Pool
    def __init__(self, pool: _Optional[_Union[Pool, _Mapping]] = ...) -> None: ...

class SetPoolResponse(_message.Message):
    __slots__ = ("pool",)
    POOL_FIELD_NUMBER: _ClassVar[int]
    pool: Pool
    def __init__(self, pool: _Optional[_Union[Pool, _Mapping]] = ...) -> None: ...

class PoolInfo(_message.Message):
    __slots__ = ("pool", "members", "running", "slots", "paused_at", "paused_why")
    POOL_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    PAUSED_AT_FIELD_NUMBER: _ClassVar[int]
    PAUSED_WHY_FIELD_NUMBER: _ClassVar[int]
    pool: Pool
    members: _containers.RepeatedScalarFieldContainer[str]
    running: int
    slots: int
    paused_at: float
    paused_why: str
    def __init__(self, pool: _Optional[_Union[Pool, _Mapping]] = ..., members: _Optional[_Iterable[str]] = ..., running: _Optional[int] = ..., slots: _Optional[int] = ..., paused_at: _Optional[float] = ..., paused_why: _Optional[str] = ...) -> None: ...

class ListPoolsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListPoolsResponse(_message.Message):
    __slots__ = ("pools",)
    POOLS_FIELD_NUMBER: _ClassVar[int]
    pools: _containers.RepeatedCompositeFieldContainer[PoolInfo]
    def __init__(self, pools: _Optional[_Iterable[_Union[PoolInfo, _Mapping]]] = ...) -> None: ...

class DeletePoolRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class DeletePoolResponse(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class ListPoolEventsRequest(_message.Message):
    __slots__ = ("window_s", "pool", "limit")
    WINDOW_S_FIELD_NUMBER: _ClassVar[int]
    POOL_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    window_s: float
    pool: str
    limit: int
    def __init__(self, window_s: _Optional[float] = ..., pool: _Optional[str] = ..., limit: _Optional[int] = ...) -> None: ...

class PoolEvent(_message.Message):
    __slots__ = ("seq", "pool", "at", "kind", "cap", "message", "figures")
    class FiguresEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    SEQ_FIELD_NUMBER: _ClassVar[int]
    POOL_FIELD_NUMBER: _ClassVar[int]
    AT_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    CAP_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    FIGURES_FIELD_NUMBER: _ClassVar[int]
    seq: int
    pool: str
    at: float
    kind: str
    cap: int
    message: str
    figures: _containers.ScalarMap[str, float]
    def __init__(self, seq: _Optional[int] = ..., pool: _Optional[str] = ..., at: _Optional[float] = ..., kind: _Optional[str] = ..., cap: _Optional[int] = ..., message: _Optional[str] = ..., figures: _Optional[_Mapping[str, float]] = ...) -> None: ...

class ListPoolEventsResponse(_message.Message):
    __slots__ = ("events",)
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    events: _containers.RepeatedCompositeFieldContainer[PoolEvent]
    def __init__(self, events: _Optional[_Iterable[_Union[PoolEvent, _Mapping]]] = ...) -> None: ...

class RollbackRequest(_message.Message):
    __slots__ = ("deadline", "local_pool")
    DEADLINE_FIELD_NUMBER: _ClassVar[int]
    LOCAL_POOL_FIELD_NUMBER: _ClassVar[int]
    deadline: float
    local_pool: str
    def __init__(self, deadline: _Optional[float] = ..., local_pool: _Optional[str] = ...) -> None: ...

class RollbackResponse(_message.Message):
    __slots__ = ("hosts", "deadline", "local_pool")
    HOSTS_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_FIELD_NUMBER: _ClassVar[int]
    LOCAL_POOL_FIELD_NUMBER: _ClassVar[int]
    hosts: _containers.RepeatedScalarFieldContainer[str]
    deadline: float
    local_pool: str
    def __init__(self, hosts: _Optional[_Iterable[str]] = ..., deadline: _Optional[float] = ..., local_pool: _Optional[str] = ...) -> None: ...

class UndoRollbackRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class UndoRollbackResponse(_message.Message):
    __slots__ = ("hosts",)
    HOSTS_FIELD_NUMBER: _ClassVar[int]
    hosts: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, hosts: _Optional[_Iterable[str]] = ...) -> None: ...

class GetRollbackRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetRollbackResponse(_message.Message):
    __slots__ = ("in_force", "since", "local_pool")
    IN_FORCE_FIELD_NUMBER: _ClassVar[int]
    SINCE_FIELD_NUMBER: _ClassVar[int]
    LOCAL_POOL_FIELD_NUMBER: _ClassVar[int]
    in_force: bool
    since: float
    local_pool: str
    def __init__(self, in_force: _Optional[bool] = ..., since: _Optional[float] = ..., local_pool: _Optional[str] = ...) -> None: ...

class ReportRequest(_message.Message):
    __slots__ = ("window_s", "by_label", "prices")
    class PricesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    WINDOW_S_FIELD_NUMBER: _ClassVar[int]
    BY_LABEL_FIELD_NUMBER: _ClassVar[int]
    PRICES_FIELD_NUMBER: _ClassVar[int]
    window_s: float
    by_label: str
    prices: _containers.ScalarMap[str, float]
    def __init__(self, window_s: _Optional[float] = ..., by_label: _Optional[str] = ..., prices: _Optional[_Mapping[str, float]] = ...) -> None: ...

class ReportGroup(_message.Message):
    __slots__ = ("name", "rollouts", "completed", "attempts", "cost", "cpu_s", "wall_s", "device_s", "peak_memory_mib", "prompt_tokens", "completion_tokens", "token_cost")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ROLLOUTS_FIELD_NUMBER: _ClassVar[int]
    COMPLETED_FIELD_NUMBER: _ClassVar[int]
    ATTEMPTS_FIELD_NUMBER: _ClassVar[int]
    COST_FIELD_NUMBER: _ClassVar[int]
    CPU_S_FIELD_NUMBER: _ClassVar[int]
    WALL_S_FIELD_NUMBER: _ClassVar[int]
    DEVICE_S_FIELD_NUMBER: _ClassVar[int]
    PEAK_MEMORY_MIB_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_COST_FIELD_NUMBER: _ClassVar[int]
    name: str
    rollouts: int
    completed: int
    attempts: int
    cost: float
    cpu_s: float
    wall_s: float
    device_s: float
    peak_memory_mib: float
    prompt_tokens: int
    completion_tokens: int
    token_cost: float
    def __init__(self, name: _Optional[str] = ..., rollouts: _Optional[int] = ..., completed: _Optional[int] = ..., attempts: _Optional[int] = ..., cost: _Optional[float] = ..., cpu_s: _Optional[float] = ..., wall_s: _Optional[float] = ..., device_s: _Optional[float] = ..., peak_memory_mib: _Optional[float] = ..., prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., token_cost: _Optional[float] = ...) -> None: ...

class ReportSlice(_message.Message):
    __slots__ = ("minutes", "completed", "cost")
    MINUTES_FIELD_NUMBER: _ClassVar[int]
    COMPLETED_FIELD_NUMBER: _ClassVar[int]
    COST_FIELD_NUMBER: _ClassVar[int]
    minutes: float
    completed: int
    cost: float
    def __init__(self, minutes: _Optional[float] = ..., completed: _Optional[int] = ..., cost: _Optional[float] = ...) -> None: ...

class PoolPauses(_message.Message):
    __slots__ = ("pool", "times", "seconds")
    POOL_FIELD_NUMBER: _ClassVar[int]
    TIMES_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    pool: str
    times: int
    seconds: float
    def __init__(self, pool: _Optional[str] = ..., times: _Optional[int] = ..., seconds: _Optional[float] = ...) -> None: ...

class PoolCap(_message.Message):
    __slots__ = ("pool", "at", "cap")
    POOL_FIELD_NUMBER: _ClassVar[int]
    AT_FIELD_NUMBER: _ClassVar[int]
    CAP_FIELD_NUMBER: _ClassVar[int]
    pool: str
    at: float
    cap: int
    def __init__(self, pool: _Optional[str] = ..., at: _Optional[float] = ..., cap: _Optional[int] = ...) -> None: ...

class ReportResponse(_message.Message):
    __slots__ = ("since", "until", "by_label", "prices", "groups", "slices", "paused", "caps")
    class PricesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    SINCE_FIELD_NUMBER: _ClassVar[int]
    UNTIL_FIELD_NUMBER: _ClassVar[int]
    BY_LABEL_FIELD_NUMBER: _ClassVar[int]
    PRICES_FIELD_NUMBER: _ClassVar[int]
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    SLICES_FIELD_NUMBER: _ClassVar[int]
    PAUSED_FIELD_NUMBER: _ClassVar[int]
    CAPS_FIELD_NUMBER: _ClassVar[int]
    since: float
    until: float
    by_label: str
    prices: _containers.ScalarMap[str, float]
    groups: _containers.RepeatedCompositeFieldContainer[ReportGroup]
    slices: _containers.RepeatedCompositeFieldContainer[ReportSlice]
    paused: _containers.RepeatedCompositeFieldContainer[PoolPauses]
    caps: _containers.RepeatedCompositeFieldContainer[PoolCap]
    def __init__(self, since: _Optional[float] = ..., until: _Optional[float] = ..., by_label: _Optional[str] = ..., prices: _Optional[_Mapping[str, float]] = ..., groups: _Optional[_Iterable[_Union[ReportGroup, _Mapping]]] = ..., slices: _Optional[_Iterable[_Union[ReportSlice, _Mapping]]] = ..., paused: _Optional[_Iterable[_Union[PoolPauses, _Mapping]]] = ..., caps: _Optional[_Iterable[_Union[PoolCap, _Mapping]]] = ...) -> None: ...
