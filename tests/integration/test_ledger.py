"""The SQLite ledger: idempotent submit, leases with fencing, expiry, retries, cancel, events."""

from __future__ import annotations

import importlib.util
import os
import sqlite3
import threading
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import MetaData, create_engine, text
from sqlmodel import Session, SQLModel

from fleet.artifacts.store import BlobStore
from fleet.core.egress import EffectiveEgress, EgressEvent, EgressMode
from fleet.core.errors import (
    Aborted,
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
)
from fleet.core.lifecycle import Outcome, RolloutState
from fleet.core.manifest import (
    InputFile,
    OutputArtifact,
    SessionSpec,
    Step,
    SubmitRequest,
    build_manifest,
    validate_request,
)
from fleet.core.placement import (
    HostCapabilities,
    HostClass,
    Isolation,
    Pool,
    Requirements,
    RuntimeKind,
)
from fleet.core.retry import RetryPolicy
from fleet.core.rollout import Completion, StepResult
from fleet.ledger import queries as Q
from fleet.ledger.engines import SQLITE_PAGE_BYTES
from fleet.ledger.leases import Claim
from fleet.ledger.migrations import (
    BASELINE,
    LEGACY_TABLES,
    alembic_config,
    compared,
    head_revision,
    legacy_table,
)
from fleet.ledger.raw import QUEUED, Raw, dialect
from fleet.ledger.reads import SETTLE_S
from fleet.ledger.retention import purge_finished, referenced_blobs
from fleet.ledger.store import AVOID_HOST_S, CHECKPOINT_ROW_BYTES, Ledger
from fleet.ledger.tables import SCHEMA_VERSION, SchemaInfo
from tests.pgserver import create_database, drop_database

T0 = datetime(2030, 1, 1, tzinfo=UTC).timestamp()
TTL = 10.0


def submit(ledger: Ledger, key: str = "k1", smolfile: str = 'image = "minimal"\n', **kw: object):  # type: ignore[no-untyped-def]
    body: dict[str, object] = {
        "idempotency_key": key,
        "smolfile": smolfile,
        "steps": (Step(argv=("true",)),),
    }
    body.update(kw)
    req = SubmitRequest.model_validate(body)
    now = datetime.fromtimestamp(T0, UTC)
    manifest = build_manifest(req, validate_request(req, now), "sha256:img", now)
    return ledger.submit(req, manifest, T0)


def register(
    ledger: Ledger,
    host_id: str = "cpu-1",
    host_class: HostClass = HostClass.CPU,
    gateway: bool = False,
) -> None:
    ledger.register_host(
        HostCapabilities(
            host_id=host_id,
            host_class=host_class,
            runtime=RuntimeKind.NAMESPACE,
            isolation=Isolation.NAMESPACE,
            cpus=2,
            memory_mib=1024,
            cuda_devices=0,
            gateway=gateway,
        ),
        T0,
    )


def done(
    work_id: str, token: int, outcome: Outcome = Outcome.SUCCEEDED, out: bytes = b"ok"
) -> Completion:
    return Completion(
        work_id=work_id,
        fencing_token=token,
        outcome=outcome,
        runtime="namespace",
        device="cpu",
        results=(
            StepResult(index=0, exit_code=0 if outcome == Outcome.SUCCEEDED else 1, stdout=out),
        ),
    )


def test_same_key_same_body_returns_the_original(ledger: Ledger) -> None:
    """Resubmitting identically returns the first rollout and creates nothing."""
    first, created = submit(ledger)
    again, created_again = submit(ledger)
    assert created and not created_again
    assert again.id == first.id
    assert len(ledger.list_rollouts(50, "", {})[0]) == 1


def test_same_key_different_body_is_refused(ledger: Ledger) -> None:
    """Reusing a key with another body is ALREADY_EXISTS, saying the body differs."""
    submit(ledger)
    with pytest.raises(AlreadyExists, match="body differs"):
        submit(ledger, smolfile='image = "minimal"\ncpus = 2\n')
    assert len(ledger.list_rollouts(50, "", {})[0]) == 1


def test_claim_leases_with_increasing_fencing_tokens(ledger: Ledger) -> None:
    """A claim leases the item; after expiry a new claim gets attempt 2 and a larger token."""
    register(ledger)
    rollout, _ = submit(ledger)
    [a1] = ledger.claim("cpu-1", 4, T0, TTL)
    assert (a1.attempt, a1.rollout_id) == (1, rollout.id)
    assert ledger.claim("cpu-1", 4, T0, TTL) == []
    assert ledger.get(rollout.id).state == RolloutState.RUNNING
    assert ledger.sweep(T0 + TTL + 1) == 1
    assert ledger.get(rollout.id).state == RolloutState.QUEUED
    [a2] = ledger.claim("cpu-1", 4, T0 + TTL + 60, TTL)
    assert a2.attempt == 2 and a2.fencing_token > a1.fencing_token
    with pytest.raises(Aborted, match="stale fencing token"):
        ledger.complete("cpu-1", done(a1.work_id, a1.fencing_token), T0 + TTL + 61)
    assert ledger.complete("cpu-1", done(a2.work_id, a2.fencing_token), T0 + TTL + 62) == (
        RolloutState.SUCCEEDED
    )
    outcomes = [a.outcome for a in ledger.attempts(rollout.id)]
    assert outcomes == [Outcome.LEASE_EXPIRED.value, Outcome.SUCCEEDED.value]


def test_a_sweep_of_hosts_seen_since_judges_only_their_leases(ledger: Ledger) -> None:
    """What a server that has just started sweeps: only the leases of hosts that beat (or
    registered) since it started are judged; a host not seen since keeps its overdue lease."""
    register(ledger, "cpu-1")
    register(ledger, "cpu-2")
    first, _ = submit(ledger, key="a")
    second, _ = submit(ledger, key="b")
    [a] = ledger.claim("cpu-1", 1, T0, TTL)
    [b] = ledger.claim("cpu-2", 1, T0, TTL)
    later = T0 + TTL + 5
    ledger.heartbeat("cpu-1", [], later - 1, TTL)  # cpu-1 reached the new server; cpu-2 not
    assert ledger.sweep(later, late=False, seen_since=later - 2) == 1
    states = {r.id: r.state for r in (ledger.get(first.id), ledger.get(second.id))}
    assert states[a.rollout_id] == RolloutState.QUEUED  # (its lease was judged: retried)
    assert states[b.rollout_id] == RolloutState.RUNNING  # (not judged yet)
    assert ledger.sweep(later) == 1  # after the hold: judged by the time alone


def test_heartbeat_renews_and_keeps_the_lease(ledger: Ledger) -> None:
    """A renewed lease survives past its first expiry."""
    register(ledger)
    submit(ledger)
    [a] = ledger.claim("cpu-1", 1, T0, TTL)
    renewed, stop = ledger.heartbeat("cpu-1", [(a.work_id, a.fencing_token)], T0 + 8, TTL)
    assert renewed == [(a.work_id, a.fencing_token)] and stop == []
    assert ledger.sweep(T0 + 12) == 0
    with pytest.raises(Aborted, match="stale lease") as info:
        ledger.heartbeat("cpu-1", [(a.work_id, a.fencing_token - 1)], T0 + 13, TTL)
    assert info.value.details == {"stale-work-ids": a.work_id}


def test_completion_is_idempotent_and_single(ledger: Ledger) -> None:
    """The same completion twice is harmless; a different one under the same token is refused."""
    register(ledger)
    rollout, _ = submit(ledger)
    [a] = ledger.claim("cpu-1", 1, T0, TTL)
    assert (
        ledger.complete("cpu-1", done(a.work_id, a.fencing_token), T0 + 1) == RolloutState.SUCCEEDED
    )
    assert (
        ledger.complete("cpu-1", done(a.work_id, a.fencing_token), T0 + 2) == RolloutState.SUCCEEDED
    )
    with pytest.raises(Aborted, match="already has a final result"):
        ledger.complete("cpu-1", done(a.work_id, a.fencing_token, out=b"other"), T0 + 3)
    got = ledger.get(rollout.id)
    assert got.results[0].stdout == b"ok"
    assert ledger.artifact(got.results[0].stdout_digest) == b"ok"
    kinds = [e.kind for e in ledger.events(rollout.id, 0)]
    assert kinds == ["submitted", "leased", "succeeded"]


