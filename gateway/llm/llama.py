"""A plain Llama decoder in PyTorch: the reference forward and the blocks the engine reuses.

The architecture is Hugging Face's `LlamaForCausalLM` (RMSNorm, rotary positions, a SwiGLU
MLP, grouped-query attention, a causal mask), read from the same `config.json` and
`model.safetensors` under the same parameter names, so `transformers` can load a shipped model
as a baseline while the gateway never imports it. The numerics follow the Hugging Face eager
path (norms and softmax in float32, rotary tables in float32), which is what lets the tests
compare logits with it, and what would let a CPU replica reproduce a GPU's greedy tokens.

`Llama.forward` recomputes everything from the token ids, with no cache: it is the reference
the paged engine is checked against, not the serving path.
"""

from __future__ import annotations

import json
import math
from dataclasses import MISSING, asdict, dataclass, fields
from pathlib import Path
from typing import Any

import structlog
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn

from fleet.core.errors import FailedPrecondition, InvalidArgument
from gateway.llm.manifest import ModelManifest, load_manifest

log = structlog.get_logger(__name__)

WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"


@dataclass(frozen=True)
class LlamaSpec:
    """The shape of one model, as a Hugging Face `LlamaConfig` states it."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = True
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    pad_token_id: int | None = None

    def __post_init__(self) -> None:
        for name in (
            "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
            "num_attention_heads", "num_key_value_heads", "max_position_embeddings",
        ):  # fmt: skip
            if getattr(self, name) <= 0:
                raise InvalidArgument(f"llama config: {name} must be positive")
        if self.hidden_size % self.num_attention_heads:
            raise InvalidArgument(
                f"llama config: hidden_size {self.hidden_size} is not a multiple of "
                f"num_attention_heads {self.num_attention_heads}"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise InvalidArgument(
                f"llama config: num_attention_heads {self.num_attention_heads} is not a "
                f"multiple of num_key_value_heads {self.num_key_value_heads}"
            )
        if self.head_dim % 2:
            raise InvalidArgument(f"llama config: head_dim {self.head_dim} must be even (RoPE)")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def kv_groups(self) -> int:
        """Query heads that share one key/value head."""
        return self.num_attention_heads // self.num_key_value_heads

    def kv_bytes_per_token(self, bytes_per_number: int) -> int:
        """What one cached token costs: a key and a value per layer and key/value head."""
        return (
            2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim
            * bytes_per_number
        )  # fmt: skip

    @classmethod
    def from_config(cls, config: dict[str, Any], where: str = CONFIG_FILE) -> LlamaSpec:
        """The spec of a `LlamaConfig` dictionary; `where` names it in errors."""
        if config.get("model_type", "llama") != "llama":
            raise InvalidArgument(f"{where}: model_type {config.get('model_type')!r} is not llama")
        if config.get("rope_scaling") or config.get("attention_bias") or config.get("mlp_bias"):
            raise InvalidArgument(f"{where}: rope scaling and biases are not supported")
        known = {f.name: f for f in fields(cls)}
        values = {k: v for k, v in config.items() if k in known}
        if "num_key_value_heads" not in values and "num_attention_heads" in values:
            values["num_key_value_heads"] = values["num_attention_heads"]
        rope = config.get("rope_parameters")
        if isinstance(rope, dict) and "rope_theta" in rope and "rope_theta" not in values:
            values["rope_theta"] = rope["rope_theta"]
        missing = sorted(n for n, f in known.items() if n not in values and f.default is MISSING)
        if missing:
            raise InvalidArgument(f"{where}: missing {', '.join(missing)}")
        for name, value in values.items():
            kind = str(known[name].type)
            if not _fits(kind, value):
                raise InvalidArgument(f"{where}: {name} must be {kind}, not {value!r}")
        head_dim, heads = config.get("head_dim"), values["num_attention_heads"]
        if head_dim is not None and head_dim * heads != values["hidden_size"]:
            raise InvalidArgument(f"{where}: head_dim times heads must equal hidden_size")
        return cls(**values)

    @classmethod
    def load(cls, directory: Path) -> LlamaSpec:
        path = directory / CONFIG_FILE
        try:
            config = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise FailedPrecondition(f"cannot read model config {path}: {exc}") from exc
        if not isinstance(config, dict):
            raise InvalidArgument(f"{path}: not a JSON object")
        return cls.from_config(config, where=str(path))

    def to_config(self) -> dict[str, Any]:
        """A `config.json` that `transformers`' `LlamaForCausalLM` loads as this model."""
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            **asdict(self),
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "attention_bias": False,
            "mlp_bias": False,
            "rope_scaling": None,
            "torch_dtype": "float32",
        }


