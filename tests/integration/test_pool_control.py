"""Pools governed in the ledger: promotion gates pause and resume dispatches, an adaptive cap
rises while throughput does and backs off when it stops, device seconds land on attempts.
Every backend (SQLite, PostgreSQL); times are given, not waited for."""

from __future__ import annotations

from fleet.core.adaptive import Adaptive
from fleet.core.gates import Gates
from fleet.core.lifecycle import Outcome
from fleet.core.placement import HostCapabilities, HostClass, Isolation, Pool, RuntimeKind
from fleet.core.retry import RetryPolicy
from fleet.ledger.store import Ledger
from tests.integration.test_ledger import T0, done, submit

LONG = 10_000.0  # a lease that does not expire during a test


def host(ledger: Ledger, host_id: str, site: str, slots: int = 8) -> None:
    ledger.register_host(
        HostCapabilities(
            host_id=host_id, host_class=HostClass.CPU, runtime=RuntimeKind.NAMESPACE,
            isolation=Isolation.NAMESPACE, cpus=2, memory_mib=1024, cuda_devices=0,
            slots=slots, labels={"site": site},
        ),
        T0,
    )  # fmt: skip


def cloud(**kw: object) -> Pool:
    return Pool.model_validate(
        {"name": "cloud", "host_class": HostClass.CPU, "labels": {"site": "cloud"}, **kw}
    )


def test_a_retry_gate_pauses_its_pool_only_and_resumes_when_the_failures_age_out(
    ledger: Ledger,
) -> None:
    host(ledger, "c1", "cloud")
    host(ledger, "l1", "local")
    gates = Gates(retry_rate=0.3, window_s=60, min_attempts=2)
    ledger.set_pool(cloud(gates=gates), T0)
    retry = RetryPolicy(max_attempts=3, initial_backoff_s=1, max_backoff_s=1)
    for i in range(6):
        submit(ledger, key=f"k{i}", retry=retry)
    first = ledger.claim("c1", 2, T0, LONG)
    for a in first:
        ledger.complete("c1", done(a.work_id, a.fencing_token, Outcome.TRANSIENT_ERROR), T0 + 1)
    assert ledger.govern(T0 + 2) and ledger.govern(T0 + 2.5) == []  # paused once, not twice
    [paused] = ledger.pool_events(T0)
    assert paused.kind == "paused"
    assert "retry rate 100.0% (2 of 2 attempts in 60s) > 30.0%" in paused.message
    assert paused.figures["retried"] == 2 and paused.figures["attempts"] == 2
    [view] = ledger.pools()
    assert view.paused_at == T0 + 2 and "retry rate" in view.paused_why
    assert ledger.claim("c1", 4, T0 + 3, LONG) == []  # no new dispatches to the pool
    assert len(ledger.claim("l1", 2, T0 + 3, LONG)) == 2  # a host outside it goes on
    assert ledger.govern(T0 + 30) == []  # the failures are still in the window
    [resumed] = ledger.govern(T0 + 62)
    assert resumed.kind == "resumed" and resumed.figures["attempts"] == 0
    assert ledger.pools()[0].paused_at is None
    assert len(ledger.claim("c1", 4, T0 + 63, LONG)) == 4


def test_a_latency_gate_trips_on_the_gateways_p95_and_recovers_under_a_margin(
    ledger: Ledger,
) -> None:
    host(ledger, "c1", "cloud")
    ledger.set_pool(cloud(gates=Gates(p95_ms=500, queue_age_ms=2000)), T0)
    assert ledger.govern(T0, p95_ms=120.0, queue_age_ms=10.0) == []
    [paused] = ledger.govern(T0 + 1, p95_ms=812.5, queue_age_ms=10.0)
    assert "gateway p95 latency 812.5 ms > 500 ms" in paused.message
    assert paused.figures["p95_ms"] == 812.5
    assert ledger.govern(T0 + 2, p95_ms=450.0, queue_age_ms=10.0) == []  # under 500, not 400
    [resumed] = ledger.govern(T0 + 3, p95_ms=350.0, queue_age_ms=10.0)
    assert resumed.kind == "resumed" and "after 2.0s" in resumed.message
    [paused] = ledger.govern(T0 + 4, p95_ms=100.0, queue_age_ms=2500.0)
    assert "gateway queue age 2500.0 ms > 2000 ms" in paused.message
    # Gates turned off: the pause ends with them.
    ledger.set_pool(cloud(), T0 + 5)
    assert ledger.pools()[0].paused_at is None


def test_an_artifact_failure_gate_counts_the_attempts_that_failed_to_move_one(
    ledger: Ledger,
) -> None:
    host(ledger, "c1", "cloud")
    ledger.set_pool(cloud(gates=Gates(artifact_failure_rate=0.4, min_attempts=3)), T0)
    for i in range(3):
        submit(ledger, key=f"k{i}")
    claimed = ledger.claim("c1", 3, T0, LONG)
    for i, a in enumerate(claimed):
        report = done(a.work_id, a.fencing_token, Outcome.STEP_FAILED)
        ledger.complete("c1", report.model_copy(update={"artifact_failed": i < 2}), T0 + 1)
    [paused] = ledger.govern(T0 + 2)
    assert "artifact failure rate 66.7% (2 of 3 attempts in 60s) > 40.0%" in paused.message


