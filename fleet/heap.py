"""The heap of a long-lived process, settled once it has started.

A daemon's start leaves hundreds of thousands of objects that live as long as it does: its
modules, and torch's in the gateway (some 220,000 objects there). Python's collector walks all
of them on every full collection, and a busy server triggers one every few hundred requests
(the objects of requests in flight outlive the younger generations): a pause of 100-150 ms in
the gateway, for every stream it relays at that moment. `settle()` collects once and moves
what survives to the permanent generation, which no later collection walks; the garbage of
requests is collected as before.
"""

from __future__ import annotations

import gc

import structlog

log = structlog.get_logger(__name__)


def settle() -> int:
    """Collects the start's garbage and freezes the rest (`gc.freeze`); returns how many
    objects are now out of the collector's walks. Call it once, when the process has started
    (its imports made, its model loaded) and before it serves."""
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    log.info("heap_settled", frozen_objects=frozen)
    return frozen
