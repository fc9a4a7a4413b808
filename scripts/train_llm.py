"""Trains the shipped language model, fleet-tiny-chat, and writes its files (see train-llm).

The text is made here (scripts/llm_transcripts.py): tool-using chat transcripts rendered by
the model's own chat template, so training and serving format prompts the same way. The
script trains a byte-level BPE tokenizer on them, then a small Llama (gateway.llm.llama, the
module the gateway serves with) on CPU, with the loss on the assistant's turns only. It ends
by greedy-decoding held-out requests and counting well-formed tool calls and answers that
quote the tool's output, and writes config.json, model.safetensors, tokenizer.json and
manifest.toml (with every file's sha256) into gateway/weights/<name>-<revision>/.

A fixed seed makes the data, tokenizer and initialisation the same on every run; float
summation order may still differ between machines, so rerun only to change the model.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

import torch  # noqa: E402
from llm_transcripts import Task, held_out_tasks, tool_call, transcript  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: E402

from gateway.llm.chat import SHELL_TOOL  # noqa: E402
from gateway.llm.llama import Llama, LlamaSpec, greedy  # noqa: E402
from gateway.llm.manifest import (  # noqa: E402
    MANIFEST_FILE,
    load_manifest,
    load_tokenizer,
    parse_tool_calls,
    render_template,
    sha256_of,
)
from gateway.settings import WEIGHTS_DIR  # noqa: E402

NAME, REVISION = "fleet-tiny-chat", "v1"
BOS, END, PAD = "<|bos|>", "<|end|>", "<|pad|>"
ROLES = ["<|system|>", "<|user|>", "<|assistant|>", "<|tool|>"]
TOOL_START, TOOL_END = "<tool_call>", "</tool_call>"

CHAT_TEMPLATE = """\
{%- macro text(content) -%}
{%- if content is string -%}
{{- content -}}
{%- elif content is iterable -%}
{%- for part in content -%}
{%- if part.type == 'text' -%}{{- part.text -}}{%- endif -%}
{%- endfor -%}
{%- endif -%}
{%- endmacro -%}
{{- bos_token -}}
{%- if tools -%}
<|system|>Tools: {% for tool in tools %}{{ tool.function.name if tool.function is defined \
else tool.name }}{{ ', ' if not loop.last else '' }}{% endfor %}{{ eos_token }}
{%- endif -%}
{%- for message in messages -%}
{%- if message.role == 'system' -%}
<|system|>{{ text(message.content) }}{{ eos_token }}
{%- elif message.role == 'user' -%}
<|user|>{{ text(message.content) }}{{ eos_token }}
{%- elif message.role == 'assistant' -%}
<|assistant|>{{ text(message.content) }}
{%- for call in message.tool_calls or [] -%}
{%- set arguments = call.function.arguments -%}
<tool_call>{"name": "{{ call.function.name }}", "arguments": \
{{ arguments if arguments is string else arguments | tojson }}}</tool_call>
{%- endfor -%}
{{ eos_token }}
{%- elif message.role == 'tool' -%}
<|tool|>{{ text(message.content) }}{{ eos_token }}
{%- else -%}
{{ raise_exception('unknown message role ' ~ message.role) }}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
<|assistant|>
{%- endif -%}
"""
"""OpenAI-style messages to the model's text: a turn is a role token, its text and <|end|>;
an assistant's tool call is <tool_call>{"name": ..., "arguments": {...}}</tool_call>; the
offered tools are named in a first system turn. <|end|> is the stop token."""


def render(messages: list[dict[str, Any]], tools: list[dict[str, Any]], prompt: bool) -> str:
    return render_template(CHAT_TEMPLATE, messages, tools, prompt, bos_token=BOS, eos_token=END)


def corpus(count: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [render(*transcript(rng), prompt=False) for _ in range(count)]


def train_tokenizer(texts: list[str], vocab_size: int) -> Tokenizer:
    """Byte-level BPE (any text encodes), digits split one by one so numbers copy digit by
    digit; roles and <|end|> special, the tool-call markers single ordinary tokens so they
    stay visible in decoded text."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=2, show_progress=False,
        special_tokens=[PAD, BOS, END, *ROLES], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )  # fmt: skip
    tokenizer.train_from_iterator(texts, trainer=trainer)
    tokenizer.add_tokens(
        [AddedToken(t, special=False, normalized=False) for t in (TOOL_START, TOOL_END)]
    )
    return tokenizer


