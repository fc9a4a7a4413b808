"""Sessions that park and move: `ParkSession`, `ResumeSession`, and the mover that parks the
sessions of draining hosts and resumes them elsewhere.

A park stores the session's disk (its machine's writable layer, as an artifact of its attempt,
reported under `SESSION_LAYER_OUTPUT`) and ends its attempt; its machine is freed. An idle
session parks the same way on its host (its `on_idle`). A resume is a rollout of its own
(label `fleet.resumes=<session id>`, the session's deadline kept), placed on a host of the
session's class that can use the layer (below), whose machine starts from it; the ledger's
`session_parks` maps the session's id, which callers keep, to the rollout that holds it now.
No process carries over, as for forks. A session on a microVM or a warm parent's child cannot
park: FAILED_PRECONDITION (a drain closes it instead, as it always did).

A layer is the namespace runtime's own (an overlay's upper directory with its whiteouts and
overlay attributes, `fleet.runtime.layers`): the smol runtime neither makes one nor starts a
microVM from one. So a resume, and a fork of a parked session, require namespace isolation
(`layer_requirements`), and one that no registered host could start is refused before it is
submitted (`layer_refusal`): the session stays parked rather than fail on a host that cannot
use its layer.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Protocol

import structlog

from fleet.api.pb import fleet_pb2, host_pb2
from fleet.core.errors import FailedPrecondition, FleetError, Unavailable
from fleet.core.lifecycle import RolloutState
from fleet.core.manifest import (
    SessionSpec,
    SubmitRequest,
    validate_request,
)
from fleet.core.placement import (
    HostCapabilities,
    HostClass,
    Isolation,
    Requirements,
    refusal,
    unservable_reason,
)
from fleet.core.rollout import Rollout
from fleet.ledger.parks import (
    CLOSED,
    PARKED,
    RESUMES_LABEL,
    Park,
    parked_layer,
    session_state,
)

if TYPE_CHECKING:
    from fleet.server.core import Core
    from fleet.server.hub import SessionHub


class Sessions(Protocol):
    """What the mover needs of the sessions' servicer (`fleet.server.sessions`), which owns
    the mover: named here so that the two modules do not import each other."""

    core: Core
    hub: SessionHub
    _known: dict[str, tuple[str, str, str]]

    async def _session(self, session_id: str) -> Rollout: ...

    async def _until_ready(self, session_id: str, wait: float, call: str) -> fleet_pb2.Session: ...

    async def _until_final(self, session_id: str, wait_s: float = 10.0) -> Rollout: ...


log = structlog.get_logger(__name__)

MOVE_EVERY_S = 1.0
"""How often the mover looks for sessions on draining hosts."""
PARK_END_S = 30.0
"""How long a park waits for the parked attempt's report, after the host stored its layer."""


def session_pb(
    session_id: str, first: Rollout, rollout: Rollout, park: Park | None, host_id: str = ""
) -> fleet_pb2.Session:
    """The session as callers see it: its own id and opening time, the state and host of the
    rollout that holds it now, and its layer where it is parked."""
    layer = parked_layer(rollout, park)
    out = fleet_pb2.Session(
        id=session_id, state=session_state(rollout, park), host_id=host_id, tenant=first.tenant,
        error=rollout.error if rollout.state.final and layer is None else "",
        layer_digest=layer.digest if layer else "", layer_size=layer.size if layer else 0,
    )  # fmt: skip
    out.opened_at.FromDatetime(first.created_at.astimezone(UTC))
    return out


def layer_requirements(needs: Requirements) -> Requirements:
    """What a machine started from a parked session's layer needs of its host: the session's
    own requirements, on the namespace runtime that made the layer (no other can use it)."""
    return needs.model_copy(update={"isolation": Isolation.NAMESPACE})


