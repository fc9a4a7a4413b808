"""Memory admission: how many of a batch's samples a device can take without running out.

The estimate is weights + activations per sample * samples + reserved headroom, compared with
the device's capacity less what other batches hold (predicted), and on CUDA also with the free
memory the driver reports (observed). The batcher shrinks a batch to what fits and leaves the
rest queued; it never allocates past the limit.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MemoryModel:
    """What one model costs on a device, in bytes."""

    weights_bytes: int
    activation_bytes_per_sample: int
    headroom_bytes: int = 0
    """Kept free for the allocator's own overhead and fragmentation."""

    def batch_bytes(self, samples: int) -> int:
        return self.activation_bytes_per_sample * samples


@dataclass(frozen=True)
class Decision:
    admit: int
    """Samples to run now (0: none fits; wait for memory or route elsewhere)."""
    predicted_free_bytes: int
    reason: str


def admissible(
    model: MemoryModel,
    capacity_bytes: int,
    in_use_bytes: int,
    wanted: int,
    observed_free_bytes: int | None = None,
) -> Decision:
    """How many of `wanted` samples fit now.

    `in_use_bytes` is what batches already running hold (activations; the weights are counted
    once, here). `observed_free_bytes`, where the device reports it, caps the prediction.
    """
    free = capacity_bytes - model.weights_bytes - model.headroom_bytes - in_use_bytes
    if observed_free_bytes is not None:
        free = min(free, observed_free_bytes - model.headroom_bytes)
    per = max(1, model.activation_bytes_per_sample)
    fits = max(0, min(wanted, free // per))
    if fits == wanted:
        reason = "fits"
    elif fits == 0:
        reason = f"no room: {max(0, free)} bytes free, {per} per sample"
    else:
        reason = f"shrunk from {wanted} to {fits}: {free} bytes free"
    return Decision(admit=fits, predicted_free_bytes=max(0, free), reason=reason)
