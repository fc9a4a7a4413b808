"""The ledger's tables (sqlmodel). Times are UTC epoch seconds."""

from __future__ import annotations

from sqlalchemy import BigInteger, Index, text
from sqlmodel import Field, SQLModel

SCHEMA_VERSION = 23

CHECKPOINT_ROW_BYTES = 512
"""What each checkpoint is charged besides its data (a row's cost), so that many tiny ones are
bounded too."""


class SchemaInfo(SQLModel, table=True):
    __tablename__ = "schema_info"

    id: int = Field(default=1, primary_key=True)
    version: int


class ManifestRow(SQLModel, table=True):
    """Immutable: written once under its content digest, never updated."""

    __tablename__ = "manifests"

    digest: str = Field(primary_key=True)
    body: str
    created_at: float


class RolloutRow(SQLModel, table=True):
    __tablename__ = "rollouts"
    __table_args__ = (
        # By state, and within a state by when it finished: the metrics' "finished in the last
        # minute" reads the recent ones only, not every rollout that ever succeeded (revision
        # 0017; it replaced an index on state alone, which it serves as well).
        Index("ix_rollouts_state_finished", "state", "finished_at"),
        # Keyset pages (newest first) of one tenant, of one state, and of a window of
        # creation times (revision 0022).
        Index("ix_rollouts_tenant_seq", "tenant", "seq"),
        Index("ix_rollouts_state_seq", "state", "seq"),
        Index("ix_rollouts_created", "created_at"),
    )

    seq: int | None = Field(default=None, primary_key=True)
    id: str = Field(unique=True, index=True)
    idempotency_key: str = Field(unique=True)
    request_fingerprint: str
    manifest_digest: str = Field(foreign_key="manifests.digest")
    tenant: str
    labels_json: str = "{}"
    state: str
    priority: int = 0
    attempts: int = 0
    error: str = ""
    host_id: str = ""
    runtime: str = ""
    device: str = ""
    results_json: str = "[]"
    egress_json: str = ""
    cpu_s: float = 0.0
    """CPU time of every attempt's machine, summed (schema version 3)."""
    outputs_json: str = Field(default="[]", sa_column_kwargs={"server_default": "[]"})
    """The final attempt's outputs (OutputArtifact list as JSON; schema version 7)."""
    """The effective egress of the final attempt's machine (EffectiveEgress as JSON)."""
    created_at: float
    updated_at: float
    started_at: float | None = None
    finished_at: float | None = None


class RolloutLabel(SQLModel, table=True):
    __tablename__ = "rollout_labels"

    rollout_id: str = Field(primary_key=True, foreign_key="rollouts.id")
    key: str = Field(primary_key=True)
    value: str = Field(index=True)


class WorkItemRow(SQLModel, table=True):
    __tablename__ = "work_items"
    __table_args__ = (
        # A claim's scan: queued items in the order they are leased, so a claim reads the
        # first few it may take instead of sorting every queued item (schema version 15).
        Index("ix_work_items_claim", "state", text("priority DESC"), "not_before", "id"),
    )

    id: str = Field(primary_key=True)
    rollout_id: str = Field(index=True)
    tenant: str = Field(default="default")
    state: str  # QUEUED, LEASED, DONE (looked up through ix_work_items_claim)
    host_class: str
    needs_vm: bool = False
    needs_namespace: bool = False
    """It starts from a parked session's layer, which only the namespace runtime can use."""
    needs_cuda_device: bool = False
    needs_inference: bool = False
    """Its steps call the gateway: held back while the gateway is over its queue threshold."""
    priority: int = 0
    attempt: int = 0
    max_attempts: int = 3
    not_before: float = 0.0
    deadline: float
    lease_owner: str = ""
    fencing_token: int = Field(default=0, sa_type=BigInteger)
    """Grows by a random step at every claim (64-bit, schema version 6)."""
    lease_expires_at: float | None = None
    cancel_requested: bool = False
    result_fingerprint: str = ""
    claim_request_id: str = ""
    """The ClaimWork request that took the current lease: a repeat of it gets the same lease."""
    avoid_host: str = Field(default="", sa_column_kwargs={"server_default": ""})
    """The host whose attempt failed as a host error or lost its lease: others get the retry
    first (schema version 6)."""
    pin_host: str = Field(default="", sa_column_kwargs={"server_default": ""})
    """The only host that may claim it (a session's fork: where its source's machine is;
    schema version 9)."""


class TenantActiveRow(SQLModel, table=True):
    """How many work items each tenant has queued or leased, kept as they change (schema
    version 16): a submission's admission reads one row per tenant instead of counting every
    active item of its tenant (50,000 queued: 24 ms a submission, in the writer's transaction)."""

    __tablename__ = "tenant_active"

    tenant: str = Field(primary_key=True)
    active: int = 0


