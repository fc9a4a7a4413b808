"""One forward step of the Llama over the paged KV cache, for a batch of sequences at once.

Each sequence brings the tokens to add (its whole prompt for a prefill, its last token for a
decode step) and the position of the first. The step writes their keys and values into the
sequence's blocks, then lets every new token attend to its sequence's cached positions up to
its own, gathered through the block table: one padded [batch, keys] gather per layer, a mask for
causality and for the padding, and the reference's own eager attention. Only the last new
token's logits come back (the one the sampler needs).

The blocks are the reference model's (`gateway.llm.llama`), so the numerics are the same ops
in the same dtypes; what differs is the shape of the matrix products, which may round the last
bit differently, never the algorithm.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from gateway.llm.kv_cache import PagedKVCache
from gateway.llm.llama import Llama, attention, repeat_kv, rope_tables


@dataclass(frozen=True)
class StepInput:
    tokens: Sequence[int]
    """The tokens whose keys and values are not cached yet (at least one)."""
    start: int
    """Position of tokens[0]: how many of the sequence's tokens are cached already."""
    slots: torch.Tensor
    """The sequence's slot map on the cache's device (`PagedKVCache.slot_map`), holding at
    least start + len(tokens) positions."""


def forward_step(model: Llama, cache: PagedKVCache, batch: Sequence[StepInput]) -> torch.Tensor:
    """Logits [len(batch), vocab] of each sequence's last new token; caches the new tokens."""
    spec = model.spec
    device = cache.k.device
    rows = len(batch)
    width = max(len(s.tokens) for s in batch)
    keys = max(s.start + len(s.tokens) for s in batch)

    ids: list[int] = []
    # Padding queries sit at position 0, where every sequence has a key: no row is all masked.
    positions: list[int] = []
    new_rows: list[int] = []
    for b, s in enumerate(batch):
        n, end = len(s.tokens), s.start + len(s.tokens)
        ids.extend(s.tokens)
        ids.extend([0] * (width - n))
        positions.extend(range(s.start, end))
        positions.extend([0] * (width - n))
        new_rows.extend(range(b * width, b * width + n))
    ids_t = torch.tensor(ids, dtype=torch.long).view(rows, width).to(device)
    pos_t = torch.tensor(positions, dtype=torch.long).view(rows, width).to(device)
    last = torch.tensor([len(s.tokens) - 1 for s in batch], dtype=torch.long).to(device)
    write_rows = torch.tensor(new_rows, dtype=torch.long).to(device)
    write_slots = torch.cat([s.slots[s.start : s.start + len(s.tokens)] for s in batch])
    # Each row's slot map, cut or padded to `keys`; what lies past a row's end is masked.
    key_slots = torch.zeros(rows, keys, dtype=torch.long, device=device)
    for b, s in enumerate(batch):
        span = min(keys, s.slots.shape[0])
        key_slots[b, :span] = s.slots[:span]
    key_positions = torch.arange(keys, device=device)
    # [rows, 1, width, keys]: keys at or before the query's position. That is causality and
    # the padding at once: a row's real queries lie before its end, its padding at position 0.
    mask = (key_positions[None, None, :] <= pos_t[:, :, None])[:, None]

    x = model.model.embed_tokens(ids_t)
    cos, sin = rope_tables(spec, pos_t, x.dtype)
    groups = spec.kv_groups
    for i, layer in enumerate(model.layers):
        attn = layer.self_attn
        q, k, v = attn.qkv(layer.input_layernorm(x), cos, sin)
        kv_heads, head_dim = k.shape[1], k.shape[3]
        flat_k = k.transpose(1, 2).reshape(rows * width, kv_heads, head_dim)
        flat_v = v.transpose(1, 2).reshape(rows * width, kv_heads, head_dim)
        cache.write(i, write_slots, flat_k[write_rows], flat_v[write_rows])
        past_k, past_v = cache.gather(i, key_slots)  # [rows, keys, kv_heads, head_dim]
        past_k = repeat_kv(past_k.transpose(1, 2), groups)
        past_v = repeat_kv(past_v.transpose(1, 2), groups)
        x = x + attn.out(attention(q, past_k, past_v, mask))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    final = x[torch.arange(rows, device=device), last]
    logits: torch.Tensor = model.lm_head(model.model.norm(final))
    return logits
