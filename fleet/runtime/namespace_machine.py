"""A namespace machine: its commands in bubblewrap sandboxes on its overlay, its files, its
cgroup's figures, its egress record, its deletion (`fleet.runtime.namespace` makes them)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Protocol

import structlog

from fleet.core.egress import EgressEvent
from fleet.core.errors import (
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    Unavailable,
)
from fleet.core.hostnames import GATEWAY_NAME
from fleet.core.rollout import MAX_OUTPUT_BYTES
from fleet.runtime import capabilities, disk, layers, users
from fleet.runtime.base import (
    Channel,
    ExecResult,
    MachineSpec,
    Usage,
    machine_env,
    to_the_end,
)
from fleet.runtime.cgroups import MachineCgroup
from fleet.runtime.dnsfwd import DnsForwarder
from fleet.runtime.netns import (
    MachineNet,
)
from fleet.runtime.output import OutputSink, read_bounded
from fleet.runtime.resident import Resident, TooLarge
from fleet.runtime.users import StepUser
from fleet.runtime.view import CAPABILITIES, proc_cover, sys_cover

log = structlog.get_logger(__name__)

# Mounts the overlay in a private mount namespace, then becomes bwrap: nothing to unmount later,
# and no mount survives the command even if the agent is killed. The overlay's directories are
# given relative to the machine's directory (its `lower` link is the image), so that the
# machine's /proc/self/mountinfo names no host path (and `cd` is in a subshell, so that no
# OLDPWD names one either); the umask is that of an ordinary box.
_MOUNT_THEN_EXEC = (
    'umask 022; IFS=:; for f in $3; do echo $$ > "$f" || exit 125; done; unset IFS; '
    '(cd "$1" && exec mount -t overlay overlay '
    '-o "lowerdir=lower,upperdir=$2/upper,workdir=$2/work" merged) || exit 125; '
    'shift 3; exec "$@"'
)
REQUIRED_TOOLS = ("bwrap", "unshare", "mount", "nsenter", "ip", "nft")
LAUNCH_ENV = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"}
"""The whole environment a machine's launch chain (nsenter, unshare, sh, bwrap) starts with:
bwrap is the machine's pid 1, and its /proc/1/environ is readable inside, so nothing of the
agent's (keys, tokens, registry credentials) may be in it. The step's own environment is set
with bwrap's --clearenv and --setenv; bwrap's own arguments (host paths among them) reach it
through a descriptor (--args), so /proc/1/cmdline names none."""
"""A machine's writable layer where its Smolfile sets neither `overlay` nor `storage`."""


def missing_tools() -> list[str]:
    return [tool for tool in REQUIRED_TOOLS if shutil.which(tool) is None]


async def _feed_then_wait(proc: asyncio.subprocess.Process, data: bytes | None) -> int:
    if data is not None and proc.stdin is not None:
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            proc.stdin.write(data)
            await proc.stdin.drain()
        proc.stdin.close()
    return await proc.wait()


MAX_FILE_BYTES = 64 * 1024 * 1024
DNS_EVENTS = "dns-events.jsonl"
PROC_ALSO_MASKED = ("config.gz",)
"""Under a machine's /proc, /dev/null in their place besides `view.PROC_MASKED`: the kernel's
build configuration, which names every driver and option an attacker would look for."""
KEPT = capabilities.mask()
"""The capabilities a machine's root keeps, as a mask (its bounding set is cut to them)."""
DISK_FULL_BYTES = 4 << 20
"""A bounded disk with less than this left is full, as a failed step's cause."""


class MachineMaker(Protocol):
    """What a machine needs of the runtime that made it (`fleet.runtime.namespace`'s): the
    helpers' directory, for its command server, and a way to make a machine, for its forks.
    Naming only this keeps this module below the runtime, which imports it."""

    @property
    def tools(self) -> Path: ...

    async def create(self, spec: MachineSpec, copy_of: Path | None = None) -> NamespaceMachine: ...