class AttemptRow(SQLModel, table=True):
    __tablename__ = "attempts"

    id: int | None = Field(default=None, primary_key=True)
    work_id: str = Field(index=True)
    attempt: int
    host_id: str
    fencing_token: int = Field(sa_type=BigInteger)
    started_at: float
    ended_at: float | None = Field(default=None, index=True)
    outcome: str = ""
    error: str = ""
    cpu_s: float = Field(default=0.0, sa_column_kwargs={"server_default": "0"})
    """CPU seconds its machine used, as its agent reported (schema version 13)."""
    peak_memory_mib: float = Field(default=0.0, sa_column_kwargs={"server_default": "0"})
    """The most memory its machine held at once (schema version 13)."""
    device_s: float = Field(default=0.0, sa_column_kwargs={"server_default": "0"})
    """Seconds of the gateway's device its requests took, their share of each batch
    (schema version 14)."""
    artifact_failed: bool = Field(default=False, sa_column_kwargs={"server_default": "0"})
    """It failed to move an artifact: an image fetched, an input placed, an output collected
    (schema version 14)."""
    prompt_tokens: int = Field(
        default=0, sa_type=BigInteger, sa_column_kwargs={"server_default": "0"}
    )
    """Prompt tokens of the language-model answers its requests got, every model together
    (schema version 20; per model: `attempt_tokens`)."""
    completion_tokens: int = Field(
        default=0, sa_type=BigInteger, sa_column_kwargs={"server_default": "0"}
    )
    """Completion tokens of those answers (schema version 20)."""


class AttemptTokensRow(SQLModel, table=True):
    """An attempt's language-model tokens by model, so that each model's are priced at its own
    price (schema version 20). Deleted with its attempt."""

    __tablename__ = "attempt_tokens"

    attempt_id: int = Field(primary_key=True)
    model: str = Field(primary_key=True)
    prompt_tokens: int = Field(default=0, sa_type=BigInteger)
    completion_tokens: int = Field(default=0, sa_type=BigInteger)


class HostRow(SQLModel, table=True):
    __tablename__ = "hosts"

    id: str = Field(primary_key=True)
    host_class: str
    capabilities_json: str
    registered_at: float
    last_heartbeat_at: float
    state: str = Field(default="ready", sa_column_kwargs={"server_default": "ready"})
    """ready; cordoned (no new work; what it holds runs on); draining (no new work; what it
    holds runs until `drain_deadline`, then is released for retry); drained. Schema 8."""
    drain_deadline: float | None = None
    images_json: str = Field(default="[]", sa_column_kwargs={"server_default": "[]"})
    """The digests of the images on its disk, as its agent last said (schema version 14)."""
    """When a draining host's leases are released (schema version 10)."""
    drain_by: str = Field(default="", sa_column_kwargs={"server_default": ""})
    """Who drains it: "operator" (it stays drained), or "agent" (its own shutdown: ready
    again when it registers again). Schema version 10."""


class PoolRow(SQLModel, table=True):
    """A set of hosts chosen by class and labels, with a cap on the work they run at once
    (schema version 11)."""

    __tablename__ = "pools"

    name: str = Field(primary_key=True)
    host_class: str
    labels_json: str = "{}"
    """Every one of these labels, on a host of the class: the host is in the pool."""
    max_running: int = 0
    """Leases its hosts may hold at once, across every server (0: no cap). An adaptive pool's
    controller moves it."""
    updated_at: float = 0.0
    gates_json: str = Field(default="{}", sa_column_kwargs={"server_default": "{}"})
    """Its promotion gates (`fleet.core.gates.Gates`; schema version 14)."""
    adaptive_json: str = Field(default="", sa_column_kwargs={"server_default": ""})
    """How its cap is sought (`fleet.core.adaptive.Adaptive`), or "": a fixed cap."""
    control_json: str = Field(default="{}", sa_column_kwargs={"server_default": "{}"})
    """The adaptive controller's memory (`fleet.core.adaptive.Control`)."""
    paused_at: float | None = None
    """Since when new dispatches to it are paused by a gate (None: they are not)."""
    paused_why: str = Field(default="", sa_column_kwargs={"server_default": ""})


class PoolEventRow(SQLModel, table=True):
    """A pool paused or resumed by its gates, or its cap moved by its controller, with the
    numbers that decided it (append-only; schema version 14)."""

    __tablename__ = "pool_events"

    seq: int | None = Field(default=None, primary_key=True)
    pool: str = Field(index=True)
    at: float = Field(index=True)
    kind: str
    """paused, resumed, raised, lowered, settled."""
    cap: int = 0
    message: str = ""
    figures_json: str = "{}"