def test_transient_errors_retry_then_fail(ledger: Ledger) -> None:
    """Transient errors requeue with backoff until max_attempts, then the rollout fails."""
    register(ledger)
    rollout, _ = submit(
        ledger, retry=RetryPolicy(max_attempts=2, initial_backoff_s=1, max_backoff_s=1)
    )
    [a] = ledger.claim("cpu-1", 1, T0, TTL)
    assert ledger.complete(
        "cpu-1", done(a.work_id, a.fencing_token, Outcome.TRANSIENT_ERROR), T0
    ) == (RolloutState.QUEUED)
    assert ledger.claim("cpu-1", 1, T0 + 0.1, TTL) == []  # backoff not over
    [b] = ledger.claim("cpu-1", 1, T0 + 2, TTL)
    assert b.attempt == 2
    assert ledger.complete(
        "cpu-1", done(b.work_id, b.fencing_token, Outcome.TRANSIENT_ERROR), T0 + 3
    ) == (RolloutState.FAILED)
    assert "attempts exhausted" in ledger.get(rollout.id).error


def test_step_failure_is_final_not_retried(ledger: Ledger) -> None:
    """A step that exits non-zero fails the rollout on the first attempt."""
    register(ledger)
    rollout, _ = submit(ledger)
    [a] = ledger.claim("cpu-1", 1, T0, TTL)
    assert ledger.complete("cpu-1", done(a.work_id, a.fencing_token, Outcome.STEP_FAILED), T0) == (
        RolloutState.FAILED
    )
    assert ledger.get(rollout.id).attempts == 1


def test_capability_routing_in_claims(ledger: Ledger) -> None:
    """CUDA work is claimed only by gpu hosts; CPU work only by cpu hosts."""
    register(ledger, "cpu-1", HostClass.CPU)
    register(ledger, "gpu-1", HostClass.GPU)
    gpu_rollout, _ = submit(ledger, key="g", smolfile='image = "minimal"\ncuda = true\n')
    cpu_rollout, _ = submit(ledger, key="c")
    assert [a.rollout_id for a in ledger.claim("cpu-1", 5, T0, TTL)] == [cpu_rollout.id]
    assert [a.rollout_id for a in ledger.claim("gpu-1", 5, T0, TTL)] == [gpu_rollout.id]


def test_cancel_queued_and_running(ledger: Ledger) -> None:
    """Queued work is cancelled at once; running work is stopped at the agent's next beat."""
    register(ledger)
    queued, _ = submit(ledger, key="q")
    assert ledger.cancel(queued.id, "no longer needed", "test", T0).state == RolloutState.CANCELLED
    running, _ = submit(ledger, key="r")
    [a] = ledger.claim("cpu-1", 1, T0, TTL)
    assert ledger.cancel(running.id, "stop", "test", T0 + 1).state == RolloutState.RUNNING
    _, stop = ledger.heartbeat("cpu-1", [(a.work_id, a.fencing_token)], T0 + 2, TTL)
    assert stop == [a.work_id]
    assert ledger.complete(
        "cpu-1", done(a.work_id, a.fencing_token, Outcome.CANCELLED), T0 + 3
    ) == (RolloutState.CANCELLED)
    assert ledger.get(running.id).results  # partial artifacts kept


def test_deadline_passed_before_start_fails(ledger: Ledger) -> None:
    """Queued work whose deadline passed is not started and fails with the reason."""
    register(ledger)
    rollout, _ = submit(ledger, deadline=datetime.fromtimestamp(T0, UTC) + timedelta(seconds=5))
    assert ledger.claim("cpu-1", 1, T0 + 6, TTL) == []
    # A sweep that does not look for late queued work (a server's, between its less frequent
    # looks) leaves it queued; no host can take it meanwhile.
    assert ledger.sweep(T0 + 6, late=False) == 0
    assert ledger.get(rollout.id).state == RolloutState.QUEUED
    assert ledger.claim("cpu-1", 1, T0 + 7, TTL) == []
    assert ledger.sweep(T0 + 8) == 1
    got = ledger.get(rollout.id)
    assert got.state == RolloutState.FAILED and "deadline passed" in got.error


def test_list_pages_and_filters_by_label(ledger: Ledger) -> None:
    """Pages are newest first with an opaque token; label filters match every given label."""
    for i in range(5):
        submit(ledger, key=f"k{i}", labels={"suite": "a" if i % 2 == 0 else "b", "n": str(i)})
    page, token = ledger.list_rollouts(2, "", {})
    assert len(page) == 2 and token
    rest, token2 = ledger.list_rollouts(10, token, {})
    assert len(rest) == 3 and token2 == ""
    assert {r.id for r in page}.isdisjoint({r.id for r in rest})
    only_a, _ = ledger.list_rollouts(10, "", {"suite": "a"})
    assert sorted(r.labels["n"] for r in only_a) == ["0", "2", "4"]
    assert ledger.list_rollouts(10, "", {"suite": "a", "n": "2"})[0][0].labels["n"] == "2"
    with pytest.raises(InvalidArgument, match="page_token"):
        ledger.list_rollouts(10, "garbage", {})


def test_unknown_ids_and_hosts(ledger: Ledger) -> None:
    """Unknown rollouts are NOT_FOUND; an unregistered host cannot claim."""
    with pytest.raises(NotFound):
        ledger.get("r-missing")
    with pytest.raises(FailedPrecondition, match="not registered"):
        ledger.claim("ghost", 1, T0, TTL)


def test_a_newer_schema_is_refused(ledger_target: str) -> None:
    """A server refuses a database whose schema is newer than it knows, saying so."""
    ledger = Ledger.open(ledger_target)
    with Session(ledger.engine) as s, s.begin():
        info = s.get(SchemaInfo, 1)
        assert info is not None
        info.version = SCHEMA_VERSION + 1
        s.add(info)
    ledger.engine.dispose()
    with pytest.raises(FailedPrecondition, match="newer than this fleet knows"):
        Ledger.open(ledger_target)


def test_a_revision_this_fleet_does_not_know_is_refused(ledger_target: str) -> None:
    """A database a newer fleet upgraded (its alembic revision unknown here) is refused."""

    ledger = Ledger.open(ledger_target)
    with ledger.engine.begin() as conn:
        assert conn.execute(text("SELECT version_num FROM alembic_version")).scalar_one() == (
            head_revision()
        )
        conn.execute(text("UPDATE alembic_version SET version_num = '9999'"))
    ledger.engine.dispose()
    with pytest.raises(FailedPrecondition, match="version 9999, newer than this fleet knows"):
        Ledger.open(ledger_target)


def test_the_revisions_build_exactly_the_tables_fleet_defines(ledger_target: str) -> None:
    """alembic's comparison of the upgraded database with the table definitions finds nothing
    (`alembic check`, which scripts/test also runs, on SQLite and PostgreSQL)."""

    ledger = Ledger.open(ledger_target)
    assert int(head_revision()) == SCHEMA_VERSION == ledger.schema_version
    with ledger.engine.connect() as conn:
        opts = {"compare_type": True, "include_object": compared}
        context = MigrationContext.configure(conn, opts=opts)
        assert compare_metadata(context, SQLModel.metadata) == []
    ledger.engine.dispose()


def test_legacy_steps_create_the_tables_the_baseline_does(tmp_path: Path) -> None:
    """A database from before the baseline gets some tables whole from today's definitions, then
    is stamped 0014: those tables must be the baseline's, or the revisions after it would
    upgrade a table that is not what they expect."""

    engine = create_engine(f"sqlite:///{tmp_path / 'baseline.sqlite3'}")
    legacy = MetaData()
    for name in sorted(LEGACY_TABLES):
        legacy_table(name, legacy)

    def only_legacy(obj: object, name: str | None, type_: str, *rest: object) -> bool:
        table = getattr(obj, "table", obj)
        return getattr(table, "name", name) in LEGACY_TABLES

    with engine.begin() as conn:
        command.upgrade(alembic_config(conn), BASELINE)
        opts = {"compare_type": True, "include_object": only_legacy}
        assert compare_metadata(MigrationContext.configure(conn, opts=opts), legacy) == []
    engine.dispose()


