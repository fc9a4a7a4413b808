"""Signing in to the console with an API key: checked as the API's authenticator
(`fleet.server.auth`) checks a bearer key, against the same ledger rows and with the same
rules: known id, matching secret, not revoked, not expired. A signed-in session is checked
against its key's row again on each request (cached briefly), so revoking the key signs the
browser out as it refuses the key's API calls."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any

from fleet.core.credentials import Scope, matches, parse_api_key
from fleet.core.errors import PermissionDenied, Unauthenticated
from fleet.ledger.identity import ApiKey

KeyRow = Callable[[str], tuple[ApiKey, str] | None]
Read = Callable[..., Awaitable[Any]]


class Keys:
    """Verifies keys presented at sign-in and keys named by sessions."""

    def __init__(self, read: Read, key_row: KeyRow, cache_s: float = 1.0) -> None:
        self._read = read
        self._key_row = key_row
        self.cache_s = cache_s
        self._rows: dict[str, tuple[float, tuple[ApiKey, str] | None]] = {}

    async def _row(self, key_id: str) -> tuple[ApiKey, str] | None:
        now = time.monotonic()
        hit = self._rows.get(key_id)
        if hit is not None and now - hit[0] < self.cache_s:
            return hit[1]
        row: tuple[ApiKey, str] | None = await self._read(self._key_row, key_id)
        if len(self._rows) > 10_000:
            self._rows.clear()
        self._rows[key_id] = (now, row)
        return row

    @staticmethod
    def _usable(key: ApiKey, now: float) -> None:
        if key.revoked_at is not None:
            raise Unauthenticated(f"API key {key.id} was revoked")
        if key.expires_at is not None and key.expires_at <= now:
            raise Unauthenticated(f"API key {key.id} has expired")
        if not key.scopes & {Scope.ROLLOUTS_READ, Scope.ADMIN}:
            raise PermissionDenied(f"API key {key.id} can read nothing (it lacks rollouts:read)")

    async def sign_in(self, text: str) -> ApiKey:
        """The key `text` is, if it may sign in; else Unauthenticated or PermissionDenied
        saying why (a wrong secret and an unknown id say only that)."""
        presented = parse_api_key(text)
        row = await self._row(presented.id)
        if row is None or not matches(presented.secret, row[1]):
            raise Unauthenticated("unknown API key, or a wrong secret")
        self._usable(row[0], time.time())
        return row[0]

    async def still_good(self, key_id: str) -> ApiKey | None:
        """The key a session names, if it is still usable (None: signed out)."""
        row = await self._row(key_id)
        if row is None:
            return None
        try:
            self._usable(row[0], time.time())
        except (Unauthenticated, PermissionDenied):
            return None
        return row[0]
