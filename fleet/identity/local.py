"""Identity for the embedded default: the CA, an admin key for the local user, and the local
agents' certificates, made without any step by hand."""

from __future__ import annotations

import time

import structlog

from fleet.config import Paths
from fleet.core.credentials import Scope, format_api_key, matches, parse_api_key
from fleet.core.errors import FleetError
from fleet.core.placement import LOCAL_LABEL, HostCapabilities
from fleet.identity.ca import CertificateAuthority, csr_for, key_pem, new_key, write_private
from fleet.identity.tls import HostIdentityMaterial
from fleet.ledger.store import Ledger

log = structlog.get_logger(__name__)


def ensure_admin_key(paths: Paths, ledger: Ledger) -> bool:
    """Writes an admin key for the local user to `$FLEET_HOME/admin.key` (mode 0600) unless
    the one there is valid in this ledger; returns whether it wrote one."""
    path = paths.admin_key
    if path.exists():
        try:
            presented = parse_api_key(path.read_text())
            found = ledger.identities.key_row(presented.id)
            if found is not None and matches(presented.secret, found[1]):
                key = found[0]
                if key.revoked_at is None and Scope.ADMIN in key.scopes:
                    return False
        except FleetError:
            pass
    _, presented = ledger.identities.create_key(
        "default", frozenset({Scope.ADMIN}), None, time.time()
    )
    write_private(path, (format_api_key(presented) + "\n").encode())
    log.info("admin_key_written", path=str(path), key_id=presented.id)
    return True


def local_host_identity(
    ca: CertificateAuthority, ledger: Ledger, caps: HostCapabilities, api: str, host_port: int
) -> HostIdentityMaterial:
    """A certificate for an agent of this process's own fleet, enrolled directly by the CA's
    holder (no join token: the key never leaves this process)."""
    key = new_key()
    issued = ca.sign_host_csr(csr_for(key, caps.host_id), caps.host_id)
    ledger.identities.add_host(
        caps.host_id, caps.host_class, caps.model_dump_json(), issued.serial, issued.not_after,
        time.time(), {LOCAL_LABEL: "1"},
    )  # fmt: skip
    return HostIdentityMaterial(key_pem(key), issued.pem, ca.pem, api, host_port)
