"""Hosts and operations: registration, cordon and drain, rollback, pools, prices and cost."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import structlog

from fleet.core.cost import AttemptCost
from fleet.core.errors import (
    FailedPrecondition,
    InvalidArgument,
    NotFound,
)
from fleet.core.labels import check_labels
from fleet.core.lifecycle import RolloutState
from fleet.core.placement import HostCapabilities, Pool, is_local
from fleet.ledger import pools as pool_sql
from fleet.ledger import queries as Q
from fleet.ledger.base import CORDONED, DRAINED, DRAINING, HOST_STATES, HostView
from fleet.ledger.leases import Leases
from fleet.ledger.pools import PoolEvent, PoolView, leases_by_host
from fleet.ledger.raw import LEASED, QUEUED

log = structlog.get_logger(__name__)


class Hosts(Leases):
    """(A host drained at its deadline has its leases released as the sweep releases them.)"""

    # -- hosts -------------------------------------------------------------------------------

    def register_host(self, caps: HostCapabilities, now: float) -> None:
        values = (caps.host_class.value, caps.model_dump_json(), now)
        with self._tx() as db:
            if not db.run(Q.REREGISTER_HOST, (*values, caps.host_id)):
                db.run(Q.REGISTER_HOST, (caps.host_id, *values, now))

    def set_host_state(
        self, host_id: str, state: str, drain_deadline: float | None = None, by: str = "operator"
    ) -> None:
        """Cordons (no new work; leases it holds run on), drains (no new work; its leases are
        released at `drain_deadline`), or readies a registered host."""
        if state not in HOST_STATES:
            raise InvalidArgument(f"host state {state!r} is not one of {', '.join(HOST_STATES)}")
        if (state == DRAINING) != (drain_deadline is not None):
            raise InvalidArgument("a drain needs a deadline, and only a drain has one")
        drain_by = by if state in (DRAINING, DRAINED) else ""
        with self._tx() as db:
            if not db.run(Q.SET_HOST_STATE, (state, drain_deadline, drain_by, host_id)):
                raise NotFound(f"no registered host {host_id!r}")

    def agent_drains(self, host_id: str, deadline: float) -> None:
        """An agent shutting down drains its host, unless it is drained or draining already
        (an operator's drain keeps its own deadline)."""
        with self._tx() as db:
            db.run(Q.AGENT_DRAINS, (DRAINING, deadline, "agent", host_id, DRAINING, DRAINED))

    # -- rollback to the local pool ---------------------------------------------------------

    def rollback_state(self) -> dict[str, Any] | None:
        """{"since": time, "local_pool": name or ""} while a rollback is in force."""
        with self._read() as db:
            row = db.one(Q.SETTING, ("rollback",))
        return dict(json.loads(row[0])) if row else None

    def rollback(self, deadline: float, now: float, local_pool: str = "") -> list[str]:
        """Rolls back to the local pool: every other host is set draining until `deadline`
        (what it runs then is released and retried on the local pool), nothing new goes to
        any host outside it, and the local gpu hosts take cpu-class work too, until
        `undo_rollback`. Returns the hosts set draining."""
        with self._tx() as db:
            if db.one(Q.SETTING_FOR_UPDATE, ("rollback",)):
                raise FailedPrecondition("a rollback is in force already: undo it first")
            if local_pool and not pool_sql.read(db, local_pool):
                raise NotFound(f"no pool {local_pool!r} (fleet pool list)")
            db.run(
                Q.INSERT_SETTING,
                ("rollback", json.dumps({"since": now, "local_pool": local_pool}), now),
            )
            _, local = self._rollback(db)
            drained = []
            for host_id, caps, state in db.all(Q.HOSTS_FOR_UPDATE):
                if state in ("ready", CORDONED) and not is_local(
                    HostCapabilities.model_validate_json(caps), local
                ):
                    db.run(Q.SET_HOST_STATE, (DRAINING, deadline, "rollback", host_id))
                    drained.append(host_id)
            return drained

    def undo_rollback(self) -> list[str]:
        """Ends the rollback: the hosts it drained are ready again; returns them."""
        with self._tx() as db:
            if not db.run(Q.DELETE_SETTING, ("rollback",)):
                raise FailedPrecondition("no rollback is in force")
            hosts = [row[0] for row in db.all(Q.HOSTS_DRAINED_BY, ("rollback",))]
            db.run(Q.READY_HOSTS_DRAINED_BY, ("ready", "rollback"))
            return hosts

    # -- cost ---------------------------------------------------------------------------------

    def set_prices(self, prices: Mapping[str, float], now: float) -> None:
        """Prices per host class and hour (`fleet serve --price`), for `fleet report`."""
        with self._tx() as db:
            db.run(Q.DELETE_SETTING, ("prices",))
            db.run(Q.INSERT_SETTING, ("prices", json.dumps(dict(prices), sort_keys=True), now))

    def prices(self) -> dict[str, float]:
        with self._read() as db:
            row = db.one(Q.SETTING, ("prices",))
        return {k: float(v) for k, v in json.loads(row[0]).items()} if row else {}

    def cost_attempts(self, since: float, by_label: str = "") -> list[AttemptCost]:
        """Every attempt of the rollouts that ended since `since`, grouped by the pool of the
        host it ran on (the first pool by name that holds it; "-": none), or by the rollout's
        label `by_label`."""
        with self._read() as db:
            hosts = {
                caps.host_id: caps
                for caps in (HostCapabilities.model_validate_json(c)
                             for (c,) in db.all(Q.HOSTS_CAPABILITIES))
            }  # fmt: skip
            in_pools = pool_sql.read(db)
            rows = db.all(Q.ATTEMPTS_FINISHED_SINCE, (since,))
            tokens: dict[int, dict[str, tuple[int, int]]] = {}
            for attempt_id, model, prompt, completion in db.all(
                Q.TOKENS_OF_ATTEMPTS_FINISHED_SINCE, (since,)
            ):
                tokens.setdefault(int(attempt_id), {})[model] = (int(prompt), int(completion))
        out = []
        for rid, state, labels, last, attempt, host_id, start, end, cpu, peak, device, aid in rows:
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
                    tokens=tokens.get(int(aid), {}),
                )
            )
        return out

    # -- pools ------------------------------------------------------------------------------

    def set_pool(self, pool: Pool, now: float) -> None:
        """Makes or changes a pool; claims see it at once, on every server."""
        check_labels(pool.labels)
        if pool.max_running < 0:
            raise InvalidArgument(f"max_running must be 0 (no cap) or more, got {pool.max_running}")
        with self._tx() as db:
            pool_sql.write(db, pool, now)

    def delete_pool(self, name: str) -> None:
        with self._tx() as db:
            if not db.run(Q.DELETE_POOL, (name,)):
                raise NotFound(f"no pool {name!r}")

    def pools(self) -> list[PoolView]:
        """Every pool, with its hosts, the leases they hold now, and its gates' state."""
        with self._read() as db:
            return pool_sql.views(db)

    def govern(
        self, now: float, p95_ms: float | None = None, queue_age_ms: float | None = None,
        saturated: str = "",
    ) -> list[PoolEvent]:  # fmt: skip
        """Pauses and resumes pools by their gates, and moves adaptive pools' caps (see
        `fleet.ledger.pools.govern`); the gateway's figures are as the server last read them,
        `saturated` says why it is past its limit ("": it is not)."""
        with self._tx() as db:
            return pool_sql.govern(db, now, p95_ms, queue_age_ms, saturated)

    def pool_events(self, since: float, pool: str = "", limit: int = 1000) -> list[PoolEvent]:
        with self._read() as db:
            return pool_sql.events(db, since, pool, limit)

    def add_device_seconds(self, seconds: Mapping[str, float]) -> int:
        """Charges the gateway's device seconds to each rollout's latest attempt (the one that
        made the requests, or that was running when they were answered). Returns the attempts
        charged."""
        if not seconds:
            return 0
        charged = 0
        with self._tx() as db:
            for rollout_id, spent in sorted(seconds.items()):
                charged += db.run(Q.CHARGE_DEVICE_SECONDS, (float(spent), rollout_id))
        return charged

    def add_usage(
        self, seconds: Mapping[str, float],
        tokens: Mapping[str, Mapping[str, tuple[int, int]]],
    ) -> int:  # fmt: skip
        """Charges what one gateway poll was handed, in one transaction (all of it or, when
        the transaction fails, none: the gateway hands it again): device seconds as
        `add_device_seconds` does, and each rollout's {model: (prompt, completion)} tokens to
        its latest attempt, in all and by model. Returns the attempts charged tokens."""
        charged = 0
        with self._tx() as db:
            for rollout_id, spent in sorted(seconds.items()):
                db.run(Q.CHARGE_DEVICE_SECONDS, (float(spent), rollout_id))
            for rollout_id, by_model in sorted(tokens.items()):
                row = db.one(Q.LATEST_ATTEMPT_OF_ROLLOUT, (rollout_id,))
                if row is None:  # (not a rollout of this fleet, or deleted since)
                    continue
                attempt_id = int(row[0])
                prompt = sum(int(p) for p, _ in by_model.values())
                completion = sum(int(c) for _, c in by_model.values())
                db.run(Q.CHARGE_TOKENS, (prompt, completion, attempt_id))
                for model, (p, c) in sorted(by_model.items()):
                    db.run(Q.CHARGE_MODEL_TOKENS, (attempt_id, model, int(p), int(c)))
                charged += 1
        return charged

    def drain_sweep(self, now: float) -> list[tuple[str, int]]:
        """Draining hosts that hold no lease are drained; those past their deadline have their
        leases released (retried elsewhere by the usual rules, their old attempts fenced off)
        and are drained. Returns (host, leases released) for each host drained."""
        done: list[tuple[str, int]] = []
        with self._tx() as db:
            for host_id, deadline in db.all(Q.HOSTS_IN_STATE_FOR_UPDATE, (DRAINING,)):
                held = int(db.value(Q.LEASES_OF_HOST, (host_id, LEASED)))
                if held and (deadline is None or now < float(deadline)):
                    continue
                if held:
                    db.run(Q.EXPIRE_LEASES_OF_HOST, (now - 1.0, host_id, LEASED))
                db.run(Q.HOST_DRAINED, (DRAINED, host_id))
                done.append((host_id, held))
        if any(released for _, released in done):
            self.sweep(now)
        return done

    def host_states(self) -> dict[str, str]:
        """Every registered host's state."""
        with self._read() as db:
            return {host_id: state for host_id, state in db.all(Q.HOST_STATES)}

    def host_table(self, now: float, unresponsive_after_s: float) -> list[HostView]:
        """Every registered host as an operator sees it: what it offers, its state (a ready or
        cordoned host that has not beaten for `unresponsive_after_s` shows as unresponsive),
        its agent's version, the slots its leases hold, and its last beat."""
        with self._read() as db:
            held = leases_by_host(db)
            revoked = {row[0] for row in db.all(Q.REVOKED_HOSTS)}
            out = []
            for host_id, caps_json, state, beat, images in db.all(Q.HOST_TABLE):
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

    def retries_due(self, since: float, until: float) -> int:
        """Retries whose backoff ended after `since` and by `until`: work no submission woke
        a waiting claim for."""
        with self._read() as db:
            return int(db.value(Q.BECAME_DUE, (QUEUED, since, until)))

    def live_host_count(self, since: float) -> int:
        """Hosts that beat at or after `since` (how many the fleet asks beats of)."""
        with self._read() as db:
            row = db.one(Q.LIVE_HOST_COUNT, (since,))
        return int(row[0]) if row else 0

    def hosts(self) -> list[HostCapabilities]:
        with self._read() as db:
            rows = db.all(Q.UNREVOKED_HOSTS_CAPABILITIES)
        return [HostCapabilities.model_validate_json(caps) for (caps,) in rows]

    def running_rollouts(self, known: Mapping[str, bool]) -> dict[str, bool]:
        """Every running rollout -> whether it calls the inference gateway; `known` holds
        answers already read (manifests never change), so only new rollouts' are parsed."""
        with self._read() as db:
            running = db.all(Q.ROLLOUTS_IN_STATE, (RolloutState.RUNNING.value,))
            new = {digest for rollout_id, digest in running if rollout_id not in known}
            manifests = self._manifests_raw(db, new)  # (those not in memory: one statement)
            return {
                rollout_id: known[rollout_id] if rollout_id in known
                else manifests[digest].requirements.inference
                for rollout_id, digest in running
            }  # fmt: skip
