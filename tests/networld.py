"""A small test internet in network namespaces, for the egress tests.

    machine netns --veth--> uplink netns (router) --veth--> net netns (test hosts)

The net namespace holds the test hosts as addresses on its loopback: 203.0.113.10 and 198.51.100.20
(public test ranges), 198.51.100.99 (a host no allowlist names), 10.9.9.9 (a private address),
169.254.169.254 (a stand-in for cloud metadata) and the test resolver at 203.0.113.53. The
uplink namespace routes to them; fleet's machines hang off it. A "gateway" TCP service listens
on the uplink's own address 192.0.2.1:9090. All traffic stays in namespaces created here.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path

HOSTS = ("203.0.113.10", "198.51.100.20", "198.51.100.99", "10.9.9.9", "169.254.169.254",
         "203.0.113.53")  # fmt: skip
GATEWAY = ("192.0.2.1", 9090)
_GATEWAY_SERVER = r"""
import socket
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("192.0.2.1", 9090)); s.listen(16); print("ready", flush=True)
while True:
    c, _ = s.accept(); c.sendall(b"hello from the gateway\n"); c.close()
"""


@dataclass(frozen=True)
class NetWorld:
    uplink: str
    net: str
    dns: tuple[str, int] = ("203.0.113.53", 53)


def _sh(*argv: str) -> None:
    subprocess.run(argv, check=True, capture_output=True, timeout=30)


def _start(netns: str, argv: list[str]) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        ["ip", "netns", "exec", netns, *argv], stdout=subprocess.PIPE, text=True,
        start_new_session=True,
    )  # fmt: skip
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if line.strip() != "ready":
        proc.kill()
        proc.wait(timeout=10)
        proc.stdout.close()
        raise RuntimeError(f"test host in {netns} did not start: {line!r}")
    return proc


@contextmanager
def networld() -> Iterator[NetWorld]:
    tag = uuid.uuid4().hex[:6]
    up, net = f"ftu-{tag}", f"ftn-{tag}"
    procs: list[subprocess.Popen[str]] = []
    try:
        _sh("ip", "netns", "add", up)
        _sh("ip", "netns", "add", net)
        _sh("ip", "-n", up, "link", "add", "to-net", "type", "veth", "peer", "name", "to-up",
            "netns", net)  # fmt: skip
        for ns in (up, net):
            _sh("ip", "-n", ns, "link", "set", "lo", "up")
        _sh("ip", "-n", up, "addr", "add", "192.0.2.1/30", "dev", "to-net")
        _sh("ip", "-n", up, "link", "set", "to-net", "up")
        _sh("ip", "netns", "exec", up, "sysctl", "-qw", "net.ipv4.ip_forward=1")
        _sh("ip", "-n", net, "addr", "add", "192.0.2.2/30", "dev", "to-up")
        _sh("ip", "-n", net, "link", "set", "to-up", "up")
        for host in HOSTS:
            _sh("ip", "-n", net, "addr", "add", f"{host}/32", "dev", "lo")
            _sh("ip", "-n", up, "route", "add", f"{host}/32", "via", "192.0.2.2")
        _sh("ip", "-n", net, "route", "add", "default", "via", "192.0.2.1")
        here = Path(__file__).parent
        procs.append(_start(net, [sys.executable, str(here / "networld_hosts.py")]))
        procs.append(_start(up, [sys.executable, "-c", _GATEWAY_SERVER]))
        yield NetWorld(uplink=up, net=net)
    finally:
        for proc in procs:
            with suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
            if proc.stdout is not None:
                proc.stdout.close()
        for ns in (up, net):
            subprocess.run(["ip", "netns", "delete", ns], capture_output=True, timeout=30)
