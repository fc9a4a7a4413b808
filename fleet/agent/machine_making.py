"""How an attempt's machine is made: the image on this host, the inputs staged, the machine's
spec, the plan (a warm parent's children or machines of their own), and the machine itself:
adopted after a restart, a session's fork, a machine from a parked session's layer
(`_from_layer`), a warm parent's child, or a new one.

`Attempt` (`fleet.agent.attempt`) runs the steps in what is made here and reports; this part
is its base class, kept apart so that each reads on its own. It needs only what it declares
of the attempt.
"""

from __future__ import annotations

import asyncio
import hashlib
from pathlib import Path

import structlog

from fleet.agent import parking
from fleet.agent.config import AttemptHost
from fleet.agent.files import stage_inputs
from fleet.agent.journal import AttemptJournal
from fleet.agent.passage import GATEWAY_SOCKET, child_address
from fleet.agent.running import Finished, Running
from fleet.core.egress import EffectiveEgress, effective_egress
from fleet.core.errors import InvalidArgument, Unavailable
from fleet.core.lifecycle import Outcome
from fleet.core.manifest import OutputArtifact, Step, check_steps
from fleet.core.rollout import Assignment
from fleet.core.smolfile import Smolfile
from fleet.image import oci
from fleet.runtime.base import Machine, MachineSpec, Parkable, resolve_secrets

Steps = list[tuple[int, Step]]
"""Steps to run, with their index in the manifest."""