def _fits(kind: str, value: object) -> bool:
    """Whether a JSON value fits a spec field's annotation (JSON has no int/bool split)."""
    if kind == "bool":
        return isinstance(value, bool)
    if isinstance(value, bool):
        return False
    if kind == "float":
        return isinstance(value, int | float)
    if kind == "int | None" and value is None:
        return True
    return isinstance(value, int)


# --- blocks ---------------------------------------------------------------------------------


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Scales each vector to unit root mean square, computed in float32 whatever `x` is."""
    dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def rope_frequencies(spec: LlamaSpec, device: torch.device | str | None = None) -> torch.Tensor:
    """The rotary inverse frequencies, one per pair of a head's dimensions (float32)."""
    exponents = torch.arange(0, spec.head_dim, 2, dtype=torch.int64, device=device).float()
    return 1.0 / (spec.rope_theta ** (exponents / spec.head_dim))


def rope_tables(
    spec: LlamaSpec, positions: torch.Tensor, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin for the given absolute positions, shaped [*positions.shape, head_dim].

    Positions are explicit so the engine can ask for any token's, e.g. a decode step's single
    position per sequence; the angles are computed in float32 and only then cast.
    """
    inv = rope_frequencies(spec, positions.device)
    angles = positions.to(torch.float32)[..., None] * inv
    emb = torch.cat((angles, angles), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotates queries or keys ([..., T, head_dim]) by their positions' tables ([..., T,
    head_dim], broadcast over the heads by the caller's shapes)."""
    return x * cos + rotate_half(x) * sin


def repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    """Key/value heads [B, KV, T, D] repeated to the query heads [B, KV*groups, T, D]."""
    if groups == 1:
        return x
    b, kv, t, d = x.shape
    return x[:, :, None].expand(b, kv, groups, t, d).reshape(b, kv * groups, t, d)


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None
) -> torch.Tensor:
    """Scaled dot-product attention, the eager way: q [B, H, Tq, D], k/v [B, H, Tk, D], mask
    boolean (True = may attend) broadcast to [B, H, Tq, Tk]. Softmax in float32."""
    scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    if mask is not None:
        scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(weights, v)


