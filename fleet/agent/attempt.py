"""One attempt of a leased work item on this host: its machine from the image to deletion, its
steps, and the report it ends in. A session's attempt holds its machine for the caller's
calls instead (`fleet.agent.sessions`); one that parks reports its stored writable layer, and
a resumed session's machine starts from that layer (`_from_layer`)."""

from __future__ import annotations

import asyncio
import hashlib
import time
from dataclasses import dataclass, field
from pathlib import Path

import structlog

from fleet.agent import parking
from fleet.agent.checkpoints import RELAY_ADDRESS, CheckpointRelay
from fleet.agent.config import AttemptHost
from fleet.agent.files import (
    InputPlacementFailed,
    StepLog,
    collect_outputs,
    place_inputs,
    remove_staged,
    stage_inputs,
)
from fleet.agent.journal import AttemptJournal
from fleet.agent.passage import CHECKPOINTS_SOCKET, GATEWAY_SOCKET, GatewaySplice, child_address
from fleet.api.convert import MAX_EGRESS_EVENTS
from fleet.api.pb import host_pb2
from fleet.core.egress import EffectiveEgress, effective_egress
from fleet.core.errors import ErrorCode, FleetError, InvalidArgument, Unavailable
from fleet.core.lifecycle import Outcome
from fleet.core.manifest import OutputArtifact, Step, check_steps
from fleet.core.placement import HostClass, Isolation
from fleet.core.rollout import Assignment, Completion, StepResult
from fleet.core.smolfile import Smolfile
from fleet.identity.tls import client_ssl_context
from fleet.image import oci
from fleet.runtime import disk
from fleet.runtime.base import (
    ExecResult,
    Leftover,
    Machine,
    MachineSpec,
    Parkable,
    resolve_secrets,
)
from fleet.runtime.cgroups import DEFAULT_PIDS_MAX

INIT_TIMEOUT_S = 300.0

Steps = list[tuple[int, Step]]
"""Steps to run, with their index in the manifest."""


@dataclass
class Running:
    """A leased work item this agent runs, as the agent tracks it."""

    assignment: Assignment
    task: asyncio.Task[None] | None = None
    stop_reason: str = ""
    results: list[StepResult] = field(default_factory=list)
    machine: Machine | None = None
    relay: CheckpointRelay | None = None
    splice: GatewaySplice | None = None
    """A warm child's way to the gateway (other machines reach it over their own link)."""
    adopt: Leftover | None = None
    """The machine an earlier run of this agent left running this attempt (after a restart)."""
    image: str = ""
    """The image digest this attempt holds in the image cache ("": none yet)."""
    logs: list[OutputArtifact] = field(default_factory=list)
    """Steps' whole stdout/stderr where it passed the inline limit (stored already)."""
    journalled: bool = False
    """Whether the attempt may have a journal on disk (to remove once it is reported)."""


class Finished(Exception):
    """The attempt ended before its last step (a failed init, a step that failed, a session
    closed); carries its report."""

    def __init__(self, completion: Completion) -> None:
        super().__init__(completion.error)
        self.completion = completion


