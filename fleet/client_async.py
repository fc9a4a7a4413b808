"""The async client, by its older name: `fleet.client.AsyncFleet` and `AsyncSession`."""

from fleet.client.aio import AsyncFleet, AsyncSession

__all__ = ["AsyncFleet", "AsyncSession"]