class MachineMaking:
    """The making of an attempt's machine (see the module docstring): `Attempt` sets the state
    declared here and gives the report an early end carries (`_ended`)."""

    agent: AttemptHost
    running: Running
    a: Assignment
    log: structlog.BoundLogger
    runtime_name: str
    egress: EffectiveEgress | None
    moving: str
    image_ready: bool

    def _ended(self, outcome: Outcome, error: str = "") -> Finished:
        """The attempt ended with `outcome`, carrying its report (`Attempt`'s)."""
        raise NotImplementedError

    def _note(self, how: str) -> None:
        """Adds to what the report says enforced the machine's egress (for review)."""
        if self.egress is not None:
            self.egress = self.egress.model_copy(
                update={"enforced_by": f"{self.egress.enforced_by}; {how}"}
            )

    # -- its first parts, in order ------------------------------------------------------------

    async def _prepare(self) -> tuple[Smolfile, MachineSpec]:
        """The Smolfile checked, the image on disk, the inputs staged: the machine's spec."""
        a, agent = self.a, self.agent
        smolfile = a.manifest.parsed_smolfile().spec
        if a.manifest.session is None:  # a plan no host can run is malformed, not retried
            check_steps(a.manifest.steps)
        self.egress = effective_egress(smolfile, self.runtime_name)
        reference = a.manifest.image_ref if oci.looks_like_reference(a.manifest.image_ref) else ""
        self.moving = "image"
        await agent.images.acquire(agent.stub, a.manifest.image_digest, reference)
        self.running.image = a.manifest.image_digest
        rootfs = await asyncio.to_thread(agent.config.images.rootfs, a.manifest.image_digest)
        self.image_ready, self.moving = True, "inputs"
        staged = await self._stage_inputs()
        self.moving = ""
        spec = MachineSpec(
            name=f"fleet-{a.rollout_id}-a{a.attempt}",
            smolfile=smolfile,
            image_digest=a.manifest.image_digest,
            rootfs=rootfs,
            labels={
                "fleet": "1",
                "host": agent.caps.host_id,
                "rollout": a.rollout_id,
                "attempt": str(a.attempt),
                # The lease it runs under: a restarted agent adopts it only if still held.
                "work": a.work_id,
                "fence": str(a.fencing_token),
            },
            secrets=resolve_secrets(smolfile),
            gateway=self._gateway_for(),
            gateway_tls=bool(agent.config.gateway_ca),
            inputs=staged,
        )
        if spec.gateway is not None:  # recorded for review: what else this machine reached
            where = f"{spec.gateway[0]}:{spec.gateway[1]}"
            self._note(f"plus the inference gateway ({where}), with a token for this rollout")
        return smolfile, spec

    def _plan(self, smolfile: Smolfile) -> tuple[Steps, str | None]:
        """(the steps to run, the warm-up when they run in a warm parent's children)."""
        steps = list(enumerate(self.a.manifest.steps))
        session = self.a.manifest.session
        forks = self.agent.runtime.forks_children
        if session is None:
            steps, warm, why = warm_plan(smolfile, steps, forks, self.runtime_name)
        elif session.fork_of or session.layer:  # a copy of a machine's disk, or of a parked one
            warm, why = None, ""
        else:
            warm, why = warm_session(smolfile, forks, self.runtime_name)
        if why:
            self.log.info("warm_parent_not_used", reason=why)
            self._note(f"ran as its own machine, not a warm parent's child ({why})")
        return steps, warm

    async def _machine(
        self, spec: MachineSpec, steps: Steps, warm: str | None
    ) -> tuple[Machine, Steps, AttemptJournal | None]:
        """The attempt's machine (adopted after a restart, a session's fork, a warm parent's
        child, or a new one), the steps left to run in it, and its journal (None for a warm
        parent's child: it is never adopted after a restart, so no journal of it is read)."""
        a, agent, running = self.a, self.agent, self.running
        if running.adopt is not None:  # (a warm parent's children are never adopted)
            resumed = await asyncio.to_thread(
                AttemptJournal.resume, agent.journal_dir, a.work_id, a.fencing_token
            )
            running.journalled = True
            machine = running.machine = await agent.runtime.adopt(running.adopt, spec)
            running.results = list(resumed.results)
            finished = resumed.finished
            steps = [(i, step) for i, step in steps if i not in finished]
            self.log.info("attempt_resumed", machine=machine.name, steps_done=sorted(finished),
                          init_done=resumed.init_done)  # fmt: skip
            failed = next((r for r in resumed.results if not r.ok), None)
            if failed is not None:  # the old agent died between that step and its report
                why = "timed out" if failed.timed_out else f"exited {failed.exit_code}"
                raise self._ended(Outcome.STEP_FAILED, f"step {failed.index} ({failed.name}) {why}")
            return machine, steps, resumed
        record: AttemptJournal | None = AttemptJournal(
            agent.journal_dir, a.work_id, a.fencing_token
        )
        session = a.manifest.session
        if session is not None and session.fork_of:
            source = agent.sessions.machine_of(session.fork_of)
            if source is None:
                raise self._ended(
                    Outcome.STEP_FAILED,
                    f"session {session.fork_of} is not open on host {agent.caps.host_id}: "
                    "there is nothing to fork",
                )
            machine = await source.fork(spec)
            self.log.info("session_forked", source=session.fork_of, machine=machine.name)
        elif session is not None and session.layer:
            machine = await self._from_layer(spec, session.layer)
        elif warm is not None:
            parent = await agent.warm_parent(a, spec, warm)
            machine = await parent.branch(spec.name)
            record = None
            if parent.carries_memory:  # the warm-up ran once, in the parent
                steps = steps[1:]
            else:  # the parent's disk and memory image carried; not its interpreter
                steps = [(i, with_warm_up(step, warm)) for i, step in steps[1:]]
            channel = machine.channel()
            if spec.gateway is not None and channel is not None and channel.kind == "unix":
                through = child_address(GATEWAY_SOCKET)
                self._note(f"ran as a warm parent's child: its own loopback only, the gateway "
                           f"through {through}, joined by the agent")  # fmt: skip
        else:
            machine = await agent.runtime.create(spec)
        running.machine = machine
        return machine, steps, record

    # -- a session's layer ---------------------------------------------------------------------

    @property
    def spool(self) -> Path:
        return self.agent.config.machines_dir.parent / "spool"

    async def _park(self, machine: Parkable) -> OutputArtifact:
        return await parking.park_layer(machine, self.agent.stub, self.a, self.spool)

    async def _from_layer(self, spec: MachineSpec, digest: str) -> Machine:
        # Until its machine is made, a failure is the layer's (fetched, unpacked, made into a
        # machine), reported as the artifact's: nothing ran, and the server parks the session
        # again rather than end it (`fleet.ledger.parks`).
        self.moving = "layer"
        machine = await parking.machine_from_layer(
            self.agent.runtime, self.agent.stub, self.a, self.spool, spec, digest
        )
        self.moving = ""
        self.log.info("session_resumed", layer=digest, machine=machine.name)
        return machine

    # -- what this host gives it -------------------------------------------------------------

    def _gateway_for(self) -> tuple[str, int] | None:
        """The gateway endpoint for a rollout that uses it; None for every other rollout."""
        a = self.a
        if not a.manifest.requirements.inference:
            return None
        if self.agent.config.gateway is None:
            raise Unavailable(
                f"rollout {a.rollout_id} calls the inference gateway and host "
                f"{self.agent.caps.host_id} has none configured (fleet agent --gateway HOST:PORT)"
            )
        if not a.inference_token:
            raise Unavailable(f"rollout {a.rollout_id} uses the gateway but came without a token")
        return self.agent.config.gateway

    @property
    def inputs_dir(self) -> Path:
        return self.agent.config.machines_dir.parent / "inputs" / self.a.work_id

    async def _stage_inputs(self) -> tuple[tuple[str, str], ...]:
        """Inputs fetched to this host to be mounted read-only, where the runtime can mount
        (the namespace runtime); elsewhere they are copied in after the machine starts."""
        if not self.a.manifest.inputs or not self.agent.runtime.mounts_read_only:
            return ()
        return await stage_inputs(self.agent.stub, self.a, self.inputs_dir)