def test_a_claim_reads_queued_work_in_lease_order_without_sorting(ledger_target: str) -> None:
    """ix_work_items_claim (written by hand: alembic cannot compare it) holds queued items in
    the order claims lease them, so a claim reads the first few instead of sorting them all."""

    ledger = Ledger.open(ledger_target)
    with ledger.engine.connect() as conn:
        if ledger.engine.dialect.name == "sqlite":
            [definition] = conn.execute(
                text("SELECT sql FROM sqlite_master WHERE name = 'ix_work_items_claim'")
            ).scalars()
            # The claim's own statement, as SQLite runs it.
            scan = dialect(Q.CLAIMABLE, postgres=False, n=1)
            cursor = conn.connection.cursor()
            params = ["QUEUED", "cpu", "cpu", 1.0, 1.0, "h", "h", 0.0, "h", 0.0, True, True,
                      True, True, "", 32]  # fmt: skip
            plan = " ".join(str(r[3]) for r in cursor.execute(f"EXPLAIN QUERY PLAN {scan}", params))
            assert "ix_work_items_claim" in plan and "TEMP B-TREE" not in plan, plan
        else:
            [definition] = conn.execute(
                text("SELECT indexdef FROM pg_indexes WHERE indexname = 'ix_work_items_claim'")
            ).scalars()
            # A burst of submissions the planner has no statistics for yet (no ANALYZE has
            # run): without CLAIM_IN_LEASE_ORDER, PostgreSQL 15 fetches every due item and
            # sorts them (seen from about 3,000; at 1,000 it reads the index in order anyway).
            now = datetime.fromtimestamp(T0, UTC)
            burst = []
            for i in range(3000):
                req = SubmitRequest(
                    idempotency_key=f"burst-{i}", smolfile='image = "minimal"\n',
                    steps=(Step(argv=("true",)),),
                )  # fmt: skip
                burst.append(
                    (req, build_manifest(req, validate_request(req, now), "sha256:i", now))
                )
            ledger.submit_many(burst, T0)
            cursor = conn.connection.cursor()
            cursor.execute(Q.CLAIM_IN_LEASE_ORDER)
            params = [QUEUED, "cpu", "cpu", T0 + 1, T0 + 1, "h", "h", 0.0, "h", 0.0, True, True,
                      True, True, "", 32]  # fmt: skip
            scan = dialect(Q.CLAIMABLE, postgres=True, n=1)
            plan = "\n".join(str(r[0]) for r in cursor.execute(f"EXPLAIN {scan}", params))
            assert "Index Scan using ix_work_items_claim" in plan and "Sort" not in plan, plan
            conn.connection.rollback()
    assert "priority DESC" in definition
    ledger.engine.dispose()


def test_acknowledged_submissions_survive_reopen(ledger_target: str) -> None:
    """What the ledger acknowledged is there after the process reopens the database."""
    ledger = Ledger.open(ledger_target)
    rollout, _ = submit(ledger)
    ledger.engine.dispose()
    reopened = Ledger.open(ledger_target)
    assert reopened.get(rollout.id).idempotency_key == "k1"
    assert reopened.schema_version == SCHEMA_VERSION
    reopened.engine.dispose()


def test_repeated_claim_gets_the_same_leases(ledger: Ledger) -> None:
    """The same claim answered twice hands out the same leases, not new ones."""
    register(ledger)
    submit(ledger, key="a")
    submit(ledger, key="b")
    first = ledger.claim("cpu-1", 1, T0, TTL, request_id="claim-1")
    again = ledger.claim("cpu-1", 1, T0 + 1, TTL, request_id="claim-1")
    assert [(x.work_id, x.fencing_token, x.attempt) for x in again] == [
        (x.work_id, x.fencing_token, x.attempt) for x in first
    ]
    other = ledger.claim("cpu-1", 1, T0 + 2, TTL, request_id="claim-2")
    assert other and other[0].work_id != first[0].work_id


def test_failure_classes(ledger: Ledger) -> None:
    """Malformed input is quarantined and incompatibility fails fast; neither is retried."""
    register(ledger)
    bad, _ = submit(ledger, key="bad")
    odd, _ = submit(ledger, key="odd")
    leases = {a.rollout_id: a for a in ledger.claim("cpu-1", 2, T0, TTL)}
    a, b = leases[bad.id], leases[odd.id]
    assert ledger.complete(
        "cpu-1", done(a.work_id, a.fencing_token, Outcome.MALFORMED_INPUT), T0
    ) == (RolloutState.QUARANTINED)
    assert ledger.complete("cpu-1", done(b.work_id, b.fencing_token, Outcome.INCOMPATIBLE), T0) == (
        RolloutState.FAILED
    )
    assert ledger.get(bad.id).attempts == 1 and "quarantined" in ledger.get(bad.id).error
    assert "incompatible" in ledger.get(odd.id).error


def test_attempt_history_is_kept(ledger: Ledger) -> None:
    """Each attempt has a row: host, start, end, outcome, error."""
    register(ledger)
    rollout, _ = submit(ledger, retry=RetryPolicy(max_attempts=3, initial_backoff_s=0.1))
    [a] = ledger.claim("cpu-1", 1, T0, TTL)
    ledger.complete("cpu-1", done(a.work_id, a.fencing_token, Outcome.TRANSIENT_ERROR), T0 + 1)
    [b] = ledger.claim("cpu-1", 1, T0 + 5, TTL)
    ledger.complete("cpu-1", done(b.work_id, b.fencing_token), T0 + 6)
    history = ledger.get(rollout.id).attempt_history
    assert [(h.attempt, h.host_id, h.outcome) for h in history] == [
        (1, "cpu-1", "TRANSIENT_ERROR"),
        (2, "cpu-1", "SUCCEEDED"),
    ]
    assert all(h.ended_at is not None and h.ended_at >= h.started_at for h in history)


def test_priorities_are_honoured_when_claiming(ledger: Ledger) -> None:
    """Higher priority work is leased first, whatever the submission order."""
    register(ledger)
    low, _ = submit(ledger, key="low", priority=0)
    high, _ = submit(ledger, key="high", priority=10)
    assert [a.rollout_id for a in ledger.claim("cpu-1", 1, T0, TTL)] == [high.id]
    assert [a.rollout_id for a in ledger.claim("cpu-1", 1, T0, TTL)] == [low.id]


def test_tenant_limits(ledger: Ledger) -> None:
    """Over its active limit a tenant is refused with a hint; the running limit caps leases."""
    register(ledger)
    submit(ledger, key="t1", tenant="team-a")
    submit(ledger, key="t2", tenant="team-a")
    with pytest.raises(ResourceExhausted, match="team-a") as info:
        ledger.submit(*_req_manifest("t3", tenant="team-a"), T0, max_active_per_tenant=2)
    assert info.value.retry_after_s
    ledger.submit(*_req_manifest("t4", tenant="team-b"), T0, max_active_per_tenant=2)
    # The same key again is answered even at the limit: nothing new is stored.
    ledger.submit(*_req_manifest("t1", tenant="team-a"), T0, max_active_per_tenant=2)
    leased = ledger.claim("cpu-1", 5, T0, TTL, max_running_per_tenant=1)
    tenants = sorted(ledger.get(a.rollout_id).tenant for a in leased)
    assert tenants == ["team-a", "team-b"]
    # Each assignment names its tenant (agents key warm parents by it).
    assert sorted(a.tenant for a in leased) == tenants


def _req_manifest(key: str, **kw: object):  # type: ignore[no-untyped-def]
    body: dict[str, object] = {
        "idempotency_key": key,
        "smolfile": 'image = "minimal"\n',
        "steps": (Step(argv=("true",)),),
    }
    body.update(kw)
    req = SubmitRequest.model_validate(body)
    now = datetime.fromtimestamp(T0, UTC)
    return req, build_manifest(req, validate_request(req, now), "sha256:img", now)


def test_reviewers_can_ask_which_rollouts_could_reach_a_host(ledger: Ledger) -> None:
    """Each rollout keeps the egress its machine had; could_reach filters on it."""

    register(ledger)
    policies = {
        "allow": EffectiveEgress(mode=EgressMode.ALLOWLIST, allow_hosts=("pypi.org",)),
        "off": EffectiveEgress(mode=EgressMode.OFF),
        "open": EffectiveEgress(mode=EgressMode.OPEN),
    }
    ids = {}
    for name in policies:
        rollout, _ = submit(ledger, key=name)
        ids[rollout.id] = name
    for a in ledger.claim("cpu-1", 5, T0, TTL):
        report = done(a.work_id, a.fencing_token).model_copy(
            update={"egress": policies[ids[a.rollout_id]]}
        )
        ledger.complete("cpu-1", report, T0 + 1)
    reach = {ids[r.id] for r in ledger.list_rollouts(50, "", {}, "files.pypi.org")[0]}
    assert reach == {"allow", "open"}
    assert {ids[r.id] for r in ledger.list_rollouts(50, "", {}, "example.com")[0]} == {"open"}
    kept = {ids[r.id]: r.egress for r in ledger.list_rollouts(50, "", {})[0]}
    assert kept["off"] == policies["off"]


def test_egress_events_are_kept_per_attempt_and_never_twice(ledger: Ledger) -> None:
    """Refusals arrive with the completion; a resent completion adds none."""

    register(ledger)
    rollout, _ = submit(ledger, key="egress")
    [a] = ledger.claim("cpu-1", 1, T0, TTL)
    events = (
        EgressEvent(at=T0 + 0.5, machine="m1", kind="dns", destination="evil.example",
                    reason="not in allow_hosts"),
        EgressEvent(at=T0 + 0.6, machine="m1", kind="connect",
                    destination="tcp://169.254.169.254:80", reason="cloud metadata service"),
    )  # fmt: skip
    report = done(a.work_id, a.fencing_token).model_copy(update={"egress_events": events})
    ledger.complete("cpu-1", report, T0 + 1)
    ledger.complete("cpu-1", report, T0 + 2)  # resent: idempotent
    kept = ledger.egress_events(rollout.id)
    assert [(attempt, e) for attempt, e in kept] == [(1, events[0]), (1, events[1])]
    other, _ = submit(ledger, key="quiet")
    assert ledger.egress_events(other.id) == []
    with pytest.raises(NotFound):
        ledger.egress_events("r-missing")


