"""Wake-ups across replicas: a replica that stored new work tells the others through
PostgreSQL's LISTEN/NOTIFY, so their hosts' waiting claims look again at once.

Without it a claim waiting at one replica learns of work submitted through another only by
asking the ledger again on a timer, and every idle host's claim asking twice a second was as
costly as its heartbeats. With it the timer is only a fallback (a lost notification, a retry
whose backoff ended), and can be long.

Two threads, each with a connection of its own outside the ledger's pool: one listens, and
fires the replica's wake-up for each notification another replica sent; one sends, coalescing
the requests that arrive while it sends into one NOTIFY. A notification's payload says how many
waiting claims to wake (the rollouts it stands for), by the class of host they need:
`cpu=3,gpu=1`; a bare count, whatever the class; empty: every one (as a payload it cannot
read, which a replica of an older version reads in a newer one's). A broken connection is made
again after a pause; meanwhile the fallback timer stands in.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Mapping
from typing import Any

import structlog
from sqlalchemy.engine import Engine

log = structlog.get_logger(__name__)

CHANNEL = "fleet_work"
LISTEN_POLL_S = 0.25
"""How often the listening thread looks up from its wait to see whether it should stop."""
RECONNECT_S = 2.0
"""The pause before a lost connection is made again."""


Counts = Mapping[str, int]
"""Claims to wake by host class ("": whatever the class)."""


def payload_of(counts: Counts | None) -> str:
    """A notification's payload for `counts` (None: every claim)."""
    if counts is None:
        return ""
    return ",".join(f"{name}={n}" if name else str(n) for name, n in counts.items() if n > 0)


def counts_of(payload: str) -> dict[str, int] | None:
    """The counts a payload asks to wake (None: every claim, also for a payload that is not
    `payload_of`'s)."""
    if not payload:
        return None
    counts: dict[str, int] = {}
    for item in payload.split(","):
        name, _, number = item.rpartition("=")
        if not number.isdigit() or not (name.isalnum() or not name):
            return None
        counts[name] = counts.get(name, 0) + int(number)
    return counts


def conninfo(engine: Engine) -> str:
    """The libpq address of a PostgreSQL ledger's engine (its password included)."""
    return engine.url.set(drivername="postgresql").render_as_string(hide_password=False)


class WorkSignal:
    """See the module's docstring. `on_signal(counts)` runs on `loop` for each notification
    from another replica (its own are not echoed back to it): wake as many claims of each
    host class (None: all)."""

    def __init__(
        self, address: str, loop: asyncio.AbstractEventLoop,
        on_signal: Callable[[dict[str, int] | None], None],
    ) -> None:  # fmt: skip
        self._address = address
        self._loop = loop
        self._on_signal = on_signal
        self._stop = threading.Event()
        self._wanted = threading.Event()
        self._lock = threading.Lock()
        self._counts: dict[str, int] | None = {}
        """Claims to wake by host class, of the sends not yet notified (None: every one)."""
        self._sender_pid = 0
        """The backend of the sending connection (its own notifications are not signals)."""
        self.listening = False
        """Whether notifications reach this replica now (False: connecting, or lost)."""
        self.received = 0
        self.sent = 0
        self._threads = [
            threading.Thread(target=self._listen, name="work-signal-listen", daemon=True),
            threading.Thread(target=self._send, name="work-signal-send", daemon=True),
        ]
        for thread in self._threads:
            thread.start()

    def send(self, wake: int | Counts | None = None) -> None:
        """Tells the other replicas that new work is queued, enough to wake `wake` of their
        waiting claims (by host class: a mapping; None: all); returns at once."""
        with self._lock:
            if wake is None or self._counts is None:
                self._counts = None
            else:
                for name, n in ({"": wake} if isinstance(wake, int) else wake).items():
                    self._counts[name] = self._counts.get(name, 0) + n
        self._wanted.set()

    def close(self) -> None:
        self._stop.set()
        self._wanted.set()
        for thread in self._threads:
            thread.join(timeout=LISTEN_POLL_S + 5)

    def _wake(self, payload: str) -> None:
        try:
            self._loop.call_soon_threadsafe(self._on_signal, counts_of(payload))
        except RuntimeError:  # (the loop closed: its server is stopping)
            self._stop.set()

    def _connect(self) -> Any:
        import psycopg

        return psycopg.connect(self._address, autocommit=True, connect_timeout=10)

    def _listen(self) -> None:
        while not self._stop.is_set():
            try:
                with self._connect() as conn:
                    conn.execute(f"LISTEN {CHANNEL}")
                    self.listening = True
                    log.info("work_signal_listening", channel=CHANNEL)
                    while not self._stop.is_set():
                        for note in conn.notifies(timeout=LISTEN_POLL_S):
                            if note.pid != self._sender_pid:
                                self.received += 1
                                self._wake(note.payload)
            except Exception as exc:  # (the database restarting, the network)
                self.listening = False
                if self._stop.is_set():
                    return
                log.warning("work_signal_listen_failed", error=repr(exc), retry_s=RECONNECT_S)
                self._stop.wait(RECONNECT_S)

    def _send(self) -> None:
        while not self._stop.is_set():
            try:
                with self._connect() as conn:
                    self._sender_pid = int(conn.info.backend_pid)
                    while True:
                        self._wanted.wait()
                        if self._stop.is_set():
                            return
                        self._wanted.clear()
                        with self._lock:
                            counts, self._counts = self._counts, {}
                        payload = payload_of(counts)
                        if counts is not None and not payload:
                            continue  # (nothing to wake)
                        conn.execute("SELECT pg_notify(%s, %s)", (CHANNEL, payload))
                        self.sent += 1
            except Exception as exc:
                if self._stop.is_set():
                    return
                log.warning("work_signal_send_failed", error=repr(exc), retry_s=RECONNECT_S)
                self._stop.wait(RECONNECT_S)
