"""Every call a tenant's key may make names the scope it needs: a call left out of the table
falls to the admin scope, so a tenant could not make it at all."""

from __future__ import annotations

from fleet.api.pb import fleet_pb2
from fleet.server.auth import SCOPE_OF, Scope


def test_every_tenant_call_names_its_scope() -> None:
    services = ("FleetService", "SessionService")
    calls = {
        method.name
        for name in services
        for method in fleet_pb2.DESCRIPTOR.services_by_name[name].methods
    }
    missing = sorted(calls - set(SCOPE_OF))
    assert not missing, f"calls with no scope of their own (admin only): {missing}"


def test_a_session_call_that_runs_or_moves_a_machine_needs_the_write_scope() -> None:
    for call in ("OpenSession", "Exec", "ForkSession", "ParkSession", "ResumeSession"):
        assert SCOPE_OF[call] is Scope.ROLLOUTS_WRITE, call
