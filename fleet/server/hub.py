"""The routing of session calls to the hosts holding the sessions' machines (see
`fleet.server.sessions`): one stream per host, replies matched to calls by call id."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from fleet.api.pb import host_pb2
from fleet.core.errors import FailedPrecondition, Unavailable


@dataclass
class HostLink:
    """One host's session stream: commands go down `commands`; replies reach their call."""

    host_id: str
    commands: asyncio.Queue[host_pb2.SessionCommand] = field(default_factory=asyncio.Queue)
    calls: dict[str, asyncio.Queue[host_pb2.SessionReply | None]] = field(default_factory=dict)
    ready: set[str] = field(default_factory=set)
    """Work ids of sessions whose machine is ready on this host."""


class SessionHub:
    def __init__(self) -> None:
        self.links: dict[str, HostLink] = {}
        self.changed = asyncio.Event()

    def attach(self, host_id: str) -> HostLink:
        old = self.links.get(host_id)
        if old is not None:
            self.detach(old)
        link = HostLink(host_id)
        self.links[host_id] = link
        return link

    def detach(self, link: HostLink) -> None:
        if self.links.get(link.host_id) is link:
            del self.links[link.host_id]
        for queue in link.calls.values():
            queue.put_nowait(None)  # the host is gone
        self._wake()

    def deliver(self, link: HostLink, reply: host_pb2.SessionReply) -> None:
        if reply.WhichOneof("kind") == "ready":  # (False: the session's machine is gone)
            if reply.ready:
                link.ready.add(reply.work_id)
            else:
                link.ready.discard(reply.work_id)
            self._wake()
            return
        queue = link.calls.get(reply.call_id)
        if queue is not None:
            queue.put_nowait(reply)

    def is_ready(self, host_id: str, work_id: str) -> bool:
        link = self.links.get(host_id)
        return link is not None and work_id in link.ready

    def _wake(self) -> None:
        self.changed.set()
        self.changed = asyncio.Event()

    async def call(
        self, host_id: str, session_id: str, command: host_pb2.SessionCommand,
        more: list[host_pb2.SessionCommand] | None = None,
    ) -> AsyncIterator[host_pb2.SessionReply]:  # fmt: skip
        """The replies to one command (and `more` of the same call: its stdin), ending with its
        exit or error."""
        link = self.links.get(host_id)
        if link is None:
            raise Unavailable(
                f"session {session_id}: host {host_id}, which holds its machine, is not "
                "connected (lost or restarting); the session is not moved elsewhere"
            )
        command.call_id = uuid.uuid4().hex
        queue: asyncio.Queue[host_pb2.SessionReply | None] = asyncio.Queue()
        link.calls[command.call_id] = queue
        link.commands.put_nowait(command)
        for extra in more or []:
            extra.call_id, extra.work_id = command.call_id, command.work_id
            link.commands.put_nowait(extra)
        try:
            while True:
                reply = await queue.get()
                if reply is None:
                    raise Unavailable(
                        f"session {session_id}: host {host_id}, which holds its machine, was "
                        "lost during the call"
                    )
                kind = reply.WhichOneof("kind")
                if kind == "error":
                    raise FailedPrecondition(f"session {session_id}: {reply.error}")
                yield reply
                if kind == "exit":
                    return
        finally:
            link.calls.pop(command.call_id, None)
