"""The DNS forwarder each machine with egress uses as its only resolver.

It listens on 127.0.0.53 inside the machine's network namespace and asks the configured
upstream resolver from the uplink's. A name outside `allow_hosts` gets NXDOMAIN without being
asked upstream; an allowed name's IPv4 answers are admitted into the machine's firewall for
their TTL before the answer is returned, so the connection that follows is allowed. An answer
that lands in the floor (metadata, link-local, loopback, the host, or an unlisted private
range: DNS rebinding) is refused. Every refusal is an egress event. AAAA questions get an empty
answer: machine links are IPv4 only. UDP only; answers are small.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import Awaitable, Callable, Mapping

import dns.exception
import dns.flags
import dns.message
import dns.rcode
import dns.rdatatype
import dns.rrset
import structlog

from fleet.core.egress import EgressEvent, EgressRules
from fleet.runtime.netns import DNS_ADDRESS, in_netns

log = structlog.get_logger(__name__)

UPSTREAM_TIMEOUT_S = 3.0
MAX_QUERY_BYTES = 4096


def _udp_socket(bind: tuple[str, int] | None) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.setblocking(False)
    if bind is not None:
        sock.bind(bind)
    return sock


class _Listener(asyncio.DatagramProtocol):
    def __init__(self, owner: DnsForwarder) -> None:
        self.owner = owner

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        self.owner.spawn(data, addr)


LOCAL_TTL_S = 60
"""How long a machine may cache a name answered here."""


class DnsForwarder:
    """One machine's resolver: answers allowed names, admits their addresses, logs refusals."""

    def __init__(
        self,
        machine: str,
        rules: EgressRules,
        machine_netns: str,
        uplink_path: str | None,
        upstream: tuple[str, int],
        admit: Callable[[list[tuple[str, int]]], Awaitable[None]],
        record: Callable[[EgressEvent], None],
        local: Mapping[str, str] | None = None,
    ) -> None:
        """`local`: names answered here with an IPv4 address, never asked upstream nor judged
        by the egress rules (the gateway's name: its address is reachable by the machine's own
        firewall rule)."""
        self.machine = machine
        self.local = {name.lower(): address for name, address in (local or {}).items()}
        self.rules = rules
        self.machine_netns = machine_netns
        self.uplink_path = uplink_path
        self.upstream = upstream
        self._admit = admit
        self._record = record
        self._transport: asyncio.DatagramTransport | None = None
        self._upstream_sock: socket.socket | None = None
        self._lock = asyncio.Lock()
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        listen = await asyncio.to_thread(
            in_netns, f"/run/netns/{self.machine_netns}", lambda: _udp_socket((DNS_ADDRESS, 53))
        )
        self._upstream_sock = await asyncio.to_thread(
            in_netns, self.uplink_path, lambda: _udp_socket(None)
        )
        loop = asyncio.get_running_loop()
        transport, _ = await loop.create_datagram_endpoint(lambda: _Listener(self), sock=listen)
        self._transport = transport

    def spawn(self, data: bytes, addr: tuple[str, int]) -> None:
        task = asyncio.get_running_loop().create_task(self._answer(data, addr))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _refuse(self, destination: str, reason: str) -> None:
        self._record(
            EgressEvent(
                at=time.time(), machine=self.machine, kind="dns", destination=destination,
                reason=reason,
            )
        )  # fmt: skip
        log.info("egress_refused", machine=self.machine, kind="dns", destination=destination,
                 reason=reason)  # fmt: skip

    async def _answer(self, data: bytes, addr: tuple[str, int]) -> None:
        try:
            query = dns.message.from_wire(data[:MAX_QUERY_BYTES])
        except dns.exception.DNSException:
            return  # not DNS: nothing to answer
        reply = dns.message.make_response(query)
        if not query.question:
            reply.set_rcode(dns.rcode.FORMERR)
            self._send(reply, addr)
            return
        question = query.question[0]
        name = question.name.to_text(omit_final_dot=True)
        if name.lower() in self.local:
            if question.rdtype == dns.rdatatype.A:
                reply.answer.append(dns.rrset.from_text(
                    question.name, LOCAL_TTL_S, "IN", "A", self.local[name.lower()]))  # fmt: skip
            self._send(reply, addr)
            return
        refusal = self.rules.name_refusal(name)
        if refusal is not None:
            self._refuse(name, refusal)
            reply.set_rcode(dns.rcode.NXDOMAIN)
            self._send(reply, addr)
            return
        if question.rdtype == dns.rdatatype.AAAA:
            self._send(reply, addr)  # no IPv6 route: an empty answer makes clients use A
            return
        answer = await self._ask_upstream(query)
        if answer is None:
            reply.set_rcode(dns.rcode.SERVFAIL)
            self._send(reply, addr)
            return
        admitted: list[tuple[str, int]] = []
        for rrset in answer.answer:
            if rrset.rdtype != dns.rdatatype.A:
                continue
            for rr in rrset:
                address = rr.address
                why = self.rules.answer_refusal(name, address)
                if why is not None:
                    self._refuse(f"{name} -> {address}", why)
                    reply.set_rcode(dns.rcode.REFUSED)
                    self._send(reply, addr)
                    return
                admitted.append((address, int(rrset.ttl)))
        try:
            await self._admit(admitted)
        except Exception as exc:
            log.error("egress_admit_failed", machine=self.machine, name=name, error=str(exc))
            reply.set_rcode(dns.rcode.SERVFAIL)
            self._send(reply, addr)
            return
        answer.id = query.id
        self._send(answer, addr)

    async def _ask_upstream(self, query: dns.message.Message) -> dns.message.Message | None:
        assert self._upstream_sock is not None
        loop = asyncio.get_running_loop()
        ask = dns.message.make_query(query.question[0].name, query.question[0].rdtype)
        ask.flags |= dns.flags.RD
        async with self._lock:  # one outstanding question per machine: ids cannot collide
            try:
                await loop.sock_sendto(self._upstream_sock, ask.to_wire(), self.upstream)
                deadline = loop.time() + UPSTREAM_TIMEOUT_S
                while True:
                    left = deadline - loop.time()
                    if left <= 0:
                        raise TimeoutError
                    data, _ = await asyncio.wait_for(
                        loop.sock_recvfrom(self._upstream_sock, 65535), left
                    )
                    with contextlib.suppress(dns.exception.DNSException):
                        answer = dns.message.from_wire(data)
                        if answer.id == ask.id:
                            return answer
            except (OSError, TimeoutError) as exc:
                where = f"{self.upstream[0]}:{self.upstream[1]}"
                log.warning(
                    "dns_upstream_failed", machine=self.machine, upstream=where, error=repr(exc)
                )
                return None

    def _send(self, message: dns.message.Message, addr: tuple[str, int]) -> None:
        if self._transport is not None and not self._transport.is_closing():
            self._transport.sendto(message.to_wire(), addr)

    async def stop(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        if self._transport is not None:
            self._transport.close()
        if self._upstream_sock is not None:
            self._upstream_sock.close()
