"""The language model: the reference Llama against `transformers` on the same files, the
manifest's checksums and chat template, and the shipped weights' behaviour.

`transformers` is only the baseline here; the gateway never imports it.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from fleet.core.errors import FailedPrecondition, InvalidArgument
from gateway.llm.llama import Llama, LlamaSpec, greedy, load_model, load_weights
from gateway.llm.manifest import (
    load_manifest,
    load_tokenizer,
    parse_tool_calls,
    render_chat,
)
from gateway.settings import WEIGHTS_DIR

SHIPPED = WEIGHTS_DIR / "fleet-tiny-chat-v1"
SHELL = {
    "type": "function",
    "function": {
        "name": "shell",
        "description": "Run a shell command and return its standard output.",
        "parameters": {"type": "object", "properties": {"command": {"type": "string"}}},
    },
}


def write_random_model(directory: Path, spec: LlamaSpec, seed: int) -> Llama:
    """A model with every weight random (norms too, so a mixed-up norm would show) written
    as config.json and model.safetensors."""
    torch.manual_seed(seed)
    model = Llama(spec)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.3)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(spec.to_config()))
    save_file(model.weights(), str(directory / "model.safetensors"), metadata={"format": "pt"})
    return model


@pytest.mark.parametrize(
    ("tied", "kv_heads"), [(True, 2), (False, 4), (True, 1)], ids=["tied-gqa", "untied-mha", "mqa"]
)
def test_reference_forward_matches_transformers(tmp_path: Path, tied: bool, kv_heads: int) -> None:
    from transformers import LlamaForCausalLM

    spec = LlamaSpec(
        vocab_size=101, hidden_size=48, intermediate_size=80, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=kv_heads, max_position_embeddings=64,
        rms_norm_eps=1e-5, rope_theta=500.0, tie_word_embeddings=tied,
    )  # fmt: skip
    write_random_model(tmp_path, spec, seed=7)
    ours = Llama(LlamaSpec.load(tmp_path))
    load_weights(ours, tmp_path / "model.safetensors")
    theirs = LlamaForCausalLM.from_pretrained(
        tmp_path, dtype=torch.float32, attn_implementation="eager"
    )
    theirs.eval()  # type: ignore[no-untyped-call]
    ids = torch.randint(0, spec.vocab_size, (3, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = theirs(ids).logits
        got = ours.eval()(ids)
    assert got.shape == (3, 40, spec.vocab_size)
    assert expected.abs().max() > 1.0  # the comparison is not between near-zero logits
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_spec_reads_what_it_writes_and_refuses_bad_configs(tmp_path: Path) -> None:
    spec = LlamaSpec(
        vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
    )  # fmt: skip
    assert LlamaSpec.from_config(spec.to_config()) == spec
    config = spec.to_config()
    with pytest.raises(InvalidArgument, match="num_key_value_heads 3"):
        LlamaSpec.from_config({**config, "num_key_value_heads": 3}, where="x.json")
    with pytest.raises(InvalidArgument, match=r"x\.json: missing hidden_size"):
        LlamaSpec.from_config({k: v for k, v in config.items() if k != "hidden_size"}, "x.json")
    with pytest.raises(InvalidArgument, match="hidden_size must be int, not '32'"):
        LlamaSpec.from_config({**config, "hidden_size": "32"})
    with pytest.raises(InvalidArgument, match="head_dim times heads"):
        LlamaSpec.from_config({**config, "head_dim": 16})
    with pytest.raises(InvalidArgument, match="model_type 'gpt2'"):
        LlamaSpec.from_config({**config, "model_type": "gpt2"})


def test_weights_of_another_shape_are_refused_by_name(tmp_path: Path) -> None:
    spec = LlamaSpec(
        vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
    )  # fmt: skip
    write_random_model(tmp_path, spec, seed=1)
    wider = Llama(LlamaSpec(**{**spec.__dict__, "intermediate_size": 96}))
    expected = r"down_proj\.weight has shape \[32, 64\], the config needs \[32, 96\]"
    with pytest.raises(FailedPrecondition, match=expected):
        load_weights(wider, tmp_path / "model.safetensors")
    deeper = Llama(LlamaSpec(**{**spec.__dict__, "num_hidden_layers": 2}))
    with pytest.raises(FailedPrecondition, match=r"missing \['model.layers.1"):
        load_weights(deeper, tmp_path / "model.safetensors")


def test_reference_forward_is_causal() -> None:
    """A later token never changes an earlier position's logits."""
    spec = LlamaSpec(
        vocab_size=40, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
    )  # fmt: skip
    torch.manual_seed(3)
    model = Llama(spec).eval()
    ids = torch.randint(0, 40, (1, 12))
    changed = ids.clone()
    changed[0, 8:] = (changed[0, 8:] + 1) % 40
    with torch.no_grad():
        a, b = model(ids), model(changed)
    torch.testing.assert_close(a[:, :8], b[:, :8])
    assert not torch.allclose(a[:, 8:], b[:, 8:])
    with pytest.raises(InvalidArgument, match="exceed the context length 32"):
        model(torch.zeros(1, 33, dtype=torch.long))


# --- the shipped model ----------------------------------------------------------------------


