"""The SQL ledger: rollouts, manifests, work items, leases, hosts, events, artifacts.

Every method is one transaction. Methods are synchronous; the server calls them from one
worker thread so the asyncio loop never blocks on the database. `Ledger` is the verbs' modules
together over one `fleet.ledger.base.LedgerBase`.
"""

from __future__ import annotations

import random

from sqlalchemy.engine import Engine

from fleet.ledger.base import AVOID_HOST_S, HOST_STATES, HostView, LedgerBase
from fleet.ledger.checkpoints import Checkpoints
from fleet.ledger.completions import Completions
from fleet.ledger.hosts import Hosts
from fleet.ledger.identity import Identities
from fleet.ledger.leases import Leases
from fleet.ledger.parks import Parks
from fleet.ledger.reads import Reads
from fleet.ledger.submissions import Submissions
from fleet.ledger.tables import CHECKPOINT_ROW_BYTES

__all__ = ["AVOID_HOST_S", "CHECKPOINT_ROW_BYTES", "HOST_STATES", "HostView", "Ledger"]


class Ledger(Submissions, Reads, Hosts, Leases, Completions, Checkpoints, Parks, LedgerBase):
    """The ledger (see the module docstring)."""

    def __init__(self, engine: Engine, *, rng: random.Random | None = None) -> None:
        super().__init__(engine, rng=rng)
        self.identities = Identities(self)
        """Join tokens, enrolled and revoked hosts, tenants' API keys."""
