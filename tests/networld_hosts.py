"""Test hosts for the egress tests, run inside the test "internet" namespace (see networld.py).

Serves a test DNS zone on 203.0.113.53:53 and a TCP service on port 8080 of every address the
namespace holds; each connection is answered with "hello from <address>". Prints "ready" once
both listen. Nothing here leaves the namespaces the test created.
"""

from __future__ import annotations

import socket
import sys
import threading

import dns.message
import dns.rcode
import dns.rrset

ZONE = {
    "svc.fleet.test.": "203.0.113.10",
    "api.svc.fleet.test.": "198.51.100.20",
    "rebind.svc.fleet.test.": "10.9.9.9",
    "meta.svc.fleet.test.": "169.254.169.254",
    "other.test.": "198.51.100.99",
}


def dns_server(sock: socket.socket) -> None:
    while True:
        data, addr = sock.recvfrom(4096)
        try:
            query = dns.message.from_wire(data)
        except Exception:
            continue
        reply = dns.message.make_response(query)
        question = query.question[0]
        name = question.name.to_text().lower()
        if name not in ZONE:
            reply.set_rcode(dns.rcode.NXDOMAIN)
        elif question.rdtype == 1:  # A
            reply.answer.append(dns.rrset.from_text(name, 30, "IN", "A", ZONE[name]))
        sock.sendto(reply.to_wire(), addr)


def tcp_server(sock: socket.socket) -> None:
    while True:
        conn, _ = sock.accept()
        with conn:
            conn.sendall(f"hello from {conn.getsockname()[0]}\n".encode())


def main() -> None:
    port = int(sys.argv[1]) if len(sys.argv) > 1 else 8080
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    udp.bind(("203.0.113.53", 53))
    tcp = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    tcp.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    tcp.bind(("0.0.0.0", port))
    tcp.listen(64)
    threading.Thread(target=dns_server, args=(udp,), daemon=True).start()
    print("ready", flush=True)
    tcp_server(tcp)


if __name__ == "__main__":
    main()
