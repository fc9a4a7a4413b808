"""The scale benchmark (`scripts/bench-scale`) at a tiny scale: 8 simulated hosts with their own
certificates on two `fleet serve` replicas sharing one PostgreSQL database, a replica killed
halfway through, and its closing JSON line read back. And the ledger audit it counts lost and
duplicated rollouts by, on a ledger whose history is known."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from datetime import UTC, datetime

import pytest

from benchmarks.scale import audit
from fleet.core.lifecycle import Outcome
from fleet.core.manifest import Step, SubmitRequest, build_manifest, validate_request
from fleet.core.placement import HostCapabilities, HostClass, Isolation, RuntimeKind
from fleet.core.rollout import Completion, StepResult
from fleet.ledger.store import Ledger
from tests.conftest import REPO
from tests.pgserver import create_database, drop_database

LEASE_TTL_S = 3.0
FIELDS = {
    "hosts", "lost", "duplicated", "heartbeat_core_fraction", "claim_ratio_1000_vs_4",
    "rollouts_per_s_sustained", "submit_to_claim_p50_ms", "submit_to_claim_p99_ms",
    "heartbeats_per_s", "heartbeat_cpu_ms_per_host_min", "pg_commits_per_rollout",
    "pg_row_writes_per_rollout", "failover_hosts", "failover_resume_max_s",
}  # fmt: skip


@pytest.fixture
def database(postgres: str) -> Iterator[str]:
    url = create_database(postgres)
    yield url
    drop_database(postgres, url)


def test_a_tiny_fleet_loses_and_repeats_nothing_when_a_replica_dies(database: str) -> None:
    run = subprocess.run(
        [sys.executable, "-m", "benchmarks.scale", "--db", database, "--hosts", "8",
         "--per-process", "4", "--slots", "2", "--baseline-s", "0.5",
         "--heartbeat-phase-s", "1.5", "--idle-phase-s", "1", "--batch", "16",
         "--rates", "4,8,8", "--step-s", "2", "--lease-ttl-s", str(LEASE_TTL_S),
         "--heartbeat-s", "0.5", "--claim-wait-s", "1"],
        cwd=REPO, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-4000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result.keys() >= FIELDS, FIELDS - result.keys()
    assert result["hosts"] == 8
    assert result["lost"] == 0 and result["duplicated"] == 0 and result["claimed_twice"] == 0
    # Every rollout was submitted and accepted: two batches, then the rising rate.
    assert result["rollouts"] >= 2 * 16 + 4 * 2
    # The killed replica's half of the hosts moved to the other one, within two leases.
    assert result["failover_hosts"] == 4
    assert 0 < result["failover_resume_max_s"] <= 2 * LEASE_TTL_S
    assert result["heartbeats_per_s"] > 0 and result["heartbeat_core_fraction"] > 0
    assert result["claim_ratio_1000_vs_4"] > 0 and result["rollouts_per_s_sustained"] > 0
    assert result["pg_commits_per_rollout"] > 0
    assert "replica 0 killed" in run.stdout


T0 = datetime(2030, 1, 1, tzinfo=UTC).timestamp()


def _submit(ledger: Ledger, key: str) -> str:
    request = SubmitRequest.model_validate(
        {
            "idempotency_key": key,
            "smolfile": 'image = "minimal"\n',
            "steps": (Step(argv=("true",)),),
        }
    )
    now = datetime.fromtimestamp(T0, UTC)
    manifest = build_manifest(request, validate_request(request, now), "sha256:img", now)
    rollout, _ = ledger.submit(request, manifest, T0)
    return rollout.id


def _report(
    ledger: Ledger, host: str, work_id: str, token: int, outcome: Outcome, at: float
) -> None:
    ledger.complete(host, Completion(
        work_id=work_id, fencing_token=token, outcome=outcome, runtime="namespace", device="cpu",
        results=(StepResult(index=0, exit_code=0),),
    ), at)  # fmt: skip


def test_the_audit_counts_work_run_twice_unless_a_host_failed_it(database: str) -> None:
    ledger = Ledger.open(database)
    try:
        for host in ("cpu-1", "cpu-2"):
            ledger.register_host(HostCapabilities(
                host_id=host, host_class=HostClass.CPU, runtime=RuntimeKind.NAMESPACE,
                isolation=Isolation.NAMESPACE, cpus=2, memory_mib=1024, cuda_devices=0,
            ), T0)  # fmt: skip
        ttl = 10.0
        # Run twice by the control plane: its lease expired although its host reported no
        # failure (a replica that forgot it, a host that could not reach either).
        _submit(ledger, "expired")
        [first] = ledger.claim("cpu-1", 1, T0, ttl)
        assert ledger.sweep(T0 + ttl + 1) == 1
        [again] = ledger.claim("cpu-2", 1, T0 + ttl + 2, ttl)
        _report(ledger, "cpu-2", again.work_id, again.fencing_token, Outcome.SUCCEEDED, T0 + 13)
        # Retried because its host said the attempt failed: not a duplicate.
        _submit(ledger, "host-failed")
        [failed] = ledger.claim("cpu-1", 1, T0 + 14, ttl)
        _report(ledger, "cpu-1", failed.work_id, failed.fencing_token, Outcome.TRANSIENT_ERROR,
                T0 + 15)  # fmt: skip
        [retry] = ledger.claim("cpu-2", 1, T0 + 16, ttl)
        assert retry.work_id == failed.work_id
        _report(ledger, "cpu-2", retry.work_id, retry.fencing_token, Outcome.SUCCEEDED, T0 + 17)
        # Run once; and one never run (not final: the benchmark counts it lost).
        _submit(ledger, "once")
        [once] = ledger.claim("cpu-1", 1, T0 + 18, ttl)
        _report(ledger, "cpu-1", once.work_id, once.fencing_token, Outcome.SUCCEEDED, T0 + 19)
        _submit(ledger, "never")
        assert first.rollout_id != once.rollout_id
    finally:
        ledger.engine.dispose()
    assert audit(database) == {"rollouts": 4, "final": 3, "succeeded": 3, "repeated": 1}