def test_backpressure_holds_only_rollouts_that_call_the_gateway(ledger: Ledger) -> None:
    """With hold_inference, CPU-only work is claimed and gateway work waits; then it goes."""

    register(ledger)
    register(ledger, "cpu-gw", gateway=True)
    plain, _ = submit(ledger, key="plain")
    model, _ = submit(ledger, key="model", requirements=Requirements(inference=True))
    held = ledger.claim("cpu-gw", 10, T0, TTL, hold_inference=True)
    assert [a.rollout_id for a in held] == [plain.id]
    assert ledger.claim("cpu-1", 10, T0, TTL) == []  # no gateway known there: never its work
    later = ledger.claim("cpu-gw", 10, T0, TTL)
    assert [a.rollout_id for a in later] == [model.id]
    assert later[0].manifest.requirements.inference


def test_a_pinned_item_is_claimed_by_its_host_only(ledger: Ledger) -> None:
    """A session's fork runs where its source's machine is: no other host may take it."""

    register(ledger)
    register(ledger, "cpu-2")
    fork, _ = submit(
        ledger, key="fork", steps=(), session=SessionSpec(fork_of="r-source", host="cpu-2")
    )
    assert ledger.claim("cpu-1", 10, T0, TTL) == []
    [a] = ledger.claim("cpu-2", 10, T0, TTL)
    assert a.rollout_id == fork.id
    assert a.manifest.session is not None and a.manifest.session.fork_of == "r-source"


def before_alembic(ledger: Ledger, version: int) -> None:
    """Makes `ledger`'s database one from before the alembic baseline, rows kept: the revisions
    after the baseline undone (their own downgrades), alembic's table gone, `schema_info` at
    `version` (the caller drops what that version lacked)."""

    with ledger.engine.begin() as conn:
        command.downgrade(alembic_config(conn), BASELINE)
        conn.execute(text("DROP TABLE alembic_version"))
        conn.execute(text("UPDATE schema_info SET version = :v WHERE id = 1"), {"v": version})


def test_a_version_2_ledger_is_migrated_in_place(ledger_target: str) -> None:
    """Opening an older database adds what the newer schema has and keeps its rows."""

    ledger = Ledger.open(ledger_target)
    rollout, _ = submit(ledger)
    before_alembic(ledger, 2)
    with ledger.engine.begin() as conn:
        conn.execute(text("ALTER TABLE work_items DROP COLUMN needs_inference"))
        conn.execute(text("ALTER TABLE hosts DROP COLUMN state"))
        conn.execute(text("ALTER TABLE work_items DROP COLUMN pin_host"))
        conn.execute(text("ALTER TABLE attempts DROP COLUMN device_s"))
        conn.execute(text("ALTER TABLE pools DROP COLUMN gates_json"))
        conn.execute(text("DROP TABLE pool_events"))
    ledger.engine.dispose()
    reopened = Ledger.open(ledger_target)
    assert reopened.schema_version == SCHEMA_VERSION == 23
    register(reopened)
    assert reopened.host_states() == {"cpu-1": "ready"}  # (the column came back, defaulted)
    [a] = reopened.claim("cpu-1", 1, T0, TTL, hold_inference=True)
    assert a.rollout_id == rollout.id
    reopened.engine.dispose()


def test_a_version_3_ledger_gets_its_checkpoints_charged(ledger_target: str) -> None:
    """Schema 4 counts the checkpoints a version 3 database already holds against their
    rollouts' budgets."""

    ledger = Ledger.open(ledger_target)
    register(ledger)
    rollout, _ = submit(ledger)
    [a] = ledger.claim("cpu-1", 1, T0, TTL)
    ledger.put_checkpoint("cpu-1", a.work_id, a.fencing_token, 1, b"x" * 100, T0)
    before_alembic(ledger, 3)
    with ledger.engine.begin() as conn:
        conn.execute(text("DROP TABLE checkpoint_usage"))
    ledger.engine.dispose()
    reopened = Ledger.open(ledger_target)
    assert reopened.schema_version == SCHEMA_VERSION
    with reopened.engine.begin() as conn:
        held = conn.execute(
            text("SELECT bytes FROM checkpoint_usage WHERE rollout_id = :id"), {"id": rollout.id}
        ).scalar_one()
    assert held == 100 + CHECKPOINT_ROW_BYTES
    reopened.engine.dispose()


def test_reclaim_after_agent_restart_keeps_only_leases_still_held(ledger: Ledger) -> None:
    """A restarted agent gets back the work still leased to it under the same token; the rest
    (cancelled, leased again, stale token, another host's, unnamed) is released at once."""
    register(ledger)
    register(ledger, "cpu-2")
    kept, _ = submit(ledger, key="kept")
    cancelled, _ = submit(ledger, key="cancelled")
    unnamed, _ = submit(ledger, key="unnamed")
    leases = {a.rollout_id: a for a in ledger.claim("cpu-1", 3, T0, TTL)}
    other, _ = submit(ledger, key="other")
    [theirs] = ledger.claim("cpu-2", 1, T0, TTL)
    ledger.cancel(cancelled.id, "stop", "test", T0 + 1)
    k, c = leases[kept.id], leases[cancelled.id]
    named = [
        (k.work_id, k.fencing_token),
        (c.work_id, c.fencing_token),
        (theirs.work_id, theirs.fencing_token),  # cpu-2's: never cpu-1's to adopt
        ("w-missing", 7),
    ]
    back, released = ledger.reclaim("cpu-1", named, T0 + 2, TTL)
    assert [a.work_id for a in back] == [k.work_id]
    assert back[0].attempt == 1 and back[0].fencing_token == k.fencing_token
    assert back[0].manifest.steps == k.manifest.steps
    assert set(released) == {c.work_id, theirs.work_id, "w-missing", leases[unnamed.id].work_id}
    # The kept lease was renewed; the cancelled and unnamed ones end at the next sweep, long
    # before their TTL; cpu-2's lease is untouched.
    assert ledger.sweep(T0 + 3) == 2
    assert ledger.get(cancelled.id).state == RolloutState.CANCELLED
    assert ledger.get(unnamed.id).state == RolloutState.QUEUED  # retried
    assert ledger.get(other.id).state == RolloutState.RUNNING
    # Past the first expiry only cpu-2's lease (never renewed) ends; the reclaimed one holds.
    assert ledger.sweep(T0 + 2 + TTL - 1) == 1
    assert ledger.get(other.id).state == RolloutState.QUEUED
    assert ledger.get(kept.id).state == RolloutState.RUNNING
    assert ledger.complete("cpu-1", done(k.work_id, k.fencing_token), T0 + 4) == (
        RolloutState.SUCCEEDED
    )
    assert [e.kind for e in ledger.events(kept.id, 0)].count("adopted") == 1
    # A stale token is never adopted, even from the host that holds the lease.
    [again] = ledger.claim("cpu-1", 1, T0 + 30, TTL)
    back, released = ledger.reclaim(
        "cpu-1", [(again.work_id, again.fencing_token - 1)], T0 + 31, TTL
    )
    assert back == [] and released == [again.work_id]
    with pytest.raises(FailedPrecondition, match="not registered"):
        ledger.reclaim("cpu-9", [], T0, TTL)


def test_a_rollouts_checkpoints_stop_at_its_budget(ledger: Ledger) -> None:
    """Code in a machine writes checkpoints: past its rollout's budget one is refused, saying
    why, and not kept; those stored stay, a resend of one is still answered, other rollouts
    are not charged."""
    register(ledger)
    first, _ = submit(ledger, key="a")
    second, _ = submit(ledger, key="b")
    leases = {a.rollout_id: a for a in ledger.claim("cpu-1", 2, T0, TTL)}
    a, b = leases[first.id], leases[second.id]
    ledger.checkpoint_budget_bytes = 3 * (1000 + CHECKPOINT_ROW_BYTES)
    put = [("cpu-1", a.work_id, a.fencing_token, seq, bytes([seq]) * 1000) for seq in (1, 2, 3, 4)]
    results = ledger.put_checkpoints(
        [*put, put[0], ("cpu-1", b.work_id, b.fencing_token, 1, b"b" * 1000)], T0 + 1
    )
    assert results[:3] == [None, None, None] and results[4:] == [None, None]
    assert isinstance(results[3], ResourceExhausted)
    assert "limit of 4536 bytes" in results[3].message and "checkpoint 4" in results[3].message
    assert [seq for seq, _, _ in ledger.checkpoints(first.id)] == [1, 2, 3]
    assert [seq for seq, _, _ in ledger.checkpoints(second.id)] == [1]
    with pytest.raises(ResourceExhausted):  # still full: nothing of the refused one was kept
        ledger.put_checkpoint("cpu-1", a.work_id, a.fencing_token, 5, b"e", T0 + 2)