def _run_interval(ledger: Ledger, now: float, knee: int) -> None:
    """The pool's hosts take what the cap allows; `knee` of what runs finishes per interval
    (a pipeline that cannot go faster): the rest keeps its leases, so the cap binds."""
    ledger.claim("c1", 100, now, LONG)
    for work_id, token in _leased(ledger)[:knee]:  # (after the interval's first 40%)
        ledger.complete("c1", done(work_id, token), now + 6)


def _leased(ledger: Ledger) -> list[tuple[str, int]]:
    from sqlalchemy import text

    with ledger.engine.begin() as conn:
        rows = conn.execute(
            text("SELECT id, fencing_token FROM work_items WHERE state = 'LEASED' ORDER BY id")
        ).all()
    return [(r[0], int(r[1])) for r in rows]


def test_an_adaptive_cap_rises_while_throughput_does_then_settles_at_the_knee(
    ledger: Ledger,
) -> None:
    host(ledger, "c1", "cloud", slots=16)
    adaptive = Adaptive(start=2, step=2, interval_s=10, probe_every=3)
    ledger.set_pool(cloud(adaptive=adaptive), T0)
    for i in range(120):
        submit(ledger, key=f"k{i}")
    caps = []
    for k in range(10):
        now = T0 + 10 * k
        _run_interval(ledger, now, knee=6)
        ledger.govern(now + 10)
        caps.append(ledger.pools()[0].pool.max_running)
    # 2 -> 4 -> 6 pay (2, 4, 6 in the 6 s counted); 8 gives 6 too, twice: back to 6, the last
    # that paid; after 3 settled intervals it probes 8 once more, and comes back.
    assert caps == [4, 6, 8, 8, 6, 6, 6, 8, 8, 6]
    kinds = [(e.kind, e.cap) for e in ledger.pool_events(T0)]
    assert kinds == [
        ("raised", 4), ("raised", 6), ("raised", 8), ("lowered", 6), ("raised", 8), ("lowered", 6)
    ]  # fmt: skip
    lowered = ledger.pool_events(T0)[3]
    assert "throughput stopped rising: 1.00/s at cap 8 over two intervals, 1.00/s at cap 6" \
        in lowered.message  # fmt: skip
    assert lowered.figures["rate_per_s"] == 1.0


def test_an_adaptive_cap_backs_off_on_saturation_and_never_passes_the_hosts_slots(
    ledger: Ledger,
) -> None:
    host(ledger, "c1", "cloud", slots=5)
    ledger.set_pool(cloud(adaptive=Adaptive(start=4, step=4, interval_s=10)), T0)
    for i in range(40):
        submit(ledger, key=f"k{i}")
    _run_interval(ledger, T0, knee=100)
    [raised] = ledger.govern(T0 + 10)
    assert (raised.kind, raised.cap) == ("raised", 5)  # not 8: the host has 5 slots
    _run_interval(ledger, T0 + 10, knee=100)
    [event] = ledger.govern(T0 + 20, saturated="gateway queue depth 300")
    assert (event.kind, event.cap) == ("lowered", 3)  # 5 x 0.7
    assert "gateway queue depth 300" in event.message
    # A gate's pause backs an adaptive pool off at once, and holds it while paused.
    ledger.set_pool(cloud(adaptive=Adaptive(start=4, step=4, interval_s=10),
                          gates=Gates(p95_ms=100)), T0 + 21)  # fmt: skip
    events = ledger.govern(T0 + 22, p95_ms=900.0)
    assert [e.kind for e in events] == ["paused", "lowered"]
    assert ledger.govern(T0 + 40, p95_ms=900.0) == []


def test_device_seconds_are_charged_to_the_rollouts_latest_attempt(ledger: Ledger) -> None:
    host(ledger, "c1", "cloud")
    retry = RetryPolicy(max_attempts=3, initial_backoff_s=1, max_backoff_s=1)
    rollout, _ = submit(ledger, retry=retry)
    [a] = ledger.claim("c1", 1, T0, LONG)
    assert ledger.add_device_seconds({rollout.id: 0.25, "r-unknown": 1.0}) == 1
    ledger.complete("c1", done(a.work_id, a.fencing_token, Outcome.TRANSIENT_ERROR), T0 + 1)
    [b] = ledger.claim("c1", 1, T0 + 3, LONG)
    ledger.add_device_seconds({rollout.id: 0.5})
    ledger.add_device_seconds({rollout.id: 0.125})
    ledger.complete("c1", done(b.work_id, b.fencing_token), T0 + 4)
    costs = ledger.cost_attempts(T0)
    assert [(c.final, c.device_s) for c in costs] == [(False, 0.25), (True, 0.625)]
