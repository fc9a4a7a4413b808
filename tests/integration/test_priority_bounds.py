"""Priority orders leases across every tenant, so a tenant key may only lower its own work's
priority; raising it above the default needs an admin key."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from fleet.api.pb import fleet_pb2, fleet_pb2_grpc
from fleet.core.placement import HostClass
from fleet.image.store import ImageStore
from tests.integration.harness import harness, request


async def test_a_tenant_key_cannot_raise_its_priority_above_others(
    tmp_path: Path, images: ImageStore
) -> None:
    async with harness(tmp_path, images, secure=True) as h:
        await h.start_agent("cpu-a", HostClass.CPU)
        async with (
            h.connect(h.key("team-a")) as tenant,
            h.connect(h.key("ops", "admin")) as admin,
        ):
            as_tenant = fleet_pb2_grpc.FleetServiceStub(tenant)
            as_admin = fleet_pb2_grpc.FleetServiceStub(admin)
            with pytest.raises(grpc.aio.AioRpcError) as one:
                await as_tenant.SubmitRollout(request(priority=5))
            with pytest.raises(grpc.aio.AioRpcError) as batch:
                await as_tenant.SubmitRollouts(
                    fleet_pb2.SubmitRolloutsRequest(
                        rollouts=[request(priority=-3), request(priority=1)]
                    )
                )
            lowered = await as_tenant.SubmitRollout(request(priority=-5))
            raised = await as_admin.SubmitRollout(request(priority=5, tenant="team-a"))
            listed = await as_tenant.ListRollouts(fleet_pb2.ListRolloutsRequest())

    assert one.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "priority 5" in (one.value.details() or "")
    assert "admin key" in (one.value.details() or "")
    assert batch.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "rollouts[1]" in (batch.value.details() or "")
    assert lowered.created and raised.created
    # Nothing of the refused batch was stored: only the two accepted submissions are there.
    assert {r.id for r in listed.rollouts} == {lowered.rollout.id, raised.rollout.id}