def token_stream(tokenizer: Tokenizer, texts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """All transcripts' token ids end to end, and a mask of the tokens the loss counts: the
    assistant's, from after <|assistant|> through its <|end|>."""
    assistant, end = tokenizer.token_to_id(ROLES[2]), tokenizer.token_to_id(END)
    ids: list[int] = []
    mask: list[bool] = []
    for encoding in tokenizer.encode_batch(texts, add_special_tokens=False):
        inside = False
        for token in encoding.ids:
            ids.append(token)
            mask.append(inside)
            if token == assistant:
                inside = True
            elif token == end:
                inside = False
    return torch.tensor(ids), torch.tensor(mask)


def train(model: Llama, ids: torch.Tensor, mask: torch.Tensor, args: argparse.Namespace) -> float:
    """AdamW with warm-up and cosine decay on random windows of the stream; returns the
    last logged loss (mean over the assistant's tokens)."""
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01, betas=(0.9, 0.95))
    gen = torch.Generator().manual_seed(args.seed)
    window = args.window
    running, last = 0.0, float("nan")
    started = time.monotonic()
    for step in range(args.steps):
        lr = args.lr * min(1.0, (step + 1) / 50) * 0.5 * (1 + math.cos(math.pi * step / args.steps))
        for group in opt.param_groups:
            group["lr"] = max(lr, args.lr * 0.05)
        starts = torch.randint(0, len(ids) - window - 1, (args.batch,), generator=gen)
        x = torch.stack([ids[s : s + window] for s in starts])
        y = torch.stack([ids[s + 1 : s + window + 1] for s in starts])
        weight = torch.stack([mask[s + 1 : s + window + 1] for s in starts]).float()
        logits = model(x)
        losses = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), y.reshape(-1), reduction="none"
        )
        loss = (losses * weight.reshape(-1)).sum() / weight.sum().clamp(min=1)
        opt.zero_grad(set_to_none=True)
        loss.backward()  # type: ignore[no-untyped-call]
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        running += loss.item()
        if (step + 1) % args.log_every == 0 or step + 1 == args.steps:
            last = running / ((step % args.log_every) + 1)
            running = 0.0
            print(f"step {step + 1}/{args.steps}: loss {last:.4f} "
                  f"({time.monotonic() - started:.0f}s)", flush=True)  # fmt: skip
    return last


def check(model: Llama, tokenizer: Tokenizer, tasks: list[Task], samples: int) -> dict[str, float]:
    """Greedy-decodes each held-out request, then, given the tool's true output, the final
    answer; counts well-formed shell calls, exact commands and answers quoting the output."""
    end = tokenizer.token_to_id(END)
    assert end is not None
    model.eval()
    formed = exact = quoted = 0
    for i, (request, command, output, _answer) in enumerate(tasks):
        messages: list[dict[str, Any]] = [{"role": "user", "content": request}]
        prompt = tokenizer.encode(
            render(messages, [SHELL_TOOL], True), add_special_tokens=False
        ).ids
        text = tokenizer.decode(greedy(model, prompt, 96, {end}), skip_special_tokens=True)
        _, calls = parse_tool_calls(text, TOOL_START, TOOL_END)
        ok = len(calls) == 1 and calls[0].name == "shell"
        got = json.loads(calls[0].arguments).get("command") if ok else None
        formed += ok
        exact += got == command
        messages += [
            {"role": "assistant", "content": None, "tool_calls": [tool_call(command)]},
            {"role": "tool", "tool_call_id": "call_0", "content": output},
        ]
        prompt = tokenizer.encode(
            render(messages, [SHELL_TOOL], True), add_special_tokens=False
        ).ids
        answer = tokenizer.decode(greedy(model, prompt, 96, {end}), skip_special_tokens=True)
        quoted += all(part in answer for part in output.split("\n"))
        if i < samples:
            print(f"--- {request!r}\n  call:   {text!r}\n  wanted: {command!r}\n"
                  f"  tool:   {output!r}\n  answer: {answer!r}", flush=True)  # fmt: skip
    n = len(tasks)
    return {"tool_call_ok": formed / n, "command_exact": exact / n, "answer_quotes": quoted / n}


def toml_string(value: str) -> str:
    """A TOML basic string: JSON's escapes are all valid TOML escapes."""
    return json.dumps(value)