class NamespaceMachine:
    """One machine: an overlay layer and the commands run on it."""

    def __init__(
        self,
        spec: MachineSpec,
        root: Path,
        cgroup: MachineCgroup,
        net: MachineNet | None = None,
        dns: DnsForwarder | None = None,
        layer: Path | None = None,
        userns: int | None = None,
        user: StepUser = users.ROOT,
        helper: Path | None = None,
        disk_gib: int | None = None,
        bounder: Path | None = None,
    ) -> None:
        self.spec = spec
        self.root = root
        self.layer = layer or root
        """Where its writable layer lives: `root`, or its bounded disk (`fleet.runtime.disk`)."""
        self.cgroup = cgroup
        self.net = net
        self.dns = dns
        self.gateway: tuple[str, int] | None = None
        """The inference gateway as this machine reaches it (rollouts that use it only)."""
        self.userns = userns
        """The machine's user namespace (a descriptor), in which its ids are the host's."""
        self.user = user
        """Whom `exec` runs commands as (the Smolfile's `user`)."""
        self.disk_gib = disk_gib
        self._helper = helper
        self._bounder = bounder
        """The program that cuts each command's bounding set (`fleet.runtime.capabilities`)."""
        self._dns_read = 0  # how far DNS_EVENTS was reported
        self._name = spec.name
        self._deleted = False
        self._running: set[asyncio.subprocess.Process] = set()
        self.runtime: MachineMaker | None = None
        self.resident: Resident | None = None
        """Its resident command server, once `stay_resident` started it (sessions)."""

    @property
    def name(self) -> str:
        return self._name

    def channel(self) -> Channel | None:
        """The agent's relay listens in the machine's own network namespace (None: a machine
        on the host's loopback has none)."""
        return Channel("netns", Path(self.net.path)) if self.net is not None else None

    async def stay_resident(self) -> None:
        """Keeps a command server running in the machine: later commands each cost a fork and
        an exec in it instead of a sandbox set up again (see `fleet.runtime.resident`)."""
        if self._deleted or self.runtime is None:
            raise Unavailable(f"machine {self._name} was deleted")
        if self.resident is None or not self.resident.alive:
            if self.resident is not None:
                log.warning("resident_restarting", machine=self._name, why=self.resident.gone)
                await self.resident.close()
            self.resident = await Resident.start(self, self.runtime.tools)

    async def fork(self, spec: MachineSpec) -> NamespaceMachine:
        """A new machine made from `spec` whose layer starts as a copy of this one's (its files
        as they are now; no process carries over)."""
        if self._deleted or self.runtime is None:
            raise Unavailable(f"machine {self._name} was deleted")
        return await self.runtime.create(spec, copy_of=self.layer / "upper")

    async def pack_layer(self, archive: Path, scratch: Path) -> int:
        """Archives this machine's writable layer into `archive` (a parked session's disk;
        see `fleet.runtime.layers`); returns the archive's size. A machine made later with
        `create(spec, copy_of=...)` from the layer `layers.unpack` made of it has its files;
        no process carries over."""
        if self._deleted or self.runtime is None:
            raise Unavailable(f"machine {self._name} was deleted")
        return await asyncio.to_thread(layers.pack, self.layer / "upper", archive, scratch)

    def _bwrap(
        self,
        env: Mapping[str, str],
        workdir: str,
        seccomp_fd: int,
        extra: list[str] | None = None,
    ) -> list[str]:
        """bwrap's options for a command run on this machine (they reach it through --args; the
        command follows them on its command line)."""
        namespaces = ["--unshare-ipc", "--unshare-pid", "--unshare-uts", "--unshare-cgroup-try"]
        if self.net is None:  # loopback only; else its own namespace, entered by nsenter
            namespaces.append("--unshare-net")
        caps = [arg for cap in CAPABILITIES for arg in ("--cap-add", cap)]
        inputs = self.layer / "inputs"
        bwrap = [
            *namespaces,
            "--die-with-parent",
            "--new-session",
            "--hostname", self._name[:63],
            "--cap-drop", "ALL", *caps,
            "--bind", str(self.root / "merged"), "/",
            "--proc", "/proc",
            *proc_cover(),
            *[arg for name in PROC_ALSO_MASKED if os.path.exists(f"/proc/{name}")
              for arg in ("--dev-bind", "/dev/null", f"/proc/{name}")],
            "--dev", "/dev",
            "--perms", "1777", "--tmpfs", "/dev/shm",
            "--perms", "1777", "--tmpfs", "/tmp",
            *sys_cover(self.cgroup),
            *[arg for host, target in self.spec.writable for arg in ("--bind", host, target)],
            *[arg for host, target in self.spec.read_only for arg in ("--ro-bind", host, target)],
            *[arg for i, (_, target) in enumerate(self.spec.inputs)
              for arg in ("--ro-bind", str(inputs / str(i)), target)],
            *(extra or []),
            "--chdir", workdir,
            "--clearenv",
            "--seccomp", str(seccomp_fd),
        ]  # fmt: skip
        for key, value in env.items():
            bwrap += ["--setenv", key, value]
        return bwrap

    async def spawn(
        self,
        argv: list[str],
        env: Mapping[str, str],
        workdir: str,
        filter_path: Path,
        *,
        extra: list[str] | None = None,
        as_user: bool = False,
        stdin: int | None = asyncio.subprocess.DEVNULL,
        keep_fds: tuple[int, ...] = (),
    ) -> asyncio.subprocess.Process:
        """Starts `argv` on this machine (its own process group; stdout and stderr piped), with
        the caller's descriptors `keep_fds` open in it."""
        # bwrap reads the filter and its arguments from inherited descriptors: ours close once
        # it is spawned.
        fds: list[int] = []
        try:
            fds.append(os.open(filter_path, os.O_RDONLY))
            if as_user and not self.user.is_root:
                if self._helper is None:
                    raise Unavailable(f"machine {self._name} has no user-switching helper")
                fds.append(os.open(self._helper, os.O_RDONLY))
                argv = [*self.user.argv(fds[-1]), *argv]
            if self._bounder is None:
                raise Unavailable(f"machine {self._name} has no capability-bounding helper")
            fds.append(os.open(self._bounder, os.O_RDONLY))
            argv = [*capabilities.bounder_argv(fds[-1], KEPT), *argv]  # first, still as root
            args = os.memfd_create("bwrap-args", 0)
            fds.append(args)
            words = self._bwrap(env, workdir, fds[0], extra)
            if any("\0" in word for word in [*words, *argv]):  # each would split into bwrap options
                raise InvalidArgument(
                    f"machine {self._name}: a command, environment value or directory holds a "
                    "NUL byte"
                )
            data = "\0".join(words) + "\0"
            os.write(args, data.encode())
            os.lseek(args, 0, os.SEEK_SET)
            if self.userns is None:
                raise Unavailable(f"machine {self._name} has no user namespace")
            enter = ["nsenter", f"--net={self.net.path}", "--"] if self.net is not None else []
            layer = str(self.layer.relative_to(self.root))
            full = [
                *enter,
                "unshare", "--mount", "--propagation", "private", "--",
                "/bin/sh", "-c", _MOUNT_THEN_EXEC, "fleet-mount",
                str(self.root), layer, ":".join(str(f) for f in self.cgroup.procs_files),
                # bwrap runs as root in the machine's user namespace, entered through this
                # process's descriptor (passed down, it would stay open in every command).
                "nsenter", f"--user=/proc/{os.getpid()}/fd/{self.userns}", "--",
                "bwrap", "--args", str(args), "--", *argv,
            ]  # fmt: skip
            return await asyncio.create_subprocess_exec(
                *full,
                stdin=stdin,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                start_new_session=True,
                pass_fds=(*fds, *keep_fds),
                env=LAUNCH_ENV,
                cwd="/",  # the shell in the chain exports PWD: no host path in it
            )
        finally:
            for fd in fds:
                os.close(fd)

    async def exec(
        self,
        argv: list[str],
        *,
        env: Mapping[str, str] | None = None,
        workdir: str | None = None,
        timeout_s: float,
        max_output_bytes: int = MAX_OUTPUT_BYTES,
        on_output: OutputSink | None = None,
        stdin: bytes | None = None,
    ) -> ExecResult:
        return await self._run(
            argv, env=env, workdir=workdir, timeout_s=timeout_s,
            max_output_bytes=max_output_bytes, on_output=on_output, stdin=stdin, as_user=True,
        )  # fmt: skip

    async def _run(
        self,
        argv: list[str],
        *,
        env: Mapping[str, str] | None = None,
        workdir: str | None = None,
        timeout_s: float,
        max_output_bytes: int = MAX_OUTPUT_BYTES,
        on_output: OutputSink | None = None,
        stdin: bytes | None = None,
        as_user: bool = False,
    ) -> ExecResult:
        if self._deleted:
            raise Unavailable(f"machine {self._name} was deleted")
        cwd = workdir or self.spec.smolfile.workdir or "/"
        started = time.monotonic()
        oom_before = self.cgroup.oom_kills()
        pids_before = self.cgroup.pids_limit_hits()
        environment = machine_env(self.spec, env)
        if as_user and "HOME" not in (env or {}) and "HOME" not in self.spec.smolfile.env_map:
            environment["HOME"] = self.user.home  # the user's, as a login would set it
        if self.gateway is not None:
            scheme = "https://" if self.spec.gateway_tls else ""
            environment["FLEET_GATEWAY"] = f"{scheme}{self.gateway[0]}:{self.gateway[1]}"
            if "FLEET_INFERENCE_TOKEN" in environment:  # (read by the official `openai` client)
                # Over TLS by the name the gateway's certificate carries (the machine's
                # resolver answers it), so that a client verifies it as any client does.
                host = GATEWAY_NAME if scheme else self.gateway[0]
                environment["OPENAI_BASE_URL"] = f"{scheme or 'http://'}{host}:{self.gateway[1]}/v1"
                environment["OPENAI_API_KEY"] = environment["FLEET_INFERENCE_TOKEN"]
        if self.resident is not None and as_user:
            if not self.resident.alive:  # (a command killed it: `kill -9 -1` as root)
                await self.stay_resident()
            try:
                code, out_c, err_c, timed_out = await self.resident.run(
                    argv, environment, cwd, self.user, stdin=stdin, timeout_s=timeout_s,
                    max_output_bytes=max_output_bytes, on_output=on_output,
                )  # fmt: skip
            except TooLarge:
                pass  # (through bwrap, below)
            else:
                return await self._result(
                    code, (bytes(out_c.kept), out_c.truncated),
                    (bytes(err_c.kept), err_c.truncated), timed_out, started, oom_before,
                    pids_before,
                )  # fmt: skip
        proc = await self.spawn(
            argv, environment, cwd, self.root / "seccomp.bpf", as_user=as_user,
            stdin=asyncio.subprocess.DEVNULL if stdin is None else asyncio.subprocess.PIPE,
        )  # fmt: skip
        self._running.add(proc)
        timed_out = False
        try:
            readers = asyncio.gather(
                read_bounded(proc.stdout, max_output_bytes, "stdout", on_output),
                read_bounded(proc.stderr, max_output_bytes, "stderr", on_output),
                _feed_then_wait(proc, stdin),
            )
            try:
                (out, out_cut), (err, err_cut), code = await asyncio.wait_for(
                    asyncio.shield(readers), timeout_s
                )
            except TimeoutError:
                timed_out = True
                self._kill(proc)
                await asyncio.to_thread(self.cgroup.kill_all)
                (out, out_cut), (err, err_cut), code = await readers
        finally:
            self._kill(proc)
            self._running.discard(proc)
        if code == 125 and not timed_out and (b"mount" in err or b"cgroup" in err):
            raise Unavailable(
                f"machine {self._name}: cannot set up its disk or cgroup: {err.decode()[-500:]}"
            )
        return await self._result(
            -int(signal.SIGKILL) if timed_out else code, (out, out_cut), (err, err_cut),
            timed_out, started, oom_before, pids_before,
        )  # fmt: skip

    async def _result(
        self, code: int, out: tuple[bytes, bool], err: tuple[bytes, bool], timed_out: bool,
        started: float, oom_before: int, pids_before: int,
    ) -> ExecResult:  # fmt: skip
        return ExecResult(
            oom_killed=self.cgroup.oom_kills() > oom_before,
            pids_exhausted=self.cgroup.pids_limit_hits() > pids_before,
            disk_full=code != 0 and await asyncio.to_thread(self._disk_full),
            exit_code=code,
            stdout=out[0],
            stderr=err[0],
            stdout_truncated=out[1],
            stderr_truncated=err[1],
            timed_out=timed_out,
            duration_s=time.monotonic() - started,
        )

    def _disk_full(self) -> bool:
        """Whether the machine's bounded disk has (next to) nothing left."""
        if self.disk_gib is None:
            return False
        try:
            fs = os.statvfs(self.layer)
        except OSError:
            return False
        return fs.f_bavail * fs.f_frsize < DISK_FULL_BYTES

    async def read_file(self, path: str) -> bytes:
        result = await self._run(["cat", "--", path], timeout_s=60, max_output_bytes=MAX_FILE_BYTES)
        if result.exit_code != 0:
            raise NotFound(f"{self._name}:{path}: {result.stderr.decode(errors='replace').strip()}")
        if result.stdout_truncated:
            raise ResourceExhausted(f"{self._name}:{path} is over {MAX_FILE_BYTES} bytes")
        return result.stdout

    async def write_file(self, path: str, data: bytes, mode: int = 0o644) -> None:
        script = 'cat > "$1" && chmod "$2" "$1"'
        result = await self._run(
            ["/bin/sh", "-c", script, "write", path, f"{mode:o}"], timeout_s=60, stdin=data
        )
        if result.exit_code != 0:
            why = result.stderr.decode(errors="replace").strip()
            raise InvalidArgument(f"{self._name}:{path}: cannot write: {why}")

    @staticmethod
    def _kill(proc: asyncio.subprocess.Process) -> None:
        # The whole process group: unshare, then bwrap in its place. bwrap's pid 1 dies with it
        # (--die-with-parent), and the kernel kills everything left in that pid namespace.
        if proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)

    async def usage(self) -> Usage:
        return await asyncio.to_thread(self.cgroup.usage)

    def record(self, event: EgressEvent) -> None:
        """A refusal of the DNS forwarder: kept in the machine's directory, so that one made
        before an agent crash is still reported by the agent that adopts the machine."""
        with open(self.root / DNS_EVENTS, "a") as f:
            f.write(event.model_dump_json() + "\n")

    async def egress_events(self) -> list[EgressEvent]:
        events = await asyncio.to_thread(self._recorded)
        if self.net is not None and not self._deleted:
            events += await self.net.refused()
        return sorted(events, key=lambda e: e.at)

    def _recorded(self) -> list[EgressEvent]:
        """DNS refusals recorded since the last call."""
        try:
            with open(self.root / DNS_EVENTS) as f:
                f.seek(self._dns_read)
                lines = f.readlines()
                self._dns_read = f.tell()
        except FileNotFoundError:
            return []
        return [EgressEvent.model_validate_json(line) for line in lines if line.endswith("\n")]

    async def delete(self) -> None:
        if self._deleted:
            return
        self._deleted = True
        # To its end even when cancelled: a delete stopped half way (and marked done) would
        # leave the machine's disk mounted and its cgroup and namespace behind for good.
        await to_the_end(self._teardown())

    async def _teardown(self) -> None:
        if self.resident is not None:
            await self.resident.close()
        for proc in list(self._running):
            self._kill(proc)
            with contextlib.suppress(ProcessLookupError):
                await proc.wait()
        if self.dns is not None:
            await self.dns.stop()
        if self.net is not None:
            await self.net.destroy()
        if self.userns is not None:
            os.close(self.userns)
            self.userns = None
        await asyncio.to_thread(self.cgroup.remove)
        await asyncio.to_thread(disk.remove, self.root)
        await asyncio.to_thread(shutil.rmtree, self.root, True)
        log.info("machine_deleted", machine=self._name, runtime="namespace")
