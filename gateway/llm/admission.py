"""Where a language-model request goes, decided before any memory is spent.

A request's cost on its device is predicted from the model alone: its KV cache is whole
blocks for prompt + `max_tokens` (`blocks * block_size * bytes_per_token`: fragmentation is
the part of the last block it does not fill), and its prefill's temporaries (activations and
logits for the prompt's tokens). The weights are resident already, and the cache's blocks were
taken when the engine started, so a request that is given its blocks cannot run out of cache.
On a CUDA device the free memory the driver reports (observed) is checked beside the
prediction too, less a reserved headroom, since another process may take memory the
prediction counted on.

The decision, per request, in this order:

- `primary`: it fits now (its blocks are free, and on CUDA its temporaries fit what is free);
- `wait`: it will fit once running sequences end, and the primary's queue has room and its
  oldest request has not waited past the bound;
- `shrink`: the client allowed a smaller `max_tokens` (down to a floor it named) and that fits
  now;
- `replica`: the CPU replica takes it (the client did not forbid falling back, the request is
  within the replica's shorter context and its own bounded queue has room);
- `refuse`: 429 when the gateway is full (with when to retry), 503 when no device can serve.

Pure: the caller gathers the figures (`DeviceView`) and acts on the decision.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Footprint:
    """What one request costs a device, in bytes."""

    blocks: int
    kv_bytes: int
    temporaries_bytes: int


def footprint(
    prompt_tokens: int,
    max_tokens: int,
    *,
    block_size: int,
    kv_bytes_per_token: int,
    activation_bytes_per_token: int,
) -> Footprint:
    tokens = prompt_tokens + max_tokens
    blocks = -(-tokens // block_size)
    return Footprint(
        blocks=blocks,
        kv_bytes=blocks * block_size * kv_bytes_per_token,
        temporaries_bytes=prompt_tokens * activation_bytes_per_token,
    )


@dataclass(frozen=True)
class DeviceView:
    """One engine as admission sees it now."""

    serving: bool
    """It runs, and (for the primary) the breaker lets requests through."""
    context_length: int
    block_size: int
    blocks_total: int
    blocks_free: int
    """Free in the engine's cache, less what requests admitted here but not yet given their
    blocks will take."""
    waiting: int
    max_waiting: int
    oldest_wait_s: float
    max_wait_s: float
    kv_bytes_per_token: int
    activation_bytes_per_token: int
    observed_free_bytes: int | None = None
    """The driver's free memory (CUDA), None where it cannot tell (a CPU)."""
    headroom_bytes: int = 0


@dataclass(frozen=True)
class Decision:
    kind: str
    """"primary", "wait", "shrink", "replica" or "refuse"."""
    reason: str
    max_tokens: int
    status: int = 200
    """For "refuse": 429 (full: retry later) or 503 (nothing can serve)."""
    retry_after_s: float = 0.0


def _fits_now(view: DeviceView, need: Footprint) -> bool:
    if need.blocks > view.blocks_free:
        return False
    if view.observed_free_bytes is None:
        return True
    return need.temporaries_bytes + view.headroom_bytes <= view.observed_free_bytes


def _need(view: DeviceView, prompt_tokens: int, max_tokens: int) -> Footprint:
    return footprint(
        prompt_tokens, max_tokens, block_size=view.block_size,
        kv_bytes_per_token=view.kv_bytes_per_token,
        activation_bytes_per_token=view.activation_bytes_per_token,
    )  # fmt: skip


def decide(
    primary: DeviceView,
    replica: DeviceView | None,
    prompt_tokens: int,
    max_tokens: int,
    *,
    no_fallback: bool = False,
    shrink_floor: int | None = None,
    retry_after_s: float = 1.0,
) -> Decision:
    """Where a request of `prompt_tokens` + `max_tokens` goes (see the module docstring)."""
    tokens = prompt_tokens + max_tokens
    why: list[str] = []
    if primary.serving:
        need = _need(primary, prompt_tokens, max_tokens)
        if _fits_now(primary, need):
            return Decision("primary", f"fits now: {need.blocks} KV blocks free", max_tokens)
        if need.blocks > primary.blocks_total:
            why.append(f"needs {need.blocks} KV blocks, the cache has {primary.blocks_total}")
        elif primary.waiting >= primary.max_waiting:
            why.append(f"the primary's queue is full ({primary.waiting} waiting)")
        elif primary.oldest_wait_s > primary.max_wait_s:
            why.append(
                f"the primary's oldest request has waited {primary.oldest_wait_s:.1f} s "
                f"(bound {primary.max_wait_s:g} s)"
            )
        else:
            short = need.blocks - primary.blocks_free
            return Decision("wait", f"waits for {max(short, 0)} KV blocks", max_tokens)
        if shrink_floor is not None and shrink_floor < max_tokens:
            fit = primary.blocks_free * primary.block_size - prompt_tokens
            shrunk = min(max_tokens - 1, fit)
            if shrunk >= max(shrink_floor, 1) and _fits_now(
                primary, _need(primary, prompt_tokens, shrunk)
            ):
                return Decision("shrink", f"max_tokens {max_tokens} -> {shrunk}: "
                                f"{'; '.join(why)}", shrunk)  # fmt: skip
    else:
        why.append("the primary is not serving")
    if no_fallback:
        status = 503 if not primary.serving else 429
        return Decision("refuse", "; ".join(why) + "; the client asked for no fallback",
                        max_tokens, status, retry_after_s)  # fmt: skip
    if replica is None or not replica.serving:
        status = 503 if not primary.serving else 429
        return Decision("refuse", "; ".join(why) + "; no CPU replica is serving", max_tokens,
                        status, retry_after_s)  # fmt: skip
    if tokens > replica.context_length:
        return Decision("refuse", "; ".join(why) + f"; the CPU replica's context is "
                        f"{replica.context_length} tokens, the request {tokens}", max_tokens,
                        503 if not primary.serving else 429, retry_after_s)  # fmt: skip
    if replica.waiting >= replica.max_waiting:
        return Decision("refuse", "; ".join(why) + f"; the CPU replica's queue is full "
                        f"({replica.waiting} waiting)", max_tokens, 429, retry_after_s)  # fmt: skip
    need = _need(replica, prompt_tokens, max_tokens)
    if need.blocks > replica.blocks_total:
        return Decision("refuse", "; ".join(why) + f"; the CPU replica's cache has "
                        f"{replica.blocks_total} blocks, the request needs {need.blocks}",
                        max_tokens, 429, retry_after_s)  # fmt: skip
    return Decision("replica", "; ".join(why), max_tokens)