class SettingRow(SQLModel, table=True):
    """Fleet-wide operating state every server reads from the ledger (schema version 12):
    `rollback` while a rollback to the local pool is in force."""

    __tablename__ = "settings"

    key: str = Field(primary_key=True)
    value_json: str = "{}"
    updated_at: float = 0.0


class EventRow(SQLModel, table=True):
    """Append-only."""

    __tablename__ = "events"

    seq: int | None = Field(default=None, primary_key=True)
    rollout_id: str = Field(index=True)
    kind: str
    from_state: str = ""
    to_state: str = ""
    actor: str = ""
    at: float
    message: str = ""
    attempt: int = 0


class ArtifactRow(SQLModel, table=True):
    """Content-addressed blobs (step output): written once under their digest."""

    __tablename__ = "artifacts"

    digest: str = Field(primary_key=True)
    size_bytes: int
    data: bytes
    created_at: float


class CheckpointRow(SQLModel, table=True):
    """A hybrid rollout's state between model calls (schema version 3)."""

    __tablename__ = "checkpoints"

    rollout_id: str = Field(primary_key=True)
    seq: int = Field(primary_key=True)
    attempt: int
    data: bytes
    created_at: float


class CheckpointUsageRow(SQLModel, table=True):
    """What a rollout's checkpoints hold, each charged its data plus a row's cost (schema
    version 4). A narrow table of its own: a batch of checkpoints updates few of its pages."""

    __tablename__ = "checkpoint_usage"

    rollout_id: str = Field(primary_key=True)
    bytes: int


class EgressEventRow(SQLModel, table=True):
    """A refused DNS query or connection from a rollout's machine (schema version 2)."""

    __tablename__ = "egress_events"

    seq: int | None = Field(default=None, primary_key=True)
    rollout_id: str = Field(index=True)
    attempt: int
    machine: str
    at: float
    kind: str
    destination: str
    decision: str
    reason: str


class JoinTokenRow(SQLModel, table=True):
    """A token a new host enrolls with (schema version 5). Only the secret's hash is kept."""

    __tablename__ = "join_tokens"

    id: str = Field(primary_key=True)
    secret_hash: str
    host_class: str
    labels_json: str = "{}"
    created_at: float
    expires_at: float
    uses_left: int = 1
    revoked_at: float | None = None
    runtimes: str = Field(default="namespace", sa_column_kwargs={"server_default": "namespace"})
    """Comma-separated RuntimeKind values a host may enroll with (revision 0019; a token made
    before it allows the namespace runtime only, as one made without `--runtime` does)."""


class ApiKeyRow(SQLModel, table=True):
    """A tenant's API key (schema version 5). Only the secret's hash is kept."""

    __tablename__ = "api_keys"

    id: str = Field(primary_key=True)
    secret_hash: str
    tenant: str = Field(index=True)
    scopes: str
    """Comma-separated Scope values."""
    created_at: float
    expires_at: float | None = None
    last_used_at: float | None = None
    revoked_at: float | None = None


class HostIdentityRow(SQLModel, table=True):
    """An enrolled host (schema version 5): what it enrolled as, and whether it is revoked."""

    __tablename__ = "host_identities"

    host_id: str = Field(primary_key=True)
    host_class: str
    labels_json: str = "{}"
    capabilities_json: str
    """The capabilities it enrolled with: it may never claim more."""
    token_id: str = ""
    enrolled_at: float
    cert_serial: str = ""
    cert_expires_at: float = 0.0
    revoked_at: float | None = None
    runtimes: str = Field(default="", sa_column_kwargs={"server_default": ""})
    """Comma-separated RuntimeKind values it may register with: its join token's (revision
    0019; "": the runtime it enrolled with, as for hosts enrolled before it)."""


class SessionParkRow(SQLModel, table=True):
    """A session that was parked (schema version 21): the rollout that holds (or last held)
    its machine, and the layer it was parked with. Callers keep the session's id; each resume
    is a rollout of its own, and calls on the id go to the newest."""

    __tablename__ = "session_parks"
    __table_args__ = (Index("ix_session_parks_rollout", "rollout_id"),)

    session_id: str = Field(primary_key=True)
    rollout_id: str
    layer_digest: str = ""
    layer_size: int = Field(default=0, sa_type=BigInteger)
    parked_from: str = ""
    """The host whose machine it was parked from."""
    state: str
    """PARKED (its layer stored, no machine), RESUMED (`rollout_id` holds it) or CLOSED."""
    updated_at: float