def test_checkpoints_are_written_together_and_refused_one_by_one(ledger: Ledger) -> None:
    """One transaction for many checkpoints; a stale lease, a clash or a bad sequence number
    refuses only its own item, and a resend of a stored one is harmless."""
    register(ledger)
    first, _ = submit(ledger, key="a")
    second, _ = submit(ledger, key="b")
    leases = {a.rollout_id: a for a in ledger.claim("cpu-1", 2, T0, TTL)}
    a, b = leases[first.id], leases[second.id]
    results = ledger.put_checkpoints(
        [
            ("cpu-1", a.work_id, a.fencing_token, 1, b"a1"),
            ("cpu-1", b.work_id, b.fencing_token - 1, 1, b"stale"),
            ("cpu-1", a.work_id, a.fencing_token, 2, b"a2"),
            ("cpu-1", a.work_id, a.fencing_token, 2, b"a2"),  # a resend in the same batch
            ("cpu-1", a.work_id, a.fencing_token, 1, b"other"),  # the same sequence, other data
            ("cpu-1", b.work_id, b.fencing_token, 0, b"zero"),
            ("cpu-1", "w-missing", 1, 1, b"x"),
        ],
        T0 + 1,
    )
    assert results[0] is None and results[2] is None and results[3] is None
    assert isinstance(results[1], Aborted) and "stale lease" in results[1].message
    assert isinstance(results[4], Aborted) and "other data" in results[4].message
    assert isinstance(results[5], InvalidArgument)
    assert isinstance(results[6], NotFound)
    assert ledger.checkpoints(first.id) == [(1, 1, b"a1"), (2, 1, b"a2")]
    assert ledger.checkpoints(second.id) == []
    with pytest.raises(Aborted, match="stale lease"):
        ledger.put_checkpoint("cpu-2", a.work_id, a.fencing_token, 3, b"a3", T0 + 2)


def test_a_retry_goes_first_to_another_host(ledger: Ledger) -> None:
    """After a host error on cpu-1 the retry waits for other live hosts of its class for a
    while; a lone host gets it back at once."""

    register(ledger, "cpu-1")
    register(ledger, "cpu-2")
    submit(ledger, retry=RetryPolicy(max_attempts=3, initial_backoff_s=0.1, max_backoff_s=0.1))
    [a] = ledger.claim("cpu-1", 1, T0, TTL)
    ledger.complete("cpu-1", done(a.work_id, a.fencing_token, Outcome.TRANSIENT_ERROR), T0 + 1)
    assert ledger.claim("cpu-1", 1, T0 + 1.5, TTL) == []  # cpu-2 is alive: it goes first
    [b] = ledger.claim("cpu-2", 1, T0 + 1.5, TTL)
    assert b.attempt == 2
    # cpu-2 loses the lease; cpu-1 has not beaten since T0, so cpu-2 is the lone live host.
    ledger.heartbeat("cpu-2", [(b.work_id, b.fencing_token)], T0 + 2, TTL)
    ledger.sweep(T0 + 2 + TTL + 1)
    later = T0 + 2 + TTL + 2
    assert later - T0 > AVOID_HOST_S
    [c] = ledger.claim("cpu-2", 1, later, TTL)  # nobody else alive: no waiting
    assert c.attempt == 3


def test_retention_deletes_old_finished_rollouts_with_everything_of_theirs(
    ledger: Ledger, tmp_path: Path
) -> None:
    """A rollout that ended before the cutoff goes, with its rows; a recent one and a running
    one stay; blobs only deleted ones named are collected, others are kept."""

    register(ledger)
    old, _ = submit(ledger, "old", inputs=(InputFile(path="/in", digest="sha256:" + "a" * 64,
                                                     size=1),))  # fmt: skip
    [a] = ledger.claim("cpu-1", 1, T0, TTL)
    report = done(a.work_id, a.fencing_token).model_copy(update={"outputs": (
        OutputArtifact(path="/out", digest="sha256:" + "b" * 64, size=1),)})  # fmt: skip
    ledger.complete("cpu-1", report, T0 + 1)
    recent, _ = submit(ledger, "recent", inputs=(InputFile(
        path="/in", digest="sha256:" + "c" * 64, size=1),))  # fmt: skip
    [b] = ledger.claim("cpu-1", 1, T0 + 100, TTL)
    ledger.complete("cpu-1", done(b.work_id, b.fencing_token), T0 + 101)
    running, _ = submit(ledger, "running")
    ledger.claim("cpu-1", 1, T0 + 102, TTL)
    assert {"sha256:" + c * 64 for c in "abc"} <= referenced_blobs(ledger)
    assert purge_finished(ledger, T0 + 50) == 1
    with pytest.raises(NotFound):
        ledger.get(old.id)
    assert ledger.get(recent.id).state == RolloutState.SUCCEEDED
    assert ledger.get(running.id).state == RolloutState.RUNNING
    assert referenced_blobs(ledger) == {"sha256:" + "c" * 64}
    with ledger.engine.connect() as conn:
        for table in ("events", "work_items", "rollout_labels", "egress_events"):
            ids = {r[0] for r in conn.execute(text(f"SELECT rollout_id FROM {table}"))}
            assert old.id not in ids, table
        assert conn.execute(text("SELECT count(*) FROM manifests")).scalar_one() == 2
    blobs = BlobStore(tmp_path / "blobs")
    for c in "abcd":
        path = blobs.path("sha256:" + c * 64)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"x")
        os.utime(path, (T0, T0))
    removed = blobs.collect_garbage(referenced_blobs(ledger), T0 + 1)
    assert removed == 3
    assert [p.name for p in (tmp_path / "blobs" / "sha256").rglob("*") if p.is_file()] == ["c" * 64]


def test_a_pools_cap_holds_across_replicas_claiming_at_once(ledger_target: str) -> None:
    """Two ledgers on one database (two server replicas) claim for the hosts of a capped pool
    from many threads at once: the pool never holds more leases than its cap; a host outside
    it is not held back; a raised cap is seen by the next claim."""

    replicas = [Ledger.open(ledger_target), Ledger.open(ledger_target)]
    first = replicas[0]
    for host_id, site in (("c1", "cloud"), ("c2", "cloud"), ("c3", "cloud"), ("l1", "local")):
        first.register_host(
            HostCapabilities(
                host_id=host_id, host_class=HostClass.CPU, runtime=RuntimeKind.NAMESPACE,
                isolation=Isolation.NAMESPACE, cpus=2, memory_mib=1024, cuda_devices=0,
                slots=8, labels={"site": site},
            ),
            T0,
        )  # fmt: skip
    first.set_pool(Pool(name="cloud", host_class=HostClass.CPU, labels={"site": "cloud"},
                        max_running=3), T0)  # fmt: skip
    for i in range(30):
        submit(first, key=f"k{i}")
    taken: dict[str, int] = {}
    lock = threading.Lock()

    def claim(replica: Ledger, host_id: str) -> None:
        for _ in range(5):
            got = replica.claim(host_id, 4, T0, TTL)
            with lock:
                taken[host_id] = taken.get(host_id, 0) + len(got)

    threads = [
        threading.Thread(target=claim, args=(replicas[i % 2], host))
        for i, host in enumerate(["c1", "c2", "c3", "c1", "c2", "c3", "l1"])
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    [view] = first.pools()
    pool = view.pool
    in_pool = sum(n for h, n in taken.items() if h != "l1")
    assert (pool.name, sorted(view.members), view.running, in_pool) == (
        "cloud", ["c1", "c2", "c3"], 3, 3,
    )  # fmt: skip
    assert taken["l1"] == 20  # (5 claims of 4: the local host is in no pool)
    first.set_pool(pool.model_copy(update={"max_running": 5}), T0)
    assert len(replicas[1].claim("c2", 4, T0, TTL)) == 2
    for replica in replicas:
        replica.engine.dispose()


def test_a_postgresql_ledger_without_its_driver_says_which_extra_to_install(
    monkeypatch: pytest.MonkeyPatch,
) -> None:

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda n, *a: None if n == "psycopg" else real(n, *a)
    )
    with pytest.raises(FailedPrecondition, match=r"pip install 'fleet\[postgres\]'"):
        Ledger.open("postgresql://fleet@127.0.0.1:1/fleet")


