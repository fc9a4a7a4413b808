"""`fleet serve`'s settings: the server's tunables (`ServerConfig`) and what the command itself
reads (where to listen, the ledger, TLS), each a flag and a FLEET_SERVE_ variable.

Light to import: the CLI builds its flags from these models without loading the server."""

from __future__ import annotations

from typing import Annotated

from annotated_types import Ge, Gt
from pydantic import BaseModel, ConfigDict
from pydantic_settings import SettingsConfigDict

from fleet.connect import DEFAULT_SERVER
from fleet.core.manifest import MAX_DEADLINE
from fleet.settings import NO_FLAG, Flag, Settings

MAX_MESSAGE_BYTES = 4 * 1024 * 1024
Positive = Annotated[float, Gt(0)]
NotNegative = Annotated[float, Ge(0)]


class ServerConfig(BaseModel):
    """Server tunables (each a `fleet serve` flag and a FLEET_SERVE_ variable, through
    `fleet.server.settings.ServeSettings`)."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)

    lease_ttl_s: Positive = 15.0
    """How long a lease lives without a heartbeat."""
    heartbeat_interval_s: Annotated[float, Gt(0), Flag("--heartbeat-s")] = 3.0
    """How often agents are told to beat while the fleet is small (see
    `max_heartbeats_per_s`)."""
    max_heartbeats_per_s: NotNegative = 100.0
    """Beats a second the whole fleet is asked for at most: beyond `heartbeat_interval_s`
    times this many hosts, each beats every hosts/this seconds and leases last at least three
    such intervals (`fleet.core.beat_pace`; 0: every fleet beats at `heartbeat_interval_s`)."""
    sweep_interval_s: Positive = 0.5
    """How often expired leases (an agent that stopped beating) are released for retry."""
    late_sweep_interval_s: Positive = 10.0
    """How often queued work past its deadline is failed. Finding it reads every queued item
    (50,000 queued: 17 ms of the ledger's one writer), so not at every sweep; until then no
    host can take it (a claim passes over work past its deadline)."""
    max_message_bytes: Annotated[int, Gt(0)] = MAX_MESSAGE_BYTES
    """Largest request accepted; bigger ones get RESOURCE_EXHAUSTED."""
    max_active_per_tenant: Annotated[int, Gt(0)] = 100_000
    """Queued plus running rollouts one tenant may have; more are refused with a retry hint."""
    max_deadline_h: Positive = MAX_DEADLINE.total_seconds() / 3600
    """How far ahead a rollout's deadline may be, in hours (its inference token lives no
    longer)."""
    max_running_per_tenant: Annotated[int, Ge(0)] = 0
    """Rollouts of one tenant leased at once across the fleet (0: no limit)."""
    token_secret: Annotated[bytes, NO_FLAG] = b""
    """Signs inference tokens for rollouts that use the gateway (shared with the gateway)."""
    gateway_address: Annotated[str, Flag("--gateway")] = ""
    """The gateway's gRPC address, watched for backpressure ("": no watching)."""
    backpressure_queue_depth: Annotated[int, Gt(0), Flag("--backpressure-depth")] = 256
    """Gateway queue depth at which rollouts that use it stop being started."""
    backpressure_resume_depth: Annotated[int, Ge(0)] = 64
    """Depth at which they start again (below the threshold, so the router does not flap)."""
    gateway_poll_s: Positive = 0.25
    """How often the gateway's queue is read."""
    metrics_listen: str = ""
    """host:port for GET /metrics (Prometheus text); "": no metrics endpoint."""
    artifacts_dir: str = ""
    """Where uploaded inputs and collected outputs are kept ("": beside a SQLite ledger, else
    $FLEET_HOME/artifacts)."""
    max_input_mib: NotNegative = 1024.0
    """A rollout's inputs together, at most."""
    max_output_mib: NotNegative = 1024.0
    """A rollout's outputs together, at most (per attempt)."""
    registry: str = ""
    """An OCI registry repository hosts fetch images from by digest ("": from this server)."""
    artifacts_registry: str = ""
    """Keep inputs and outputs in this OCI registry repository (replicas sharing a ledger
    share it; `artifacts_dir` is then a local cache)."""
    registry_ca: Annotated[bytes, NO_FLAG] = b""
    """A CA registries' certificates chain to, besides the system's and the fleet's."""
    retain_days: NotNegative = 30.0
    """Finished rollouts are deleted with their files this long after they end (0: kept)."""
    retention_interval_s: Positive = 3600.0
    """How often retention runs (and once at start)."""
    govern_interval_s: NotNegative = 1.0
    """How often pools' promotion gates and adaptive caps are judged (0: never)."""

    @property
    def max_deadline_s(self) -> float:
        return self.max_deadline_h * 3600


class ServeSettings(ServerConfig, Settings):
    """Everything `fleet serve` takes."""

    model_config = SettingsConfigDict(env_prefix="FLEET_SERVE_")

    listen: str = DEFAULT_SERVER
    """host:port of the API (rollouts, sessions, admin)."""
    db: str = ""
    """A SQLite file or a postgresql:// URL ("": $FLEET_HOME/ledger.sqlite3); several servers
    may share one PostgreSQL database."""
    tls: bool = False
    """TLS and authentication on a loopback address too (always on beyond loopback unless
    --insecure)."""
    insecure: bool = False
    """No TLS and no authentication, even beyond loopback: any caller may act as any tenant or
    host."""
    host_listen: str = ""
    """host:port of the mutual-TLS endpoint hosts call ("": the --listen host, port 50054)."""
    san: Annotated[list[str], Flag(metavar="NAME")] = []
    """Another name or address the server's certificate carries (repeatable; the listen
    addresses are always in it)."""
    host_cert_ttl: str = "24h"
    """Life of the certificates hosts get (renewed at 2/3)."""
    registry_ca_file: Annotated[str, Flag("--registry-ca", metavar="FILE")] = ""
    """A CA registries' certificates chain to (besides the system's and the fleet's)."""
    price: str = ""
    """Per host-hour, for fleet report: cpu=0.04/h,gpu=2.10/h."""

    def server_config(self, token_secret: bytes, registry_ca: bytes) -> ServerConfig:
        """The server's tunables, with what the command read from files."""
        tunables = self.model_dump(include=set(ServerConfig.model_fields))
        return ServerConfig(**{**tunables, "token_secret": token_secret,
                               "registry_ca": registry_ca})  # fmt: skip