def causal_mask(length: int, device: torch.device | str | None = None) -> torch.Tensor:
    return torch.ones(length, length, dtype=torch.bool, device=device).tril()


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class Attention(nn.Module):
    """Grouped-query self-attention; the projections carry Hugging Face's names."""

    def __init__(self, spec: LlamaSpec) -> None:
        super().__init__()
        self.spec = spec
        d, h, kv = spec.head_dim, spec.num_attention_heads, spec.num_key_value_heads
        self.q_proj = nn.Linear(spec.hidden_size, h * d, bias=False)
        self.k_proj = nn.Linear(spec.hidden_size, kv * d, bias=False)
        self.v_proj = nn.Linear(spec.hidden_size, kv * d, bias=False)
        self.o_proj = nn.Linear(h * d, spec.hidden_size, bias=False)

    def qkv(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries [B, H, T, D] and keys, values [B, KV, T, D] of x [B, T, hidden], with the
        rotary positions (cos, sin [B or 1, T, D]) applied to queries and keys."""
        b, t, _ = x.shape
        d = self.spec.head_dim
        q = self.q_proj(x).view(b, t, -1, d).transpose(1, 2)
        k = self.k_proj(x).view(b, t, -1, d).transpose(1, 2)
        v = self.v_proj(x).view(b, t, -1, d).transpose(1, 2)
        cos, sin = cos[:, None], sin[:, None]
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def out(self, o: torch.Tensor) -> torch.Tensor:
        """The output projection of attended values o [B, H, T, D]."""
        b, _, t, _ = o.shape
        y: torch.Tensor = self.o_proj(o.transpose(1, 2).reshape(b, t, -1))
        return y

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None
    ) -> torch.Tensor:
        q, k, v = self.qkv(x, cos, sin)
        groups = self.spec.kv_groups
        return self.out(attention(q, repeat_kv(k, groups), repeat_kv(v, groups), mask))


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, spec: LlamaSpec) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(spec.hidden_size, spec.intermediate_size, bias=False)
        self.up_proj = nn.Linear(spec.hidden_size, spec.intermediate_size, bias=False)
        self.down_proj = nn.Linear(spec.intermediate_size, spec.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y: torch.Tensor = self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return y


class DecoderLayer(nn.Module):
    def __init__(self, spec: LlamaSpec) -> None:
        super().__init__()
        self.self_attn = Attention(spec)
        self.mlp = MLP(spec)
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask)
        y: torch.Tensor = x + self.mlp(self.post_attention_layernorm(x))
        return y


class LlamaBody(nn.Module):
    """The decoder stack (Hugging Face's `LlamaModel`, hence the `model.` prefix of names)."""

    def __init__(self, spec: LlamaSpec) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(spec) for _ in range(spec.num_hidden_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)


class Llama(nn.Module):
    """The causal language model. State-dict names equal `LlamaForCausalLM`'s."""

    def __init__(self, spec: LlamaSpec) -> None:
        super().__init__()
        self.spec = spec
        self.model = LlamaBody(spec)
        self.lm_head = nn.Linear(spec.hidden_size, spec.vocab_size, bias=False)
        if spec.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def layers(self) -> list[DecoderLayer]:
        return list(self.model.layers)  # type: ignore[arg-type]

    def hidden_states(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The final normed hidden states [B, T, hidden] of token ids [B, T] at positions
        0..T-1, every token attending to itself and those before it."""
        if input_ids.dim() != 2:
            raise InvalidArgument(f"input_ids must be [batch, tokens], not {list(input_ids.shape)}")
        t = input_ids.shape[1]
        if t > self.spec.max_position_embeddings:
            raise InvalidArgument(
                f"{t} tokens exceed the context length {self.spec.max_position_embeddings}"
            )
        x = self.model.embed_tokens(input_ids)
        positions = torch.arange(t, device=input_ids.device)[None]
        cos, sin = rope_tables(self.spec, positions, x.dtype)
        mask = causal_mask(t, input_ids.device)
        for layer in self.model.layers:
            x = layer(x, cos, sin, mask)
        return self.model.norm(x)  # type: ignore[no-any-return]

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Logits [B, T, vocab] of token ids [B, T]."""
        return self.lm_head(self.hidden_states(input_ids))  # type: ignore[no-any-return]

    def weights(self) -> dict[str, torch.Tensor]:
        """The tensors to save under their Hugging Face names (a tied head saved once)."""
        state = {k: v.detach().contiguous() for k, v in self.state_dict().items()}
        if self.spec.tie_word_embeddings:
            state.pop("lm_head.weight")
        return state

    def parameter_count(self) -> int:
        """Distinct parameters (a tied head counted once)."""
        return sum(t.numel() for t in self.weights().values())


@torch.inference_mode()
def greedy(model: Llama, prompt: list[int], max_tokens: int, stop_ids: set[int]) -> list[int]:
    """Greedy continuation by the reference forward (the whole sequence recomputed per token:
    slow, exact, for tests and checks). Stops after a stop id, which is included."""
    device = next(model.parameters()).device
    ids = list(prompt)
    out: list[int] = []
    for _ in range(max_tokens):
        if len(ids) >= model.spec.max_position_embeddings:
            break
        logits = model(torch.tensor([ids], device=device))[0, -1]
        token = int(torch.argmax(logits))
        out.append(token)
        ids.append(token)
        if token in stop_ids:
            break
    return out


def load_weights(model: Llama, path: Path) -> None:
    """Loads `model.safetensors` into the model, refusing missing, extra or misshapen
    tensors by name."""
    try:
        state = load_file(str(path))
    except Exception as exc:  # safetensors raises its own error types for a bad file
        raise FailedPrecondition(f"cannot read weights {path}: {exc}") from exc
    expected = model.weights()
    missing = sorted(set(expected) - set(state))
    extra = sorted(set(state) - set(expected))
    if missing or extra:
        raise FailedPrecondition(
            f"{path}: tensors missing {missing[:5]} unexpected {extra[:5]} for this config"
        )
    for name, tensor in state.items():
        if tensor.shape != expected[name].shape:
            raise FailedPrecondition(
                f"{path}: {name} has shape {list(tensor.shape)}, the config needs "
                f"{list(expected[name].shape)}"
            )
    model.load_state_dict(state, strict=False)


def load_model(
    directory: Path,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> tuple[LlamaSpec, Llama, ModelManifest]:
    """A shipped model ready for inference on `device` in `dtype`, after its manifest's
    checksums were verified (a file that differs is refused by name)."""
    manifest = load_manifest(directory)
    spec = LlamaSpec.load(directory)
    if manifest.context_length > spec.max_position_embeddings:
        raise FailedPrecondition(
            f"{directory}: manifest context_length {manifest.context_length} exceeds the "
            f"config's max_position_embeddings {spec.max_position_embeddings}"
        )
    model = Llama(spec)
    load_weights(model, directory / WEIGHTS_FILE)
    model.to(device=device, dtype=dtype).eval()
    log.info(
        "llm_loaded", model=manifest.name, revision=manifest.revision, device=str(device),
        dtype=str(dtype).removeprefix("torch."), parameters=model.parameter_count(),
    )  # fmt: skip
    return spec, model, manifest