def test_many_hosts_claims_in_one_transaction(ledger: Ledger) -> None:
    """A batch of claims is taken in order in one transaction: a later claim sees what the
    earlier ones leased (a tenant's running cap holds across them), an unknown host's claim is
    refused alone, and a repeat of a claim in a later batch gets the same leases."""
    register(ledger, "cpu-1")
    register(ledger, "cpu-2")
    for i in range(3):
        submit(ledger, key=f"a{i}", tenant="team-a")
    for i in range(2):
        submit(ledger, key=f"b{i}", tenant="team-b")
    first, ghost, second = ledger.claim_batch(
        [
            Claim("cpu-1", 2, TTL, "claim-1", max_running_per_tenant=2),
            Claim("ghost", 1, TTL, "claim-g", max_running_per_tenant=2),
            Claim("cpu-2", 5, TTL, "claim-2", max_running_per_tenant=2),
        ],
        T0,
    )
    assert isinstance(ghost, FailedPrecondition) and "ghost" in str(ghost)
    assert not isinstance(first, Exception) and not isinstance(second, Exception)
    assert len(first) == 2 and len(second) == 2
    leased = first + second
    assert len({a.work_id for a in leased}) == 4
    tenants = [ledger.get(a.rollout_id).tenant for a in leased]
    assert tenants.count("team-a") == 2 and tenants.count("team-b") == 2
    for host, assignments in (("cpu-1", first), ("cpu-2", second)):
        for a in assignments:
            rollout = ledger.get(a.rollout_id)
            assert rollout.state == RolloutState.RUNNING
            assert [e.actor for e in ledger.events(a.rollout_id, 0) if e.kind == "leased"] == [host]
    queued = [r for r in ledger.list_rollouts(50, "", {})[0] if r.state == RolloutState.QUEUED]
    assert [r.tenant for r in queued] == ["team-a"]  # its tenant's cap: it waits
    # A lost reply: the same claim again, in another batch, answers with the same leases.
    [again] = ledger.claim_batch(
        [Claim("cpu-2", 5, TTL, "claim-2", max_running_per_tenant=2)], T0 + 1
    )
    assert not isinstance(again, Exception)
    assert [(a.work_id, a.fencing_token) for a in again] == [
        (a.work_id, a.fencing_token) for a in second
    ]


