"""The gateway's language models: the shipped model's files (`manifest`), the plain Llama
reference (`llama`) and the engine that serves it.

A shipped model is a directory under gateway/weights/ holding a Hugging Face Llama
`config.json`, `model.safetensors`, a `tokenizers` `tokenizer.json` and fleet's
`manifest.toml`, which names the revision, each file's sha256, the context length, the chat
template and the stop tokens. Loading refuses a file whose checksum differs.
"""

from gateway.llm.llama import Llama, LlamaSpec, load_model
from gateway.llm.manifest import (
    ModelManifest,
    load_manifest,
    load_tokenizer,
    parse_tool_calls,
    render_chat,
)

__all__ = [
    "Llama",
    "LlamaSpec",
    "ModelManifest",
    "load_manifest",
    "load_model",
    "load_tokenizer",
    "parse_tool_calls",
    "render_chat",
]