def write_model(out: Path, spec: LlamaSpec, model: Llama, tokenizer: Tokenizer,
                figures: dict[str, float]) -> None:  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(spec.to_config(), indent=2) + "\n")
    save_file(model.weights(), str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "model.safetensors").chmod(0o644)  # safetensors writes it private; it is shipped
    tokenizer.save(str(out / "tokenizer.json"))
    files = {
        name: sha256_of(out / name)
        for name in ("config.json", "model.safetensors", "tokenizer.json")
    }
    specials = [BOS, END, PAD, *ROLES, TOOL_START, TOOL_END]
    lines = [
        "# Written by scripts/train-llm; loading refuses any file whose sha256 differs.",
        f"# Held-out greedy check when trained: {json.dumps(figures)}",
        f"name = {toml_string(NAME)}",
        f"revision = {toml_string(REVISION)}",
        f"context_length = {spec.max_position_embeddings}",
        'dtype = "float32"',
        f"parameters = {model.parameter_count()}",
        f"bos_token = {toml_string(BOS)}",
        f"bos_token_id = {tokenizer.token_to_id(BOS)}",
        f"eos_token = {toml_string(END)}",
        f"eos_token_id = {tokenizer.token_to_id(END)}",
        f"pad_token = {toml_string(PAD)}",
        f"pad_token_id = {tokenizer.token_to_id(PAD)}",
        f"stop_tokens = [{toml_string(END)}]",
        f"stop_token_ids = [{tokenizer.token_to_id(END)}]",
        f"special_tokens = [{', '.join(map(toml_string, specials))}]",
        f"tool_call_start = {toml_string(TOOL_START)}",
        f"tool_call_end = {toml_string(TOOL_END)}",
        # A multi-line literal string, so the template reads as written (it holds no ''').
        f"chat_template = '''\n{CHAT_TEMPLATE}'''",
        "",
        "[files]",
        *(f"{toml_string(name)} = {toml_string(digest)}" for name, digest in files.items()),
    ]
    (out / MANIFEST_FILE).write_text("\n".join(lines) + "\n")
    manifest = load_manifest(out)  # the checksums and fields read back as the gateway reads them
    load_tokenizer(out, manifest)
    if manifest.chat_template != CHAT_TEMPLATE:
        raise SystemExit(f"{out / MANIFEST_FILE}: the chat template did not read back as written")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--transcripts", type=int, default=24_000)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--window", type=int, default=256, help="tokens per training row")
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--lr", type=float, default=4e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (one: the result does not depend on the machine's core count)",
    )
    parser.add_argument("--log-every", type=int, default=25)
    parser.add_argument(
        "--check",
        type=int,
        default=16,
        help="held-out requests to decode (the shipped model's: 16)",
    )
    parser.add_argument("--out", type=Path, default=WEIGHTS_DIR / f"{NAME}-{REVISION}")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    started = time.monotonic()
    texts = corpus(args.transcripts, seed=args.seed + 1)
    tokenizer = train_tokenizer(texts, args.vocab)
    ids, mask = token_stream(tokenizer, texts)
    print(f"{len(texts)} transcripts, {len(ids)} tokens ({int(mask.sum())} in the loss), "
          f"vocabulary {tokenizer.get_vocab_size()}", flush=True)  # fmt: skip
    spec = LlamaSpec(
        vocab_size=tokenizer.get_vocab_size(), hidden_size=args.hidden,
        intermediate_size=(args.hidden * 8 // 3 + 15) // 16 * 16,
        num_hidden_layers=args.layers, num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads, max_position_embeddings=args.context,
        rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=True,
        bos_token_id=tokenizer.token_to_id(BOS), eos_token_id=tokenizer.token_to_id(END),
        pad_token_id=tokenizer.token_to_id(PAD),
    )  # fmt: skip
    model = Llama(spec)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 2:
                std = (
                    0.02 / math.sqrt(2 * spec.num_hidden_layers)
                    if name.endswith(("o_proj.weight", "down_proj.weight"))
                    else 0.02
                )
                param.normal_(0.0, std)
    print(f"{model.parameter_count()} parameters", flush=True)
    loss = train(model, ids, mask, args)
    trained = time.monotonic() - started
    figures = check(
        model, tokenizer, held_out_tasks(seed=10_000_000 + args.seed, count=args.check), 6
    )
    figures["final_loss"] = round(loss, 4)
    write_model(args.out, spec, model, tokenizer, figures)
    size = sum(p.stat().st_size for p in args.out.iterdir())
    print(f"trained in {trained:.0f}s; held-out {figures}; wrote {args.out} ({size} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