def test_a_claim_that_fails_part_way_leaves_nothing_of_itself(
    ledger: Ledger, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One claim of a batch failing after it wrote its leases is undone alone (a savepoint
    each): its items stay queued, the batch's other claims are kept."""
    register(ledger, "cpu-1")
    register(ledger, "cpu-2")
    for i in range(4):
        submit(ledger, key=f"k{i}")
    real = ledger._latest_checkpoints
    calls = 0

    def second_one_fails(db, rollout_ids):  # type: ignore[no-untyped-def]
        nonlocal calls
        calls += 1  # (read after each claim's writes)
        if calls == 2:
            raise FailedPrecondition("injected after the claim's writes")
        return real(db, rollout_ids)

    monkeypatch.setattr(ledger, "_latest_checkpoints", second_one_fails)
    first, failed, third = ledger.claim_batch(
        [Claim("cpu-1", 1, TTL), Claim("cpu-2", 2, TTL), Claim("cpu-1", 1, TTL)], T0
    )
    assert isinstance(failed, FailedPrecondition) and "injected" in str(failed)
    assert not isinstance(first, Exception) and not isinstance(third, Exception)
    kept = {a.rollout_id for a in first + third}
    assert len(kept) == 2
    for rollout in ledger.list_rollouts(50, "", {})[0]:
        leased = [e.actor for e in ledger.events(rollout.id, 0) if e.kind == "leased"]
        if rollout.id in kept:
            assert rollout.state == RolloutState.RUNNING and len(leased) == 1
        else:  # what the failed claim had leased is as if it never was
            assert rollout.state == RolloutState.QUEUED and leased == []
            assert rollout.attempts == 0


def test_many_callers_submissions_in_one_transaction(ledger: Ledger) -> None:
    """A batch of callers' submissions is stored in one transaction, each answered on its own
    in the callers' order: a key reused with another body and a tenant past its limit are
    refused alone and store nothing; a key twice in a batch is one rollout; the rest are
    stored, and the tenants' kept counts follow only what was stored."""
    [(old, _)] = ledger.submit_many([_req_manifest("old", tenant="team-a")], T0)
    # None refused: written together, answered in the callers' order.
    z, y, z_again = ledger.submit_batch(
        [_req_manifest("z", tenant="team-z"), _req_manifest("y", tenant="team-y"),
         _req_manifest("z", tenant="team-z")], T0,
    )  # fmt: skip
    assert not isinstance(z, Exception) and not isinstance(y, Exception)
    assert not isinstance(z_again, Exception)
    assert (z[0].idempotency_key, z[1], y[0].idempotency_key, y[1]) == ("z", True, "y", True)
    assert z_again == (z_again[0], False) and z_again[0].id == z[0].id
    assert z_again[0].state == RolloutState.QUEUED and z_again[0].tenant == "team-z"
    batch = [
        _req_manifest("n1", tenant="team-b"),
        _req_manifest("old", tenant="team-a", labels={"other": "body"}),
        _req_manifest("n2", tenant="team-a"),
        _req_manifest("n3", tenant="team-a"),
        _req_manifest("n1", tenant="team-b"),
        _req_manifest("old", tenant="team-a"),
    ]
    n1, reused, n2, over, n1_again, old_again = ledger.submit_batch(
        batch, T0 + 1, max_active_per_tenant=2
    )
    assert isinstance(reused, AlreadyExists) and old in str(reused)
    assert isinstance(over, ResourceExhausted) and "team-a" in str(over)
    assert not isinstance(n1, Exception) and not isinstance(n2, Exception)
    assert not isinstance(n1_again, Exception) and not isinstance(old_again, Exception)
    assert n1[1] and n2[1] and not n1_again[1] and not old_again[1]
    assert n1_again[0].id == n1[0].id and old_again[0].id == old
    assert (n1[0].tenant, n2[0].idempotency_key) == ("team-b", "n2")
    stored = {r.idempotency_key: r for r in ledger.list_rollouts(50, "", {})[0]}
    assert sorted(stored) == ["n1", "n2", "old", "y", "z"]
    assert stored["old"].labels == {}  # the refused body changed nothing
    for key in ("n1", "n2"):
        assert [e.kind for e in ledger.events(stored[key].id, 0)] == ["submitted"]
    # The refused submission left the tenant's count as it was: team-a holds two, at its limit.
    with pytest.raises(ResourceExhausted, match="has 2 rollouts"):
        ledger.submit(*_req_manifest("n4", tenant="team-a"), T0 + 2, max_active_per_tenant=2)
    ledger.submit(*_req_manifest("n4", tenant="team-b"), T0 + 2, max_active_per_tenant=2)


def test_a_submission_that_fails_part_way_leaves_nothing_of_itself(
    ledger: Ledger, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One submission of a batch failing after its rows were written is undone alone (the
    batch is then written one by one, a savepoint each): no rollout, event or count of it
    remains; the others are stored."""
    real = ledger._count_active

    def team_b_fails(db, tenants, step):  # type: ignore[no-untyped-def]
        if "team-b" in tenants:  # (called after a submission's rows are written)
            raise FailedPrecondition("injected after the submission's writes")
        return real(db, tenants, step)

    monkeypatch.setattr(ledger, "_count_active", team_b_fails)
    first, failed, third = ledger.submit_batch(
        [_req_manifest("a1", tenant="team-a"), _req_manifest("b1", tenant="team-b"),
         _req_manifest("c1", tenant="team-c")], T0,
    )  # fmt: skip
    monkeypatch.undo()
    assert isinstance(failed, FailedPrecondition) and "injected" in str(failed)
    assert not isinstance(first, Exception) and not isinstance(third, Exception)
    assert (first[0].idempotency_key, third[0].idempotency_key) == ("a1", "c1")
    stored = sorted(r.idempotency_key for r in ledger.list_rollouts(50, "", {})[0])
    assert stored == ["a1", "c1"]
    with pytest.raises(ResourceExhausted, match="has 1 rollouts"):
        ledger.submit(*_req_manifest("a2", tenant="team-a"), T0, max_active_per_tenant=1)
    # Nothing of the failed one is counted, and its key is free: a new rollout.
    again, created = ledger.submit(
        *_req_manifest("b1", tenant="team-b"), T0, max_active_per_tenant=1
    )
    assert created and again.id not in {first[0].id, third[0].id}


def test_a_submission_that_keeps_clashing_is_refused_alone_with_a_retry_hint(
    ledger: Ledger, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A submission whose key another replica keeps storing between our read and our insert
    (a unique clash each try) is answered ABORTED with a retry hint after its tries; the
    batch's others are stored."""
    real = ledger._insert_rollouts
    tries = 0

    def clashes_on_k2(db, batch, now, max_active):  # type: ignore[no-untyped-def]
        nonlocal tries
        if any(req.idempotency_key == "k2" for req, _ in batch):
            tries += 1
            raise sqlite3.IntegrityError("UNIQUE constraint failed: rollouts.idempotency_key")
        return real(db, batch, now, max_active)

    monkeypatch.setattr(ledger, "_insert_rollouts", clashes_on_k2)
    first, clashed, third = ledger.submit_batch(
        [_req_manifest("k1"), _req_manifest("k2"), _req_manifest("k3")], T0
    )
    monkeypatch.undo()
    assert isinstance(clashed, Aborted) and clashed.retry_after_s
    assert "k2" in str(clashed) and tries == 1 + 3  # (the batch together, then its own tries)
    assert not isinstance(first, Exception) and not isinstance(third, Exception)
    stored = sorted(r.idempotency_key for r in ledger.list_rollouts(50, "", {})[0])
    assert stored == ["k1", "k3"]


def test_a_hosts_revocation_ends_its_leases_in_the_same_transaction(
    ledger: Ledger, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Revoking a host retries its work in the revocation's own transaction, so a report the
    host sends after it is refused and the work waits for another host; a revocation that
    fails part way leaves the host and its lease as they were."""
    ids = ledger.identities
    _, token = ids.create_join_token(HostClass.CPU, {}, 3600, 1, T0)
    ids.enroll(token, "cpu-1", lambda c: "{}", lambda: ("ab", T0 + 3600), T0)
    register(ledger, "cpu-1")
    rollout, _ = submit(ledger)
    [a] = ledger.claim("cpu-1", 1, T0, TTL)

    def fails(db, now):  # type: ignore[no-untyped-def]
        raise FailedPrecondition("injected after the leases ended")

    monkeypatch.setattr(ledger, "_expire_lost", fails)
    with pytest.raises(FailedPrecondition, match="injected"):
        ids.revoke_host("cpu-1", T0 + 1)
    monkeypatch.undo()
    assert ids.host("cpu-1").revoked_at is None  # type: ignore[union-attr]
    assert ledger.get(rollout.id).state == RolloutState.RUNNING
    assert ids.revoke_host("cpu-1", T0 + 2) == 1
    assert ledger.get(rollout.id).state == RolloutState.QUEUED
    stopped = done(a.work_id, a.fencing_token, Outcome.CANCELLED)
    with pytest.raises(Aborted, match="not leased to host cpu-1"):
        ledger.complete("cpu-1", stopped, T0 + 3)
    assert ledger.get(rollout.id).state == RolloutState.QUEUED


def test_each_tenants_active_count_follows_its_items(ledger: Ledger) -> None:
    """`tenant_active`, which admission reads, equals each tenant's queued plus leased items
    through every change: submitted alone and in a batch, leased, succeeded, retried, cancelled
    queued and running, a lease expired (retried, then failed), a deadline missed in the queue."""

    def counts() -> tuple[dict[str, int], dict[str, int]]:
        with ledger._read() as db:
            kept = {t: int(n) for t, n in db.all("SELECT tenant, active FROM tenant_active")}
            real = db.all(
                "SELECT tenant, count(*) FROM work_items WHERE state IN ('QUEUED', 'LEASED') "
                "GROUP BY tenant"
            )
        return {t: n for t, n in kept.items() if n}, {t: int(n) for t, n in real}

    def check(expected: dict[str, int]) -> None:
        kept, real = counts()
        assert kept == real == expected

    register(ledger)
    retry = RetryPolicy(max_attempts=2, initial_backoff_s=1, max_backoff_s=1)
    a = [submit(ledger, key=f"a{i}", tenant="team-a", retry=retry)[0] for i in range(4)]
    ledger.submit_many([_req_manifest(f"b{i}", tenant="team-b") for i in range(3)], T0)
    short = datetime.fromtimestamp(T0, UTC) + timedelta(seconds=5)
    late, _ = submit(ledger, key="late", tenant="team-c", deadline=short)
    check({"team-a": 4, "team-b": 3, "team-c": 1})
    assert ledger.cancel(a[3].id, "not needed", "test", T0).state == RolloutState.CANCELLED
    check({"team-a": 3, "team-b": 3, "team-c": 1})
    leased = ledger.claim("cpu-1", 3, T0, TTL, max_running_per_tenant=3)
    assert {ledger.get(x.rollout_id).tenant for x in leased} == {"team-a"}
    check({"team-a": 3, "team-b": 3, "team-c": 1})  # (leased is still active)
    first, second, third = leased
    assert ledger.complete("cpu-1", done(first.work_id, first.fencing_token), T0 + 1) == (
        RolloutState.SUCCEEDED
    )
    retried = done(second.work_id, second.fencing_token, Outcome.TRANSIENT_ERROR)
    assert ledger.complete("cpu-1", retried, T0 + 1) == RolloutState.QUEUED
    check({"team-a": 2, "team-b": 3, "team-c": 1})
    ledger.cancel(third.rollout_id, "stop", "test", T0 + 1)  # (running: its agent stops it)
    check({"team-a": 2, "team-b": 3, "team-c": 1})
    stopped = done(third.work_id, third.fencing_token, Outcome.CANCELLED)
    assert ledger.complete("cpu-1", stopped, T0 + 2) == RolloutState.CANCELLED
    check({"team-a": 1, "team-b": 3, "team-c": 1})
    # Every lease lost: team-a's retry fails (its second attempt of 2), team-b's are retried;
    # team-c's, past its deadline, is not taken.
    taken = ledger.claim("cpu-1", 10, T0 + 6, TTL)
    assert sorted(ledger.get(x.rollout_id).tenant for x in taken) == ["team-a"] + ["team-b"] * 3
    check({"team-a": 1, "team-b": 3, "team-c": 1})
    assert ledger.sweep(T0 + 6 + TTL + 1, late=False) == 4
    assert ledger.get(second.rollout_id).state == RolloutState.FAILED
    check({"team-b": 3, "team-c": 1})
    assert ledger.sweep(T0 + 6 + TTL + 2) == 1  # (team-c's deadline passed in the queue)
    assert ledger.get(late.id).state == RolloutState.FAILED
    check({"team-b": 3})


def figures_in_full(ledger: Ledger, now: float, window_s: float = 60.0) -> dict[str, float]:
    """The metrics' figures read from every row, the plain way: what `figures` must equal."""

    with ledger.engine.connect() as conn:
        out = {f"state_{s}": float(n) for s, n in conn.execute(
            text("SELECT state, count(*) FROM rollouts GROUP BY state"))}  # fmt: skip
        retries, cpu, done_n = conn.execute(text(
            "SELECT coalesce(sum(attempts - 1), 0), coalesce(sum(cpu_s), 0), count(*) "
            "FROM rollouts WHERE state = 'SUCCEEDED'")).one()  # fmt: skip
        recent = conn.execute(text(
            "SELECT count(*) FROM rollouts WHERE state = 'SUCCEEDED' AND finished_at >= :t"),
            {"t": now - window_s}).scalar_one()  # fmt: skip
        inference = conn.execute(text(
            "SELECT count(*) FROM work_items WHERE needs_inference AND state = 'DONE'")
        ).scalar_one()  # fmt: skip
    out.update(
        trajectories_per_second=float(recent) / window_s,
        retries=float(retries),
        cpu_seconds_per_trajectory=float(cpu) / done_n if done_n else 0.0,
        inference_trajectories=float(inference),
    )
    return out


def test_the_metrics_figures_keep_settled_rollouts_and_read_only_what_changed(
    ledger: Ledger,
) -> None:
    """Rollouts that finished SETTLE_S ago are summed once and kept: each call's figures equal
    a read of every row, as rollouts finish, settle and are purged, while a settled row is not
    read again (a change to one, which fleet never makes, does not show until a purge)."""

    register(ledger, gateway=True)

    def run(key: str, at: float, *outcomes: Outcome, **kw: object) -> str:
        rollout, _ = submit(ledger, key, retry=RetryPolicy(max_attempts=3, initial_backoff_s=0,
                                                           max_backoff_s=0), **kw)  # fmt: skip
        for k, outcome in enumerate(outcomes):
            [a] = ledger.claim("cpu-1", 1, at + k, TTL)
            report = done(a.work_id, a.fencing_token, outcome)
            ledger.complete("cpu-1", report.model_copy(update={"cpu_seconds": 1.5}), at + k)
        return rollout.id

    first = run("a", T0 + 1, Outcome.SUCCEEDED)
    run("b", T0 + 2, Outcome.TRANSIENT_ERROR, Outcome.TRANSIENT_ERROR, Outcome.SUCCEEDED)
    run("c", T0 + 6, Outcome.SUCCEEDED, requirements=Requirements(inference=True))
    run("d", T0 + 7, Outcome.STEP_FAILED)
    cancelled, _ = submit(ledger, "e")
    ledger.cancel(cancelled.id, "", "test", T0 + 8)
    run("running", T0 + 9)
    ledger.claim("cpu-1", 1, T0 + 9, TTL)
    submit(ledger, "queued")

    later = T0 + 9 + SETTLE_S + 1  # all of them settled
    assert ledger.figures(later) == figures_in_full(ledger, later)
    assert ledger.figures(later)["retries"] == 2.0
    run(
        "f", later, Outcome.SUCCEEDED, requirements=Requirements(inference=True), priority=1
    )  # recent (claimed before the queued one)
    assert ledger.figures(later + 1) == figures_in_full(ledger, later + 1)
    much_later = later + 2 * SETTLE_S  # f settled too, summed onto what was
    assert ledger.figures(much_later) == figures_in_full(ledger, much_later)
    assert ledger.figures(much_later)["inference_trajectories"] == 2.0

    with ledger.engine.begin() as conn:
        conn.execute(text("UPDATE rollouts SET cpu_s = cpu_s + 100 WHERE id = :i"), {"i": first})
    assert ledger.figures(much_later + 1) != figures_in_full(ledger, much_later + 1)
    assert purge_finished(ledger, T0 + 2) == 1  # the first one goes; the figures read anew
    assert ledger.figures(much_later + 2) == figures_in_full(ledger, much_later + 2)
    assert ledger.figures(much_later + 2)["state_SUCCEEDED"] == 3.0


def test_replicas_submitting_the_same_keys_at_once_store_each_once(ledger_target: str) -> None:
    """Two ledgers on one database (two server replicas) take the same submissions at the same
    time, one at a time each: every key is stored once, both answer with its one rollout, and
    exactly one of them says it created it (on PostgreSQL the loser of a race hits the unique
    key, undoes its transaction and reads the winner's row)."""

    replicas = [Ledger.open(ledger_target), Ledger.open(ledger_target)]
    keys = [f"race-{i}" for i in range(40)]
    answers: list[list[tuple[str, bool]]] = [[], []]
    start = threading.Barrier(2)

    def take(k: int) -> None:
        start.wait()
        for key in keys:
            rollout, created = submit(replicas[k], key)
            answers[k].append((rollout.id, created))

    threads = [threading.Thread(target=take, args=(k,)) for k in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    try:
        assert [len(a) for a in answers] == [len(keys), len(keys)]
        for (id_a, created_a), (id_b, created_b) in zip(*answers, strict=True):
            assert id_a == id_b
            assert created_a != created_b  # one replica created it, the other found it
        listed, _ = replicas[0].list_rollouts(500, "", {})
        assert sorted(r.idempotency_key for r in listed) == sorted(keys)
    finally:
        for replica in replicas:
            replica.engine.dispose()


def test_a_batch_that_clashes_with_another_replica_mid_write_stores_each_key_once(
    postgres: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another replica stores one of a batch's keys after this one has looked its keys up and
    before it writes them (PostgreSQL: SQLite's writers take turns, so there it cannot happen):
    the clash, raised when the batch's writes are answered together, undoes the batch's
    savepoint; each submission is then taken on its own, the raced key answered with the other
    replica's rollout, the rest stored once."""
    target = create_database(postgres)
    ours, theirs = Ledger.open(target), Ledger.open(target)
    now = datetime.fromtimestamp(T0, UTC)
    batch = []
    for key in ("b0", "b1", "b2", "b3"):
        req = SubmitRequest(
            idempotency_key=key, smolfile='image = "minimal"\n', steps=(Step(argv=("true",)),)
        )
        batch.append((req, build_manifest(req, validate_request(req, now), "sha256:img", now)))
    raced: list[str] = []
    all_rows = Raw.all

    def racing(self: Raw, sql: str, params: Any = (), *, n: int = 0) -> list[Any]:
        rows = all_rows(self, sql, params, n=n)
        if sql == Q.ROLLOUTS_BY_KEY and len(params) == len(batch) and not raced:
            raced.append("")  # (the other replica's own lookup below is not raced again)
            raced[0] = theirs.submit(*batch[2], T0)[0].id  # (its own connection, committed)
        return rows

    monkeypatch.setattr(Raw, "all", racing)
    try:
        answers = ours.submit_batch(batch, T0)
        assert raced, "the other replica did not store its key in between"
        created = [a if isinstance(a, Exception) else a[1] for a in answers]
        assert created == [True, True, False, True]
        assert not isinstance(answers[2], Exception) and answers[2][0].id == raced[0]
        listed, _ = ours.list_rollouts(50, "", {})
        assert sorted(r.idempotency_key for r in listed) == ["b0", "b1", "b2", "b3"]
    finally:
        ours.engine.dispose()
        theirs.engine.dispose()
        drop_database(postgres, target)


def test_parsed_manifests_kept_in_memory_stay_bounded(
    ledger: Ledger, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A server that stores rollouts and claims them keeps only the newest parsed manifests:
    storing a manifest remembers it as reading one does, and the oldest are forgotten (read
    from the database again when needed, all of a claim's in one statement)."""
    monkeypatch.setattr("fleet.ledger.base.MANIFESTS_KEPT", 5)
    register(ledger)
    stored = [submit(ledger, f"k{i}", smolfile=f'image = "minimal"\n# {i}\n')[0] for i in range(12)]
    assert len(ledger._manifests) == 5
    assert set(ledger._manifests) == {r.manifest_digest for r in stored[-5:]}
    reads: list[int] = []
    all_rows = Raw.all

    def counted(self: Raw, sql: str, params: Any = (), *, n: int = 0) -> list[Any]:
        if sql == Q.MANIFEST_BODIES:
            reads.append(n)
        return all_rows(self, sql, params, n=n)

    monkeypatch.setattr(Raw, "all", counted)
    claimed = ledger.claim("cpu-1", 12, T0, TTL)
    assert len(claimed) == 12
    assert reads == [7]  # (the seven forgotten, in one statement)
    assert {a.rollout_id: a.manifest.digest for a in claimed} == {
        r.id: r.manifest_digest for r in stored
    }
    assert {a.manifest.smolfile for a in claimed} == {r.manifest.smolfile for r in stored}
    assert len(ledger._manifests) == 5


def test_a_new_sqlite_ledger_has_small_pages_and_an_older_one_keeps_its_own(
    tmp_path: Path,
) -> None:
    """A ledger's database made new has `SQLITE_PAGE_BYTES` pages; a database made with the
    old 4,096-byte pages opens, stores and reads as before, and keeps them."""
    fresh = Ledger.open(str(tmp_path / "new.sqlite3"))
    rollout, _ = submit(fresh)
    assert fresh.get(rollout.id).state == RolloutState.QUEUED
    fresh.engine.dispose()
    with sqlite3.connect(tmp_path / "new.sqlite3") as conn:
        assert conn.execute("PRAGMA page_size").fetchone()[0] == SQLITE_PAGE_BYTES == 2048
    older = tmp_path / "old.sqlite3"
    with sqlite3.connect(older) as conn:
        conn.execute("PRAGMA page_size=4096")
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("CREATE TABLE made_before (x INTEGER)")
    ledger = Ledger.open(str(older))
    first, _ = submit(ledger, "k-old")
    assert ledger.get(first.id).idempotency_key == "k-old"
    ledger.engine.dispose()
    reopened = Ledger.open(str(older))
    assert reopened.get(first.id).manifest_digest == first.manifest_digest
    reopened.engine.dispose()
    with sqlite3.connect(older) as conn:
        assert conn.execute("PRAGMA page_size").fetchone()[0] == 4096


def test_work_that_needs_namespace_isolation_is_claimed_by_namespace_hosts_alone(
    ledger: Ledger,
) -> None:
    """A machine started from a parked session's layer needs the namespace runtime: in a class
    that mixes microVM and namespace hosts, only the latter lease it."""
    ledger.register_host(
        HostCapabilities(
            host_id="vm-1", host_class=HostClass.CPU, runtime=RuntimeKind.SMOL,
            isolation=Isolation.VM, cpus=2, memory_mib=1024, cuda_devices=0,
        ),
        T0,
    )  # fmt: skip
    register(ledger, "ns-1")
    rollout, _ = submit(ledger, requirements=Requirements(isolation=Isolation.NAMESPACE))
    assert ledger.claim("vm-1", 4, T0, TTL) == []
    [leased] = ledger.claim("ns-1", 4, T0, TTL)
    assert leased.rollout_id == rollout.id
    # Any other work goes to either.
    other, _ = submit(ledger, key="k2")
    assert [a.rollout_id for a in ledger.claim("vm-1", 4, T0, TTL)] == [other.id]
