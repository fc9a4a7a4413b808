"""The paged KV cache: fixed-size blocks of keys and values, lent to sequences by a free list.

All memory is taken once, at start: per layer, K and V tensors of
[num_blocks, block_size, kv_heads, head_dim]. A sequence holds a block table (the blocks its
positions live in, in order); position p is slot `table[p // block_size] * block_size +
p % block_size` of the layer's flattened view. A request is admitted only when the blocks for
its prompt and its whole `max_tokens` are free, and takes them at once, so a running sequence
never runs out of cache mid-answer and nothing needs to be preempted; they return to the free
list the moment the sequence ends or is aborted. Against a contiguous allocation per request
(a context-length slab each), whole blocks waste at most `block_size - 1` positions per
sequence, so the same memory holds as many sequences as their real lengths allow.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from fleet.core.errors import ResourceExhausted


def bytes_per_token(num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """The model's theoretical KV cost of one cached token: a key and a value per layer."""
    return 2 * num_layers * kv_heads * head_dim * dtype.itemsize


@dataclass(frozen=True)
class Admission:
    """Whether a request of `tokens` (prompt + max_tokens) can take its blocks."""

    tokens: int
    blocks_needed: int
    blocks_free: int
    blocks_total: int

    @property
    def fits_now(self) -> bool:
        return self.blocks_needed <= self.blocks_free

    @property
    def fits_ever(self) -> bool:
        """False: the request is larger than the whole cache and must be refused up front."""
        return self.blocks_needed <= self.blocks_total


class PagedKVCache:
    def __init__(
        self,
        *,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(
                f"num_blocks ({num_blocks}) and block_size ({block_size}) must be >= 1"
            )
        self.num_layers = num_layers
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.kv_heads = kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        shape = (num_layers, num_blocks, block_size, kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        # A stack: the most recently freed block is lent first (still warm in the caches).
        self._free = list(range(num_blocks - 1, -1, -1))
        self._lent: set[int] = set()

    # -- accounting ------------------------------------------------------------------------

    @property
    def bytes_per_token(self) -> int:
        """Bytes of the preallocated tensors per cacheable token, measured on the tensors."""
        total = self.k.numel() * self.k.element_size() + self.v.numel() * self.v.element_size()
        return total // (self.num_blocks * self.block_size)

    @property
    def theoretical_bytes_per_token(self) -> int:
        return bytes_per_token(self.num_layers, self.kv_heads, self.head_dim, self.dtype)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def admission(self, prompt_tokens: int, max_tokens: int) -> Admission:
        """How many blocks a request of a prompt plus `max_tokens` needs, and if they are free."""
        tokens = prompt_tokens + max_tokens
        return Admission(tokens, self.blocks_for(tokens), len(self._free), self.num_blocks)

    # -- lending ---------------------------------------------------------------------------

    def allocate(self, tokens: int) -> list[int]:
        """Blocks for `tokens` positions, taken from the free list (all or none)."""
        need = self.blocks_for(tokens)
        if need > len(self._free):
            raise ResourceExhausted(
                f"the KV cache has {len(self._free)} free blocks, {need} needed for {tokens} tokens"
            )
        blocks = [self._free.pop() for _ in range(need)]
        self._lent.update(blocks)
        return blocks

    def free(self, blocks: Sequence[int]) -> None:
        for b in blocks:
            if b not in self._lent:
                raise ValueError(f"block {b} is not lent (freed twice?)")
            self._lent.remove(b)
            self._free.append(b)

    # -- addressing ------------------------------------------------------------------------

    def slot_map(self, table: Sequence[int]) -> torch.Tensor:
        """The flat slot of every position a block `table` holds, on the cache's device: a
        sequence's blocks are all lent at admission, so its map is made once."""
        blocks = torch.tensor(list(table), dtype=torch.long)
        offsets = torch.arange(self.block_size, dtype=torch.long)
        return (blocks[:, None] * self.block_size + offsets).reshape(-1).to(self.k.device)

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store keys and values [N, kv_heads, head_dim] at flat `slots` [N] of one layer."""
        self.k[layer].view(-1, self.kv_heads, self.head_dim).index_copy_(0, slots, k)
        self.v[layer].view(-1, self.kv_heads, self.head_dim).index_copy_(0, slots, v)

    def gather(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values at flat `slots` of any shape S: each [*S, kv_heads, head_dim]."""
        flat = slots.reshape(-1)
        shape = (*slots.shape, self.kv_heads, self.head_dim)
        k = self.k[layer].view(-1, self.kv_heads, self.head_dim).index_select(0, flat)
        v = self.v[layer].view(-1, self.kv_heads, self.head_dim).index_select(0, flat)
        return k.view(shape), v.view(shape)
