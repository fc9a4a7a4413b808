"""`fleet agent`'s settings, each a flag and a FLEET_AGENT_ variable (see `fleet.settings`).

Light to import: the CLI builds its flags from this model without loading the agent."""

from __future__ import annotations

from typing import Annotated, Literal

from annotated_types import Ge, Gt
from pydantic import Field, field_validator
from pydantic_settings import SettingsConfigDict

from fleet.connect import default_server, parse_servers
from fleet.core.errors import InvalidArgument
from fleet.runtime.disk import DEFAULT_DISK_GIB
from fleet.settings import Flag, Settings

DEFAULT_SLOTS = 2
"""Work items an agent runs at once unless told otherwise."""
DEFAULT_DRAIN_S = 600.0
"""How long an agent told to stop lets its running work go on."""


class AgentSettings(Settings):
    """Everything `fleet agent` takes."""

    model_config = SettingsConfigDict(env_prefix="FLEET_AGENT_")

    host_class: Annotated[Literal["gpu", "cpu"], Flag("--class")]
    """What this host offers: gpu (a GPU, or standing in for one) or cpu."""
    server: Annotated[str, Flag(metavar="HOST:PORT[,HOST:PORT...]")] = Field(
        default_factory=default_server
    )
    """host:port of the fleet server (default $FLEET_SERVER, else 127.0.0.1:50051); replicas
    sharing one ledger comma-separated, in the order they are tried (the agent moves to the
    next when its own is out of reach), or a dns:///NAME:PORT that resolves to them."""
    join: Annotated[str, Flag(metavar="TOKEN")] = ""
    """Enroll with this join token (fleet host token create) unless this host holds a valid
    certificate already."""
    ca_fingerprint: str = ""
    """sha256:… of the fleet CA, to pin it when enrolling (printed by fleet host token
    create)."""
    ca: Annotated[str, Flag(metavar="FILE")] = ""
    """The fleet CA's certificate, instead of a fingerprint."""
    identity_dir: str = ""
    """Where this host keeps its key and certificate ("": $FLEET_HOME/host)."""
    runtime: Literal["auto", "smol", "namespace"] = "auto"
    """The machine runtime: smol microVMs where they boot, else namespace sandboxes (auto)."""
    slots: Annotated[int, Gt(0)] = DEFAULT_SLOTS
    """Work items run at once."""
    label: Annotated[list[str], Flag(metavar="KEY=VALUE")] = []
    """What pools select this host by (repeatable; an enrolled host's labels are its join
    token's)."""
    drain_deadline: str = f"{DEFAULT_DRAIN_S:g}s"
    """On SIGTERM the host takes no new work and what runs goes on this long, then is released
    for retry elsewhere."""
    registry_ca_file: Annotated[str, Flag("--registry-ca", metavar="FILE")] = ""
    """A CA the image registry's certificate chains to (besides the system's and the
    fleet's)."""
    image_cache_gib: Annotated[float, Gt(0)] = 20.0
    """Images fetched from the server kept here, at most (least recently used removed first,
    never one in use)."""
    default_disk_gib: Annotated[int, Ge(0)] = DEFAULT_DISK_GIB
    """A namespace machine's writable layer where its Smolfile sets neither overlay nor
    storage, in GiB (a sparse file; 0: bounded by the host's disk only)."""
    host_id: str = ""
    """This host's name in the fleet ("": from its class, or its enrolled identity)."""
    machines_dir: str = ""
    """Where machines live ("": $FLEET_HOME/machines)."""
    egress_uplink: str = ""
    """Network namespace where machine links end ("": this host, with forwarding and
    masquerade in fleet's own nftables table)."""
    egress_dns: str = ""
    """Resolver the machines' DNS forwarder asks, ADDRESS[:PORT] ("": the first nameserver in
    /etc/resolv.conf)."""
    gateway: str = ""
    """The inference gateway's HTTP endpoint as machines reach it: ADDRESS:PORT, or host:PORT
    for a gateway on this host (rollouts that use inference need it); https://… when it serves
    TLS (verified against the fleet CA)."""

    @field_validator("server")
    @classmethod
    def _servers(cls, value: str) -> str:
        """Each address is checked here, so a typo stops the agent at once, naming it."""
        try:
            return ",".join(parse_servers(value, "the server list"))
        except InvalidArgument as exc:
            raise ValueError(exc.message) from None