class Attempt:
    """Runs one attempt (see the module docstring); `execute` is all of it."""

    def __init__(self, agent: AttemptHost, running: Running, log: structlog.BoundLogger) -> None:
        self.agent = agent
        self.running = running
        self.a = running.assignment
        self.log = log
        self.runtime_name = agent.caps.runtime.value
        self.device = self._device()
        self.egress: EffectiveEgress | None = None
        self.moving = ""
        """The artifact being moved (an image, inputs): a failure then is an artifact's."""
        self.image_ready = False
        """The image is on disk: a FAILED_PRECONDITION then is the manifest's, not the host's."""

    def report(self, outcome: Outcome, error: str = "") -> Completion:
        return Completion(
            artifact_failed=bool(self.moving) and outcome != Outcome.CANCELLED,
            egress=self.egress,
            work_id=self.a.work_id,
            fencing_token=self.a.fencing_token,
            outcome=outcome,
            results=tuple(self.running.results),
            error=error,
            runtime=self.runtime_name,
            device=self.device,
        )

    def _ended(self, outcome: Outcome, error: str = "") -> Finished:
        return Finished(self.report(outcome, error))

    def _note(self, how: str) -> None:
        """Adds to what the report says enforced the machine's egress (for review)."""
        if self.egress is not None:
            self.egress = self.egress.model_copy(
                update={"enforced_by": f"{self.egress.enforced_by}; {how}"}
            )

    # -- from the lease to the report --------------------------------------------------------

    async def execute(self) -> Completion:
        """Runs the attempt, then collects what its machine made and was refused, and deletes
        it; what the attempt held on this host is given back."""
        try:
            return await self._finish(await self._run())
        finally:
            if self.running.image:
                self.agent.images.release(self.running.image)
            if self.a.manifest.inputs:
                await asyncio.to_thread(remove_staged, self.inputs_dir)

    async def _run(self) -> Completion:
        unmet = self._cannot_honour()
        if unmet:
            # A host that registered as more than it is (or a server that placed it wrongly)
            # must not run it: another host is tried.
            self.log.error("requirement_unmet", reason=unmet)
            return self.report(Outcome.TRANSIENT_ERROR, f"host {self.agent.caps.host_id}: {unmet}")
        try:
            smolfile, spec = await self._prepare()
            steps, warm = self._plan(smolfile)
            machine, steps, record = await self._machine(spec, steps, warm)
            env = await self._environment(machine, spec)
            await self._place_inputs(machine, spec)
            await self._init(machine, smolfile, env, record, warm)
            if self.a.manifest.session is not None:  # held for the caller's calls, not a plan
                park = (lambda: self._park(machine)) if isinstance(machine, Parkable) else None
                why, layer = await self.agent.sessions.hold(
                    self.a, machine, env, self.a.manifest.session, park
                )
                if layer is not None:  # (reported with the outputs stored already)
                    self.running.logs.append(layer)
                self.log.info("session_closed", reason=why)
                return self.report(Outcome.SUCCEEDED, why)
            await self._steps(machine, smolfile, steps, env, record)
            return self.report(Outcome.SUCCEEDED)
        except Finished as ended:
            return ended.completion
        except asyncio.CancelledError:
            return self.report(Outcome.CANCELLED, self.running.stop_reason or "agent stopped")
        except FleetError as exc:
            outcome = failure_class(exc, image_ready=self.image_ready)
            self.log.warning("attempt_error", code=exc.code, error=exc.message, outcome=outcome)
            return self.report(outcome, f"{exc.code}: {exc.message}")
        except Exception as exc:
            self.log.exception("attempt_crashed")
            return self.report(Outcome.TRANSIENT_ERROR, f"agent error: {exc!r}")

    # -- its parts, in order -----------------------------------------------------------------

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

    async def _environment(self, machine: Machine, spec: MachineSpec) -> dict[str, str]:
        """What every command in the machine finds in its environment; for a rollout that
        calls the gateway, its way there and the checkpoint relay are started."""
        a, running = self.a, self.running
        env = {"FLEET_ROLLOUT_ID": a.rollout_id, "FLEET_ATTEMPT": str(a.attempt),
               "FLEET_DEVICE": self.device}  # fmt: skip
        if spec.gateway is not None:
            env["FLEET_INFERENCE_TOKEN"] = a.inference_token
            channel = machine.channel()
            if channel is not None and channel.kind == "unix":  # no network of its own
                running.splice = await self._gateway_splice(channel.path, spec.gateway)
                env["FLEET_GATEWAY"] = child_address(GATEWAY_SOCKET)
            elif self.agent.config.gateway_ca:
                env["FLEET_GATEWAY_CA"] = self.agent.config.gateway_ca.decode()
            relay = await self._checkpoint_relay(machine)
            if relay is not None:
                running.relay, env["FLEET_CHECKPOINTS"] = relay
        return env

    async def _place_inputs(self, machine: Machine, spec: MachineSpec) -> None:
        """Inputs copied in, where they were not mounted (and not in a machine adopted with
        them)."""
        if not self.a.manifest.inputs or spec.inputs or self.running.adopt is not None:
            return
        try:
            self.moving = "inputs"
            await place_inputs(machine, self.agent.stub, self.a)
            self.moving = ""
        except InputPlacementFailed as exc:
            raise self._ended(Outcome.STEP_FAILED, str(exc)) from None

    async def _init(
        self, machine: Machine, smolfile: Smolfile, env: dict[str, str],
        record: AttemptJournal | None, warm: str | None,
    ) -> None:  # fmt: skip
        """The Smolfile's `init` commands, unless a parent, a source or an earlier run of this
        attempt ran them."""
        session = self.a.manifest.session
        # (Its source ran them; a parked layer's machine did.)
        forked = session is not None and bool(session.fork_of or session.layer)
        done = record is not None and record.init_done
        commands = [] if warm is not None or forked or done else smolfile.init
        for command in commands:
            init = await machine.exec(["/bin/sh", "-c", command], env=env, timeout_s=INIT_TIMEOUT_S)
            if init.exit_code != 0:
                raise self._ended(
                    Outcome.STEP_FAILED,
                    f"init command {command!r} exited {init.exit_code}: "
                    f"{init.stderr.decode(errors='replace')[-500:]}",
                )
        if commands and record is not None:  # journalled: something not to run again
            self.running.journalled = True
            await asyncio.to_thread(record.mark_init_done)

    async def _steps(
        self, machine: Machine, smolfile: Smolfile, steps: Steps, env: dict[str, str],
        record: AttemptJournal | None,
    ) -> None:  # fmt: skip
        """The plan's steps in order, each journalled (where the machine has a journal); the
        first that fails ends the attempt."""
        a, running = self.a, self.running
        for index, step in steps:
            left = a.manifest.deadline.timestamp() - time.time()
            if left <= 0:
                raise self._ended(Outcome.CANCELLED, "the rollout's deadline passed")
            timeout = min(step.timeout_s, left)
            with StepLog(self.agent.config.machines_dir.parent / "spool", index) as step_log:
                result = await machine.exec(
                    list(step.argv), env={**env, **step.env}, workdir=step.workdir,
                    timeout_s=timeout, on_output=step_log.sink,
                )  # fmt: skip
                # Output past the inline limit is kept whole, as an artifact.
                running.logs += await step_log.keep(self.agent.stub, a, result)
            step_result = StepResult(
                index=index, name=step.name, exit_code=result.exit_code,
                timed_out=result.timed_out, duration_s=result.duration_s,
                stdout=result.stdout, stderr=result.stderr,
                stdout_truncated=result.stdout_truncated,
                stderr_truncated=result.stderr_truncated,
            )  # fmt: skip
            running.results.append(step_result)
            if record is not None:
                running.journalled = True
                await asyncio.to_thread(record.record, step_result)
            seconds = round(result.duration_s, 3)
            self.log.info("step_finished", step=index, exit_code=result.exit_code,
                          timed_out=result.timed_out, seconds=seconds)  # fmt: skip
            failure = step_failure(index, step, result, timeout, smolfile)
            if failure:
                raise self._ended(Outcome.STEP_FAILED, failure)

    async def _finish(self, completion: Completion) -> Completion:
        """The report completed with what the machine made (outputs), used (CPU, memory) and
        was refused (egress); the machine is deleted."""
        a, running, log = self.a, self.running, self.log
        if running.logs:
            completion = completion.model_copy(update={"outputs": tuple(running.logs)})
        collect = completion.outcome in (Outcome.SUCCEEDED, Outcome.STEP_FAILED)
        if a.manifest.outputs and running.machine is not None and collect:
            spool = self.agent.config.machines_dir.parent / "spool"
            try:
                outputs = await collect_outputs(running.machine, self.agent.stub, a, spool)
                completion = completion.model_copy(update={"outputs": (*outputs, *running.logs)})
            except Exception:
                log.exception("outputs_not_collected")
                completion = completion.model_copy(update={
                    "outcome": Outcome.TRANSIENT_ERROR, "artifact_failed": True,
                    "error": "the agent could not collect the outputs; see its log",
                })  # fmt: skip
        if running.relay is not None:
            await running.relay.stop()
        if running.splice is not None:
            await running.splice.stop()
        machine = running.machine
        if machine is None:
            return completion
        try:
            cpu, peak = await asyncio.shield(machine.usage())
            if cpu is not None:
                completion = completion.model_copy(update={"cpu_seconds": round(cpu, 6)})
            if peak is not None:
                completion = completion.model_copy(update={"peak_memory_mib": round(peak, 3)})
        except Exception:
            log.exception("cpu_seconds_failed", machine=machine.name)
        try:
            events = await asyncio.shield(machine.egress_events())
            if events:
                for event in events:
                    log.info("egress_refused", kind=event.kind, destination=event.destination,
                             reason=event.reason)  # fmt: skip
                kept = tuple(events[:MAX_EGRESS_EVENTS])
                completion = completion.model_copy(update={"egress_events": kept})
        except Exception:
            log.exception("egress_events_failed", machine=machine.name)
        try:
            await asyncio.shield(machine.delete())
        except Exception:
            log.exception("machine_delete_failed", machine=machine.name)
        return completion

    # -- a session's layer ---------------------------------------------------------------------

    @property
    def spool(self) -> Path:
        return self.agent.config.machines_dir.parent / "spool"

    async def _park(self, machine: Parkable) -> OutputArtifact:
        return await parking.park_layer(machine, self.agent.stub, self.a, self.spool)

    async def _from_layer(self, spec: MachineSpec, digest: str) -> Machine:
        self.moving = "layer"  # (until it is on this host: a failure then is the artifact's)
        machine = await parking.machine_from_layer(
            self.agent.runtime, self.agent.stub, self.a, self.spool, spec, digest,
            moved=lambda: setattr(self, "moving", ""),
        )  # fmt: skip
        self.log.info("session_resumed", layer=digest, machine=machine.name)
        return machine

    # -- what this host gives it -------------------------------------------------------------

    def _device(self) -> str:
        caps = self.agent.caps
        if self.a.manifest.host_class == HostClass.GPU:
            return caps.device if caps.cuda_devices else "cpu (no CUDA device here)"
        return "cpu"

    def _cannot_honour(self) -> str:
        """Why this host's own runtime cannot give the rollout what it requires ("": it can)."""
        needs = self.a.manifest.requirements
        isolation = self.agent.runtime.isolation
        if needs.isolation == Isolation.VM and isolation != Isolation.VM:
            return (f"the rollout requires vm isolation and this host's runtime gives "
                    f"{isolation.value}")  # fmt: skip
        if needs.cuda_device and self.agent.caps.cuda_devices < 1:
            return "the rollout requires a CUDA device and this host has none"
        if needs.inference and self.agent.config.gateway is None:
            return "the rollout calls the inference gateway and this host knows of none"
        return ""

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

    async def _checkpoint_relay(self, machine: Machine) -> tuple[CheckpointRelay, str] | None:
        """Where the machine stores its state between model calls (where its runtime gives the
        agent a channel to it), and how a step there names it (`FLEET_CHECKPOINTS`)."""
        a = self.a
        channel = machine.channel()
        sender = self.agent.checkpoints
        if channel is None or sender is None:
            why = "the machine's runtime offers the agent no channel to it for the relay"
            self.log.warning("checkpoints_unavailable", reason=why)
            return None
        host_id = self.agent.caps.host_id

        async def put(seq: int, data: bytes) -> None:
            await sender.put(
                host_pb2.PutCheckpointRequest(
                    host_id=host_id, work_id=a.work_id, fencing_token=a.fencing_token,
                    sequence=seq, data=data,
                )
            )  # fmt: skip

        relay = CheckpointRelay(a.checkpoint_sequence, a.checkpoint, put)
        if channel.kind == "unix":
            await relay.start_unix(channel.path)
            return relay, child_address(CHECKPOINTS_SOCKET)
        await relay.start_in_netns(str(channel.path))
        return relay, "{}:{}".format(*RELAY_ADDRESS)

    async def _gateway_splice(self, sockets: Path, gateway: tuple[str, int]) -> GatewaySplice:
        """The gateway for a warm child, on a socket the agent joins to the gateway's endpoint
        (`host`: this host, reached from the uplink's namespace as the machines' links are)."""
        config = self.agent.config
        where = ("127.0.0.1" if gateway[0] == "host" else gateway[0], gateway[1])
        tls = client_ssl_context(config.gateway_ca) if config.gateway_ca else None
        splice = GatewaySplice(sockets, where, config.net.uplink_path if config.net else None, tls)
        await splice.start()
        return splice


