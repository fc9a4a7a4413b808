"""One attempt of a leased work item on this host: its machine from the image to deletion, its
steps, and the report it ends in. A session's attempt holds its machine for the caller's
calls instead (`fleet.agent.sessions`); one that parks reports its stored writable layer, and
a resumed session's machine starts from that layer (`_from_layer`)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import structlog

from fleet.agent.checkpoints import RELAY_ADDRESS, CheckpointRelay
from fleet.agent.config import AttemptHost
from fleet.agent.files import (
    InputPlacementFailed,
    StepLog,
    collect_outputs,
    place_inputs,
    remove_staged,
)
from fleet.agent.journal import AttemptJournal
from fleet.agent.machine_making import (
    MachineMaking,
    Steps,
    parent_key,
    warm_plan,
    warm_session,
    with_warm_up,
)
from fleet.agent.passage import CHECKPOINTS_SOCKET, GATEWAY_SOCKET, GatewaySplice, child_address
from fleet.agent.running import Finished, Running
from fleet.api.convert import MAX_EGRESS_EVENTS
from fleet.api.pb import host_pb2
from fleet.core.egress import EffectiveEgress
from fleet.core.errors import ErrorCode, FleetError
from fleet.core.lifecycle import Outcome
from fleet.core.manifest import Step
from fleet.core.placement import HostClass, Isolation
from fleet.core.rollout import Completion, StepResult
from fleet.core.smolfile import Smolfile
from fleet.identity.tls import client_ssl_context
from fleet.runtime import disk
from fleet.runtime.base import ExecResult, Machine, MachineSpec, Parkable
from fleet.runtime.cgroups import DEFAULT_PIDS_MAX

# The machine's making (`fleet.agent.machine_making`) and the state both halves share
# (`fleet.agent.running`) have modules of their own; what callers import from here stays here.
__all__ = [
    "INIT_TIMEOUT_S",
    "Attempt",
    "Finished",
    "Running",
    "Steps",
    "failure_class",
    "parent_key",
    "step_failure",
    "warm_plan",
    "warm_session",
    "with_warm_up",
]

INIT_TIMEOUT_S = 300.0


class Attempt(MachineMaking):
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
    # (`_prepare`, `_plan` and `_machine` come first: they are `MachineMaking`'s.)

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
        if needs.isolation in (Isolation.VM, Isolation.NAMESPACE) and isolation != needs.isolation:
            return (f"the rollout requires {needs.isolation.value} isolation and this host's "
                    f"runtime gives {isolation.value}")  # fmt: skip
        if needs.cuda_device and self.agent.caps.cuda_devices < 1:
            return "the rollout requires a CUDA device and this host has none"
        if needs.inference and self.agent.config.gateway is None:
            return "the rollout calls the inference gateway and this host knows of none"
        return ""

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