def test_shipped_model_loads_with_its_manifest() -> None:
    spec, model, manifest = load_model(SHIPPED)
    tokenizer = load_tokenizer(SHIPPED, manifest)
    assert manifest.model_id == "fleet-tiny-chat-v1"
    assert (
        manifest.parameters == model.parameter_count() == sum(p.numel() for p in model.parameters())
    )
    assert manifest.context_length == spec.max_position_embeddings
    assert spec.vocab_size == tokenizer.get_vocab_size()
    assert manifest.stop_token_ids == (tokenizer.token_to_id(manifest.eos_token),)
    assert spec.eos_token_id == manifest.eos_token_id
    for token in manifest.special_tokens:  # each marker is one token, not spelled out
        assert tokenizer.encode(token, add_special_tokens=False).tokens == [token]
    assert set(manifest.files) == {"config.json", "model.safetensors", "tokenizer.json"}
    size = sum((SHIPPED / name).stat().st_size for name in manifest.files)
    assert size < 8 * 2**20, "the shipped model is meant to weigh a few MB"


@pytest.mark.parametrize("name", ["model.safetensors", "tokenizer.json", "config.json"])
def test_a_flipped_byte_is_refused_naming_the_file(tmp_path: Path, name: str) -> None:
    copy = tmp_path / "model"
    shutil.copytree(SHIPPED, copy)
    load_manifest(copy)  # the intact copy verifies
    data = bytearray((copy / name).read_bytes())
    data[len(data) // 2] ^= 0x01
    (copy / name).write_bytes(bytes(data))
    with pytest.raises(FailedPrecondition, match=rf"{name} has sha256 .*refusing"):
        load_model(copy)
    with pytest.raises(FailedPrecondition, match=rf"{name} has sha256"):
        load_tokenizer(copy)


def test_a_missing_file_or_manifest_field_is_refused(tmp_path: Path) -> None:
    copy = tmp_path / "model"
    shutil.copytree(SHIPPED, copy)
    (copy / "tokenizer.json").unlink()
    with pytest.raises(FailedPrecondition, match=r"cannot read tokenizer\.json"):
        load_manifest(copy)
    text = (SHIPPED / "manifest.toml").read_text()
    (copy / "manifest.toml").write_text(text.replace("context_length =", "context_len ="))
    with pytest.raises(FailedPrecondition, match=r"manifest\.toml: missing 'context_length'"):
        load_manifest(copy, verify=False)


def conversation() -> list[dict[str, Any]]:
    return [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "How many words are in 'red fox'?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {
                        "name": "shell",
                        "arguments": '{"command": "echo \'red fox\' | wc -w"}',
                    },
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "2\n"},
        {"role": "assistant", "content": [{"type": "text", "text": "There are 2 words."}]},
        {"role": "user", "content": "thanks"},
    ]


def test_chat_template_renders_tool_calls_and_results() -> None:
    manifest = load_manifest(SHIPPED)
    text = render_chat(manifest, conversation(), tools=[SHELL])
    assert text == (
        "<|bos|><|system|>Tools: shell<|end|><|system|>Be brief.<|end|>"
        "<|user|>How many words are in 'red fox'?<|end|>"
        '<|assistant|><tool_call>{"name": "shell", "arguments": '
        '{"command": "echo \'red fox\' | wc -w"}}</tool_call><|end|>'
        "<|tool|>2\n<|end|><|assistant|>There are 2 words.<|end|>"
        "<|user|>thanks<|end|><|assistant|>"
    )
    # Arguments given as an object render as the same JSON; no tools, no tools turn.
    messages = conversation()[:3]
    messages[2]["tool_calls"][0]["function"]["arguments"] = {"command": "echo 'red fox' | wc -w"}
    plain = render_chat(manifest, messages, add_generation_prompt=False)
    assert plain.startswith("<|bos|><|system|>Be brief.<|end|>")
    assert plain.endswith("""{"command": "echo 'red fox' | wc -w"}}</tool_call><|end|>""")
    with pytest.raises(InvalidArgument, match="unknown message role robot"):
        render_chat(manifest, [{"role": "robot", "content": "hi"}])


def test_parse_tool_calls_keeps_what_is_not_a_call() -> None:
    content, calls = parse_tool_calls(
        'ok <tool_call>{"name": "shell", "arguments": {"command": "ls"}}</tool_call>'
        "<tool_call>not json</tool_call>",
        "<tool_call>",
        "</tool_call>",
    )
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("shell", {"command": "ls"})]
    assert content == "ok <tool_call>not json</tool_call>"


def test_shipped_model_calls_the_shell_and_quotes_its_output() -> None:
    """Greedy decoding by the reference forward from a chat prompt: the shipped weights emit
    a well-formed call of the command that answers, and given its output, an answer that
    quotes it. (The model is tiny: it does not always copy the user's words exactly.)"""
    _, model, manifest = load_model(SHIPPED)
    tokenizer = load_tokenizer(SHIPPED, manifest)
    stop = set(manifest.stop_token_ids)
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": "How many words are in 'green river stone cloud'?"}
    ]
    prompt = tokenizer.encode(render_chat(manifest, messages, tools=[SHELL])).ids
    out = greedy(model, prompt, 64, stop)
    assert out[-1] in stop
    content, calls = parse_tool_calls(
        tokenizer.decode(out, skip_special_tokens=True),
        manifest.tool_call_start,
        manifest.tool_call_end,
    )
    assert content == ""
    assert len(calls) == 1 and calls[0].name == "shell"
    command = json.loads(calls[0].arguments)["command"]
    assert command.startswith("echo '") and command.endswith("| wc -w")  # the right tool
    function = {"name": "shell", "arguments": calls[0].arguments}
    call = {"id": "c", "type": "function", "function": function}
    messages += [
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c", "content": "4"},
    ]
    prompt = tokenizer.encode(render_chat(manifest, messages, tools=[SHELL])).ids
    answer = tokenizer.decode(greedy(model, prompt, 48, stop), skip_special_tokens=True)
    assert "4" in answer and "<tool_call>" not in answer