def step_failure(
    index: int, step: Step, result: ExecResult, timeout: float, smolfile: Smolfile
) -> str:
    """Why a step that ran failed the attempt ("": it did not)."""
    if result.pids_exhausted and (result.exit_code != 0 or result.oom_killed):
        return (f"step {index} ({step.name}) hit the machine's process limit "
                f"({DEFAULT_PIDS_MAX} processes)"
                + (", then ran out of memory" if result.oom_killed else ""))  # fmt: skip
    if result.oom_killed:
        return (f"step {index} ({step.name}) was killed: out of memory "
                f"(the Smolfile's limit is {smolfile.memory_mib_effective} MiB)")  # fmt: skip
    if result.disk_full and result.exit_code != 0 and not result.timed_out:
        whose = "the Smolfile's" if disk.bound_gib(smolfile) is not None else "the host's default"
        return (f"step {index} ({step.name}) exited {result.exit_code} with the machine's disk "
                f"full ({whose} bound)")  # fmt: skip
    if result.timed_out:
        why = "deadline" if timeout < step.timeout_s else f"{step.timeout_s:g}s timeout"
        return f"step {index} ({step.name}) hit its {why}"
    if result.exit_code != 0:
        return f"step {index} ({step.name}) exited {result.exit_code}"
    return ""


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


def failure_class(exc: FleetError, *, image_ready: bool) -> Outcome:
    """How the agent classes an error before any step ran.

    Malformed input (the manifest's Smolfile, its secrets) is quarantined: no host can run it.
    A runtime that cannot express the manifest fails fast. Anything about this host (a corrupt
    local image copy, a runtime error) is transient: another attempt, maybe elsewhere, can work.
    """
    if exc.code == ErrorCode.INVALID_ARGUMENT:
        return Outcome.MALFORMED_INPUT
    if exc.code == ErrorCode.FAILED_PRECONDITION and image_ready:
        return Outcome.INCOMPATIBLE
    return Outcome.TRANSIENT_ERROR