def layer_refusal(
    hosts: list[HostCapabilities], host_class: HostClass, needs: Requirements
) -> str | None:
    """Why no registered host could ever start a machine from a layer, for work of
    `host_class` that needs `needs` (`layer_requirements`); None when one could."""
    if any(
        h.isolation == Isolation.NAMESPACE and refusal(h, host_class, needs) is None for h in hosts
    ):
        return None
    anywhere = needs.model_copy(update={"isolation": Isolation.ANY})
    unmet = unservable_reason(hosts, host_class, anywhere)
    if unmet is not None:  # (no host of either runtime could)
        return unmet
    return (
        f"no registered host can start a machine from the parked layer: it needs a "
        f"{host_class}-class host of the namespace runtime, which made the layer, and every "
        f"{host_class}-class host that could serve it runs microVMs (the smol runtime cannot "
        "unpack a layer)"
    )


class SessionMoves:
    """Parks, resumes and moves the sessions of one `SessionServicer`."""

    def __init__(self, sessions: Sessions) -> None:
        self.sessions = sessions
        self.core = sessions.core
        self.hub = sessions.hub
        self._moving: dict[str, asyncio.Task[None]] = {}
        """Sessions' rollouts being moved off a draining host, by rollout id."""

    async def current(self, session_id: str) -> tuple[Rollout, Rollout, Park | None]:
        """(the caller's session's first rollout, the rollout holding it now, its park row)."""
        first = await self.sessions._session(session_id)
        return (first, *await self._current(first))

    async def _current(self, first: Rollout) -> tuple[Rollout, Park | None]:
        park = await self.core.db(self.core.ledger.session_park, first.id)
        if park is None or park.rollout_id == first.id:
            return first, park
        return await self.core.db(self.core.ledger.get, park.rollout_id), park

    async def park(self, session_id: str) -> fleet_pb2.Session:
        first, rollout, park = await self.current(session_id)
        park = await self._park(session_id, rollout, park, "parked by its caller")
        rollout = await self.core.db(self.core.ledger.get, rollout.id)
        return session_pb(session_id, first, rollout, park)

    async def _park(
        self, session_id: str, rollout: Rollout, park: Park | None, reason: str
    ) -> Park | None:
        """Parks the session held by `rollout` (already parked: nothing to do); the park row
        as it stands after."""
        if rollout.state.final:
            layer = parked_layer(rollout, park)
            if layer is None:
                raise FailedPrecondition(
                    f"session {session_id} is {session_state(rollout, park).lower()}: only an open "
                    "session can park"
                )
            if park is not None and park.rollout_id == rollout.id and park.state != CLOSED:
                return park
            return await self.core.db(
                self.core.ledger.record_park, session_id, rollout.id, layer.digest, layer.size,
                rollout.host_id, datetime.now(UTC).timestamp(),
            )  # fmt: skip
        lease = await self.core.db(self.core.ledger.rollout_lease, rollout.id)
        if lease is None or not self.hub.is_ready(lease[1], lease[0]):
            raise Unavailable(
                f"session {session_id} is not ready (its machine is starting or closing, or its "
                "host is not connected): retry the park"
            )
        work_id, host_id = lease
        command = host_pb2.SessionCommand(work_id=work_id, park=host_pb2.SessionPark(reason=reason))
        stored: host_pb2.SessionParked | None = None
        async for reply in self.hub.call(host_id, session_id, command):
            if reply.WhichOneof("kind") == "parked":
                stored = reply.parked
        if stored is None:
            raise FailedPrecondition(f"session {session_id}: host {host_id} did not park it")
        self.sessions._known.pop(session_id, None)
        park = await self.core.db(
            self.core.ledger.record_park, session_id, rollout.id, stored.digest, stored.size,
            host_id, datetime.now(UTC).timestamp(),
        )  # fmt: skip
        log.info("session_parked", session_id=session_id, rollout_id=rollout.id,
                 host_id=host_id, layer=stored.digest, bytes=stored.size)  # fmt: skip
        await self.sessions._until_final(rollout.id, PARK_END_S)
        return park

    async def resume(self, session_id: str, wait: float) -> fleet_pb2.Session:
        first, rollout, park = await self.current(session_id)
        return await self._resume(session_id, first, rollout, park, wait)

    async def _resume(
        self, session_id: str, first: Rollout, rollout: Rollout, park: Park | None, wait: float
    ) -> fleet_pb2.Session:
        """A rollout that opens the parked session again (one per park: a repeat finds it),
        once its machine is ready; an open session is waited for as it is."""
        if not rollout.state.final:
            ready = await self.sessions._until_ready(rollout.id, wait, "ResumeSession")
            return session_pb(session_id, first, rollout, park, ready.host_id)
        layer = parked_layer(rollout, park)
        if layer is None:
            raise FailedPrecondition(
                f"session {session_id} is {session_state(rollout, park).lower()}, not parked: "
                "there is nothing to resume"
            )
        now = datetime.now(UTC)
        assert rollout.manifest.session is not None
        spec = SessionSpec(
            idle_timeout_s=rollout.manifest.session.idle_timeout_s,
            on_idle=rollout.manifest.session.on_idle, layer=layer.digest, layer_size=layer.size,
        )  # fmt: skip
        needs = layer_requirements(rollout.manifest.requirements)
        manifest = rollout.manifest.model_copy(update={"session": spec, "requirements": needs})
        labels = {k: v for k, v in first.labels.items() if not k.startswith("fleet.")}
        # One resume per park, which a repeat finds. A session parked again because its resume
        # failed before its machine started has a park row of that time: a resume of its own.
        again = f"@{park.updated_at!r}" if park is not None and park.state == PARKED else ""
        submit = SubmitRequest(
            idempotency_key=f"{session_id}/resume/{rollout.id}{again}", smolfile=manifest.smolfile,
            smolfile_name=manifest.smolfile_name, steps=(), deadline=manifest.deadline,
            retry=manifest.retry, labels={**labels, RESUMES_LABEL: session_id},
            tenant=rollout.tenant, requirements=manifest.requirements, session=spec,
            models=manifest.models, max_prompt_tokens=manifest.max_prompt_tokens,
            max_completion_tokens=manifest.max_completion_tokens,
        )  # fmt: skip
        if manifest.deadline <= now:
            raise FailedPrecondition(
                f"session {session_id} is past its lifetime (it ended at "
                f"{manifest.deadline.isoformat()}): it cannot be resumed; fork it instead"
            )
        await asyncio.to_thread(
            validate_request, submit, now, timedelta(seconds=self.core.config.max_deadline_s)
        )
        await self.check_layer_placeable(session_id, manifest.host_class, needs)
        [(resumed_id, created)] = await self.core.db(
            functools.partial(
                self.core.ledger.submit_many,
                max_active_per_tenant=self.core.config.max_active_per_tenant,
            ),
            [(submit, manifest)], now.timestamp(),
        )  # fmt: skip
        park = await self.core.db(
            self.core.ledger.record_resume, session_id, resumed_id, layer.digest, layer.size,
            park.parked_from if park is not None else rollout.host_id, now.timestamp(),
        )  # fmt: skip
        if created:
            self.core.changed()
        log.info("session_resume_submitted", session_id=session_id, rollout_id=resumed_id,
                 layer=layer.digest)  # fmt: skip
        try:
            ready = await self.sessions._until_ready(resumed_id, wait, "ResumeSession")
        except FailedPrecondition as exc:  # its rollout ended: parked again, or failed
            _, holder, park = await self.current(session_id)
            state = session_state(holder, park)
            log.warning("session_resume_failed", session_id=session_id, rollout_id=resumed_id,
                        state=state, error=exc.message)  # fmt: skip
            retry = ": resume it again" if state == PARKED else ""
            raise FailedPrecondition(
                f"session {session_id} did not resume (rollout {resumed_id}): {exc.message}; "
                f"the session is {state.lower()}{retry}"
            ) from None
        resumed = await self.core.db(self.core.ledger.get, resumed_id)
        return session_pb(session_id, first, resumed, park, ready.host_id)

    async def check_layer_placeable(
        self, session_id: str, host_class: HostClass, needs: Requirements
    ) -> None:
        """FAILED_PRECONDITION, before anything is submitted, where no registered host could
        start a machine from the parked session's layer (read afresh: a host that registered
        through another replica counts)."""
        hosts = await self.core.db(self.core.ledger.hosts)
        why = layer_refusal(hosts, host_class, needs)
        if why is not None:
            raise FailedPrecondition(f"session {session_id} stays parked: {why}")

    async def close_parked(self, session_id: str, first: Rollout, park: Park | None) -> None:
        """A parked session closed by its caller: never resumed after."""
        if park is None:
            park = await self.core.db(
                self.core.ledger.record_park, session_id, first.id, "", 0, first.host_id,
                datetime.now(UTC).timestamp(),
            )  # fmt: skip
        await self.core.db(
            self.core.ledger.record_park_closed, session_id, datetime.now(UTC).timestamp()
        )

    # -- draining hosts ----------------------------------------------------------------------

    async def move_drained_forever(self) -> None:
        """Moves the sessions of draining hosts connected to this server, until cancelled."""
        try:
            while True:
                try:
                    await self.move_drained()
                except FleetError as exc:
                    log.warning("session_moves_failed", code=exc.code, error=exc.message)
                except Exception:
                    log.exception("session_moves_failed")
                await asyncio.sleep(MOVE_EVERY_S)
        finally:
            for task in self._moving.values():
                task.cancel()

    async def move_drained(self) -> list[str]:
        """Starts moving each session leased to a draining host connected here (each once);
        returns the rollouts it started to move. Their hosts hold no new work meanwhile."""
        found = await self.core.db(self.core.ledger.sessions_on_draining_hosts)
        started = []
        for rollout_id, host_id in found:
            if rollout_id in self._moving or host_id not in self.hub.links:
                continue
            task = asyncio.create_task(self._move(rollout_id, host_id))
            self._moving[rollout_id] = task
            started.append(rollout_id)
        leased = {rollout_id for rollout_id, _ in found}
        for rollout_id in [r for r, t in self._moving.items() if t.done() and r not in leased]:
            del self._moving[rollout_id]
        return started

    async def _move(self, rollout_id: str, host_id: str) -> None:
        """Parks the session `rollout_id` holds and resumes it elsewhere; a session that cannot
        park is closed (its host drains)."""
        park = await self.core.db(self.core.ledger.park_of_rollout, rollout_id)
        session_id = park.session_id if park is not None else rollout_id
        bound = log.bind(session_id=session_id, rollout_id=rollout_id, host_id=host_id)
        try:
            first = await self.core.db(self.core.ledger.get, session_id)
            rollout = await self.core.db(self.core.ledger.get, rollout_id)
            park = await self._park(session_id, rollout, park, f"its host {host_id} drains")
        except FleetError as exc:
            now = await self.core.db(self.core.ledger.get, rollout_id)
            if now.state != RolloutState.RUNNING:
                # Parked (or ended) meanwhile: each replica reaches a host's sessions, and
                # another one that saw the drain moves it; there is nothing left to close.
                bound.info("session_moved_elsewhere", state=now.state.value, why=exc.message)
                return
            bound.warning("session_not_moved", code=exc.code, error=exc.message)
            await self._close_on(host_id, rollout_id, f"its host {host_id} drains and it could "
                                 f"not park: {exc.message}")  # fmt: skip
            return
        rollout = await self.core.db(self.core.ledger.get, rollout_id)
        try:
            moved = await self._resume(session_id, first, rollout, park, 300.0)
        except FleetError as exc:  # parked still: its caller may resume it later
            bound.warning("session_not_resumed", code=exc.code, error=exc.message)
            return
        bound.info("session_moved", to=moved.host_id)

    async def _close_on(self, host_id: str, rollout_id: str, reason: str) -> None:
        lease = await self.core.db(self.core.ledger.rollout_lease, rollout_id)
        if lease is None:
            return
        close = host_pb2.SessionClose(reason=reason)
        command = host_pb2.SessionCommand(work_id=lease[0], close=close)
        with contextlib.suppress(FleetError):
            async for _ in self.hub.call(host_id, rollout_id, command):
                pass