def parent_key(
    tenant: str, image_digest: str, smolfile_digest: str, warmup: str, reach: str = ""
) -> str:
    """Which warm parent a rollout's children come from: one per tenant, image, Smolfile,
    warm-up and what its machine reaches (`reach`: "gateway" or ""; each part length-prefixed,
    so no two different tuples share a key)."""
    parts = (tenant, image_digest, smolfile_digest, warmup, reach)
    body = "".join(f"{len(part.encode())}:{part}" for part in parts)
    return hashlib.sha256(body.encode()).hexdigest()[:16]


def warm_plan(
    spec: Smolfile, steps: list[tuple[int, Step]], forks_children: bool, runtime_name: str
) -> tuple[list[tuple[int, Step]], str | None, str]:
    """(the steps to run, the warm-up code when they run as a warm parent's children, and why
    they do not where the rollout asked to).

    A rollout asks with `[branch] enabled = true` and a first step named `warm-up` that is
    `python3 -c CODE`: CODE runs once per parent, and every later step finds what it loaded
    already in memory. Where that cannot be (a Smolfile that asks for egress: a child has no
    network beyond its loopback; a runtime that forks no children), each later step runs the
    warm-up first, in its own interpreter, and so starts from the state a fork would have had.
    """
    if not (spec.branch and spec.branch.enabled) or not steps or steps[0][1].name != "warm-up":
        return steps, None, ""
    argv = list(steps[0][1].argv)
    if len(argv) != 3 or argv[0] != "python3" or argv[1] != "-c":
        raise InvalidArgument("the warm-up step must be python3 -c CODE")
    warm = argv[2]
    if spec.egress_requested:
        why = "a warm parent's children have no network beyond their loopback"
    elif not forks_children:
        why = f"this host's {runtime_name} runtime forks no warm children"
    else:
        return steps, warm, ""
    return [(i, with_warm_up(step, warm)) for i, step in steps[1:]], None, why


def warm_session(spec: Smolfile, forks_children: bool, runtime_name: str) -> tuple[str | None, str]:
    """(the warm-up, "" for a session whose machine is a warm parent's child, or None; and why
    not, where its Smolfile asked with `[branch] enabled = true`). A session's parent runs the
    Smolfile's `init` once; each session is then a copy-on-write child of it."""
    if not (spec.branch and spec.branch.enabled):
        return None, ""
    if spec.egress_requested:
        return None, "a warm parent's children have no network beyond their loopback"
    if not forks_children:
        return None, f"this host's {runtime_name} runtime forks no warm children"
    return "", ""


def with_warm_up(step: Step, warm_up: str) -> Step:
    """A `python3 -c` step that runs the warm-up code first, in its own interpreter: in a cold
    machine it then starts from the state a warm parent's fork would have started from."""
    argv = list(step.argv)
    if len(argv) >= 3 and argv[0] == "python3" and argv[1] == "-c":
        return step.model_copy(update={"argv": ("python3", "-c", f"{warm_up}\n{argv[2]}",
                                                *argv[3:])})  # fmt: skip
    return step
