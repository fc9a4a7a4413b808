"""Hosts and operations: registration, cordon and drain, rollback, pools, prices and cost."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import structlog
from sqlmodel import col, select

from fleet.core.cost import AttemptCost
from fleet.core.errors import (
    FailedPrecondition,
    InvalidArgument,
    NotFound,
)
from fleet.core.lifecycle import RolloutState
from fleet.core.manifest import Manifest
from fleet.core.placement import HostCapabilities, Pool, is_local
from fleet.ledger import pools as pool_sql
from fleet.ledger.base import CORDONED, DRAINED, DRAINING, HOST_STATES, HostView
from fleet.ledger.identity import check_labels
from fleet.ledger.leases import Leases
from fleet.ledger.pools import PoolEvent, PoolView
from fleet.ledger.raw import LEASED, Raw, leases_by_host
from fleet.ledger.tables import (
    HostIdentityRow,
    HostRow,
    ManifestRow,
    RolloutRow,
)

log = structlog.get_logger(__name__)


class Hosts(Leases):
    """(A host drained at its deadline has its leases released as the sweep releases them.)"""

    # -- hosts -------------------------------------------------------------------------------

    def register_host(self, caps: HostCapabilities, now: float) -> None:
        with self._tx() as s:
            row = s.get(HostRow, caps.host_id)
            if row is None:
                row = HostRow(
                    id=caps.host_id,
                    host_class=caps.host_class.value,
                    capabilities_json=caps.model_dump_json(),
                    registered_at=now,
                    last_heartbeat_at=now,
                )
            else:
                row.host_class = caps.host_class.value
                row.capabilities_json = caps.model_dump_json()
                row.last_heartbeat_at = now
                if row.drain_by == "agent":  # its own shutdown's drain: back in service
                    row.state, row.drain_deadline, row.drain_by = "ready", None, ""
            s.add(row)

    def set_host_state(
        self, host_id: str, state: str, drain_deadline: float | None = None, by: str = "operator"
    ) -> None:
        """Cordons (no new work; leases it holds run on), drains (no new work; its leases are
        released at `drain_deadline`), or readies a registered host."""
        if state not in HOST_STATES:
            raise InvalidArgument(f"host state {state!r} is not one of {', '.join(HOST_STATES)}")
        if (state == DRAINING) != (drain_deadline is not None):
            raise InvalidArgument("a drain needs a deadline, and only a drain has one")
        with self._tx() as s:
            row = s.get(HostRow, host_id)
            if row is None:
                raise NotFound(f"no registered host {host_id!r}")
            row.state, row.drain_deadline = state, drain_deadline
            row.drain_by = by if state in (DRAINING, DRAINED) else ""
            s.add(row)

    def agent_drains(self, host_id: str, deadline: float) -> None:
        """An agent shutting down drains its host, unless it is drained or draining already
        (an operator's drain keeps its own deadline)."""
        with self._begin() as conn:
            Raw.of(conn, self._pg).run(
                "UPDATE hosts SET state = ?, drain_deadline = ?, drain_by = ? "
                "WHERE id = ? AND state NOT IN (?, ?)",
                (DRAINING, deadline, "agent", host_id, DRAINING, DRAINED),
            )

    # -- rollback to the local pool ---------------------------------------------------------

    def rollback_state(self) -> dict[str, Any] | None:
        """{"since": time, "local_pool": name or ""} while a rollback is in force."""
        with self._begin() as conn:
            rows = Raw.of(conn, self._pg).all(
                "SELECT value_json FROM settings WHERE key = ?", ("rollback",)
            )
        return dict(json.loads(rows[0][0])) if rows else None

    def rollback(self, deadline: float, now: float, local_pool: str = "") -> list[str]:
        """Rolls back to the local pool: every other host is set draining until `deadline`
        (what it runs then is released and retried on the local pool), nothing new goes to
        any host outside it, and the local gpu hosts take cpu-class work too, until
        `undo_rollback`. Returns the hosts set draining."""
        with self._begin() as conn:
            db = Raw.of(conn, self._pg)
            if db.all(f"SELECT key FROM settings WHERE key = ?{db.lock}", ("rollback",)):
                raise FailedPrecondition("a rollback is in force already: undo it first")
            if local_pool and not db.all("SELECT name FROM pools WHERE name = ?", (local_pool,)):
                raise NotFound(f"no pool {local_pool!r} (fleet pool list)")
            db.run(
                "INSERT INTO settings (key, value_json, updated_at) VALUES (?, ?, ?)",
                ("rollback", json.dumps({"since": now, "local_pool": local_pool}), now),
            )
            _, local = self._rollback(db)
            drained = []
            for host_id, caps, state in db.all(
                f"SELECT id, capabilities_json, state FROM hosts ORDER BY id{db.lock}", ()
            ):
                if state in ("ready", CORDONED) and not is_local(
                    HostCapabilities.model_validate_json(caps), local
                ):
                    db.run(
                        "UPDATE hosts SET state = ?, drain_deadline = ?, drain_by = ? WHERE id = ?",
                        (DRAINING, deadline, "rollback", host_id),
                    )
                    drained.append(host_id)
            return drained

    def undo_rollback(self) -> list[str]:
        """Ends the rollback: the hosts it drained are ready again; returns them."""
        with self._begin() as conn:
            db = Raw.of(conn, self._pg)
            if not db.run("DELETE FROM settings WHERE key = ?", ("rollback",)):
                raise FailedPrecondition("no rollback is in force")
            hosts = [row[0] for row in db.all(
                "SELECT id FROM hosts WHERE drain_by = ? ORDER BY id", ("rollback",))]  # fmt: skip
            db.run(
                "UPDATE hosts SET state = ?, drain_deadline = NULL, drain_by = '' "
                "WHERE drain_by = ?",
                ("ready", "rollback"),
            )
            return hosts

    # -- cost ---------------------------------------------------------------------------------

    def set_prices(self, prices: Mapping[str, float], now: float) -> None:
        """Prices per host class and hour (`fleet serve --price`), for `fleet report`."""
        with self._begin() as conn:
            db = Raw.of(conn, self._pg)
            db.run("DELETE FROM settings WHERE key = ?", ("prices",))
            db.run(
                "INSERT INTO settings (key, value_json, updated_at) VALUES (?, ?, ?)",
                ("prices", json.dumps(dict(prices), sort_keys=True), now),
            )

    def prices(self) -> dict[str, float]:
        with self._begin() as conn:
            rows = Raw.of(conn, self._pg).all(
                "SELECT value_json FROM settings WHERE key = ?", ("prices",)
            )
        return {k: float(v) for k, v in json.loads(rows[0][0]).items()} if rows else {}

    def cost_attempts(self, since: float, by_label: str = "") -> list[AttemptCost]:
        """Every attempt of the rollouts that ended since `since`, grouped by the pool of the
        host it ran on (the first pool by name that holds it; "-": none), or by the rollout's
        label `by_label`."""
        with self._begin() as conn:
            db = Raw.of(conn, self._pg)
            hosts = {
                caps.host_id: caps
                for caps in (HostCapabilities.model_validate_json(c)
                             for (c,) in db.all("SELECT capabilities_json FROM hosts", ()))
            }  # fmt: skip
            in_pools = pool_sql.read(db)
            rows = db.all(
                "SELECT r.id, r.state, r.labels_json, w.attempt, a.attempt, a.host_id, "
                "a.started_at, a.ended_at, a.cpu_s, a.peak_memory_mib, a.device_s FROM rollouts r "
                "JOIN work_items w ON w.rollout_id = r.id JOIN attempts a ON a.work_id = w.id "
                "WHERE r.finished_at >= ? ORDER BY r.id, a.attempt",
                (since,),
            )
        out = []
        for rid, state, labels, last, attempt, host_id, start, end, cpu, peak, device in rows:
            caps = hosts.get(host_id)
            if by_label:
                group = json.loads(labels).get(by_label, "-")
            else:
                group = next((p.name for p in in_pools if caps and p.holds(caps)), "-")
            out.append(
                AttemptCost(
                    rollout_id=rid,
                    succeeded=state == RolloutState.SUCCEEDED.value,
                    final=attempt == last,
                    group=group,
                    host_class=caps.host_class.value if caps else "cpu",
                    host_slots=caps.slots if caps else 1,
                    wall_s=max(0.0, float(end or start) - float(start)),
                    cpu_s=float(cpu or 0.0),
                    peak_memory_mib=float(peak or 0.0),
                    device_s=float(device or 0.0),
                    ended_at=float(end or start),
                )
            )
        return out

    # -- pools ------------------------------------------------------------------------------

    def set_pool(self, pool: Pool, now: float) -> None:
        """Makes or changes a pool; claims see it at once, on every server."""
        check_labels(pool.labels)
        if pool.max_running < 0:
            raise InvalidArgument(f"max_running must be 0 (no cap) or more, got {pool.max_running}")
        with self._begin() as conn:
            pool_sql.write(Raw.of(conn, self._pg), pool, now)

    def delete_pool(self, name: str) -> None:
        with self._begin() as conn:
            if not Raw.of(conn, self._pg).run("DELETE FROM pools WHERE name = ?", (name,)):
                raise NotFound(f"no pool {name!r}")

    def pools(self) -> list[PoolView]:
        """Every pool, with its hosts, the leases they hold now, and its gates' state."""
        with self._begin() as conn:
            return pool_sql.views(Raw.of(conn, self._pg))

    def govern(
        self, now: float, p95_ms: float | None = None, queue_age_ms: float | None = None,
        saturated: str = "",
    ) -> list[PoolEvent]:  # fmt: skip
        """Pauses and resumes pools by their gates, and moves adaptive pools' caps (see
        `fleet.ledger.pools.govern`); the gateway's figures are as the server last read them,
        `saturated` says why it is past its limit ("": it is not)."""
        with self._begin() as conn:
            return pool_sql.govern(Raw.of(conn, self._pg), now, p95_ms, queue_age_ms, saturated)

    def pool_events(self, since: float, pool: str = "", limit: int = 1000) -> list[PoolEvent]:
        with self._begin() as conn:
            return pool_sql.events(Raw.of(conn, self._pg), since, pool, limit)

    def add_device_seconds(self, seconds: Mapping[str, float]) -> int:
        """Charges the gateway's device seconds to each rollout's latest attempt (the one that
        made the requests, or that was running when they were answered). Returns the attempts
        charged."""
        if not seconds:
            return 0
        charged = 0
        with self._begin() as conn:
            db = Raw.of(conn, self._pg)
            for rollout_id, spent in sorted(seconds.items()):
                charged += db.run(
                    "UPDATE attempts SET device_s = device_s + ? WHERE id = (SELECT a.id FROM "
                    "attempts a JOIN work_items w ON w.id = a.work_id WHERE w.rollout_id = ? "
                    "ORDER BY a.started_at DESC, a.id DESC LIMIT 1)",
                    (float(spent), rollout_id),
                )
        return charged

    def drain_sweep(self, now: float) -> list[tuple[str, int]]:
        """Draining hosts that hold no lease are drained; those past their deadline have their
        leases released (retried elsewhere by the usual rules, their old attempts fenced off)
        and are drained. Returns (host, leases released) for each host drained."""
        done: list[tuple[str, int]] = []
        with self._begin() as conn:
            db = Raw.of(conn, self._pg)
            for host_id, deadline in db.all(
                f"SELECT id, drain_deadline FROM hosts WHERE state = ?{db.lock}", (DRAINING,)
            ):
                held = int(
                    db.all(
                        "SELECT count(*) FROM work_items WHERE lease_owner = ? AND state = ?",
                        (host_id, LEASED),
                    )[0][0]
                )
                if held and (deadline is None or now < float(deadline)):
                    continue
                if held:
                    db.run(
                        "UPDATE work_items SET lease_expires_at = ? WHERE lease_owner = ? "
                        "AND state = ?",
                        (now - 1.0, host_id, LEASED),
                    )
                db.run(
                    "UPDATE hosts SET state = ?, drain_deadline = NULL WHERE id = ?",
                    (DRAINED, host_id),
                )
                done.append((host_id, held))
        if any(released for _, released in done):
            self.sweep(now)
        return done

    def host_states(self) -> dict[str, str]:
        """Every registered host's state."""
        with self._tx() as s:
            return {r.id: r.state for r in s.exec(select(HostRow))}

    def host_table(self, now: float, unresponsive_after_s: float) -> list[HostView]:
        """Every registered host as an operator sees it: what it offers, its state (a ready or
        cordoned host that has not beaten for `unresponsive_after_s` shows as unresponsive),
        its agent's version, the slots its leases hold, and its last beat."""
        with self._begin() as conn:
            db = Raw.of(conn, self._pg)
            held = leases_by_host(db)
            revoked = {
                row[0]
                for row in db.all(
                    "SELECT host_id FROM host_identities WHERE revoked_at IS NOT NULL", ()
                )
            }
            out = []
            for host_id, caps_json, state, beat, images in db.all(
                "SELECT id, capabilities_json, state, last_heartbeat_at, images_json FROM hosts "
                "ORDER BY id",
                (),
            ):
                if host_id in revoked:
                    state = "revoked"
                elif now - float(beat) > unresponsive_after_s:
                    state = "unresponsive" if state == "ready" else f"{state}+unresponsive"
                view = HostView(
                    capabilities=HostCapabilities.model_validate_json(caps_json),
                    state=state, slots_used=int(held.get(host_id, 0)),
                    last_heartbeat_at=float(beat), images=json.loads(images or "[]"),
                )  # fmt: skip
                out.append(view)
            return out

    def hosts(self) -> list[HostCapabilities]:
        with self._tx() as s:
            revoked = select(HostIdentityRow.host_id).where(
                col(HostIdentityRow.revoked_at).is_not(None)
            )
            rows = s.exec(
                select(HostRow).where(col(HostRow.id).not_in(revoked)).order_by(col(HostRow.id))
            )
            return [HostCapabilities.model_validate_json(r.capabilities_json) for r in rows]

    def running_rollouts(self, known: Mapping[str, bool]) -> dict[str, bool]:
        """Every running rollout -> whether it calls the inference gateway; `known` holds
        answers already read (manifests never change), so only new rollouts' are parsed."""
        with self._tx() as s:
            rows = s.exec(
                select(RolloutRow.id, RolloutRow.manifest_digest).where(
                    RolloutRow.state == RolloutState.RUNNING.value
                )
            ).all()
            out: dict[str, bool] = {}
            for rollout_id, digest in rows:
                if rollout_id in known:
                    out[rollout_id] = known[rollout_id]
                    continue
                body = s.get(ManifestRow, digest)
                manifest = Manifest.model_validate_json(body.body) if body is not None else None
                out[rollout_id] = bool(manifest and manifest.requirements.inference)
            return out
