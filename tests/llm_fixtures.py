"""A tiny random language model written in the shipped model's file layout, for fast tests.

`write_tiny_model(dir)` trains a small byte-level BPE tokenizer on a few sentences, makes a
random Llama (grouped-query attention, untied head) in the same `config.json` /
`model.safetensors` / `tokenizer.json` / `manifest.toml` files a shipped model has, with the
manifest's checksums, so it loads through the same verified path. Its answers are noise, but
deterministic: what the tests compare is the engine against the reference forward.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from gateway.llm.llama import Llama, LlamaSpec

BOS, EOS, PAD, END = "<|bos|>", "<|eos|>", "<|pad|>", "<|end|>"
USER, ASSISTANT, CALL, CALL_END = "<|user|>", "<|assistant|>", "<|tool_call|>", "<|/tool_call|>"
SPECIAL = [BOS, EOS, PAD, END, USER, ASSISTANT, CALL, CALL_END]
CONTEXT = 192

TEXTS = [
    "The agent runs ls -la and reads the output.",
    "Then it answers: the directory holds three files.",
    "café crème, naïve résumé; ünïcödé text for the tokenizer.",
    "echo hello world && cat /etc/hostname",
    "A quick brown fox jumps over the lazy dog 0123456789.",
] * 4

TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m.role == 'user' %}<|user|>{% else %}<|assistant|>{% endif %}"
    "{{ m.content }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def train_tokenizer() -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(TEXTS, trainer)
    return tokenizer


def write_tiny_model(directory: Path, seed: int = 0) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer()
    tokenizer.save(str(directory / "tokenizer.json"))
    ids = {t: tokenizer.token_to_id(t) for t in SPECIAL}
    spec = LlamaSpec(
        vocab_size=tokenizer.get_vocab_size(),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        bos_token_id=ids[BOS],
        eos_token_id=ids[EOS],
        pad_token_id=ids[PAD],
    )
    with torch.random.fork_rng():  # the tests' global random state stays as it was
        torch.manual_seed(seed)
        model = Llama(spec)
    with torch.no_grad():  # sharper logits than the default init: fewer near ties
        model.lm_head.weight.mul_(4.0)
    (directory / "config.json").write_text(json.dumps(spec.to_config(), indent=2))
    save_file(model.weights(), str(directory / "model.safetensors"))
    files = {
        name: hashlib.sha256((directory / name).read_bytes()).hexdigest()
        for name in ("config.json", "model.safetensors", "tokenizer.json")
    }
    lines = [
        'name = "tiny-test"',
        'revision = "r1"',
        f"context_length = {CONTEXT}",
        f"chat_template = {json.dumps(TEMPLATE)}",
        f"stop_tokens = {json.dumps([END])}",
        f"stop_token_ids = [{ids[END]}]",
        f"bos_token = {json.dumps(BOS)}",
        f"bos_token_id = {ids[BOS]}",
        f"eos_token = {json.dumps(EOS)}",
        f"eos_token_id = {ids[EOS]}",
        f"pad_token = {json.dumps(PAD)}",
        f"pad_token_id = {ids[PAD]}",
        f"special_tokens = {json.dumps(SPECIAL)}",
        f"tool_call_start = {json.dumps(CALL)}",
        f"tool_call_end = {json.dumps(CALL_END)}",
        'dtype = "float32"',
        f"parameters = {model.parameter_count()}",
        "",
        "[files]",
        *(f"{json.dumps(name)} = {json.dumps(digest)}" for name, digest in files.items()),
        "",
    ]
    (directory / "manifest.toml").write_text("\n".join(lines))
    return directory
