"""Chat on the shipped model's own template: prompts rendered from OpenAI messages, tool calls
parsed back (whole and as a stream), `tool_choice` applied, and bad tools and messages refused
by the field at fault."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest

from fleet.core.errors import InvalidArgument
from gateway.llm.chat import (
    AnswerStream,
    ParsedAnswer,
    check_messages,
    check_tools,
    parse_answer,
    render_prompt,
)
from gateway.llm.manifest import ModelManifest, load_manifest, render_chat
from gateway.llm.serving import SHIPPED
from gateway.settings import WEIGHTS_DIR

SHELL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "shell",
        "description": "Run a shell command.",
        "parameters": {
            "type": "object",
            "properties": {"command": {"type": "string"}},
            "required": ["command"],
        },
    },
}


@pytest.fixture(scope="module")
def manifest() -> ModelManifest:
    return load_manifest(WEIGHTS_DIR / SHIPPED)


def call(name: str, arguments: dict[str, Any], id: str = "call_0") -> dict[str, Any]:
    return {"id": id, "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments)}}  # fmt: skip


def test_the_shipped_template_renders_roles_tools_and_calls(manifest: ModelManifest) -> None:
    messages: list[dict[str, Any]] = [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "count "},
                                     {"type": "text", "text": "words"}]},
        {"role": "assistant", "content": None, "tool_calls": [call("shell", {"command": "wc"})]},
        {"role": "tool", "tool_call_id": "call_0", "content": "3"},
    ]  # fmt: skip
    prompt = render_prompt(manifest, messages, [SHELL])
    assert prompt.text == (
        "<|bos|><|system|>Tools: shell<|end|><|system|>Be brief.<|end|><|user|>count words"
        '<|end|><|assistant|><tool_call>{"name": "shell", "arguments": {"command": "wc"}}'
        "</tool_call><|end|><|tool|>3<|end|><|assistant|>"
    )
    assert prompt.tools == ("shell",) and prompt.forced == ""


def test_a_call_rendered_by_the_template_parses_back_to_itself(manifest: ModelManifest) -> None:
    """What the template writes for an assistant's calls (the form the model was trained on)
    is what the parser reads: names and arguments survive the round trip."""
    calls = [call("shell", {"command": "echo 'a \"b\"' | wc -w"}),
             call("read_file", {"path": "/etc/hostname", "lines": [1, 2]}, "call_1")]  # fmt: skip
    user = {"role": "user", "content": "go"}
    before = render_chat(manifest, [user], add_generation_prompt=True)
    answer = {"role": "assistant", "content": "Running.", "tool_calls": calls}
    whole = render_chat(manifest, [user, answer], add_generation_prompt=False)
    assert whole.startswith(before) and whole.endswith(manifest.eos_token)
    written = whole[len(before) : -len(manifest.eos_token)]  # what the model would generate

    tool = {**SHELL, "function": {**SHELL["function"], "name": "read_file"}}
    prompt = render_prompt(manifest, [user], [SHELL, tool])
    parsed = parse_answer(manifest, prompt, written)
    assert parsed.content == "Running."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"]))
            for c in parsed.tool_calls] == [("shell", {"command": "echo 'a \"b\"' | wc -w"}),
                                            ("read_file", {"path": "/etc/hostname",
                                                           "lines": [1, 2]})]  # fmt: skip
    ids = [c["id"] for c in parsed.tool_calls]
    assert all(i.startswith("call_") for i in ids) and len(set(ids)) == 2


ANSWERS = [
    "Just words, no call.",
    '<tool_call>{"name": "shell", "arguments": {"command": "ls"}}</tool_call>',
    'Let me look. <tool_call>{"name": "shell", "arguments": {"command": "pwd"}}</tool_call> ok',
    "a < b and <tool_ is not a call",
    "<tool_call>not json</tool_call> then text",
    '<tool_call>{"name": "shell", "arguments": {"command": "x"}}</tool_call>'
    '<tool_call>{"name": "shell", "arguments": {"command": "y"}}</tool_call>',
    "ends with a partial marker <tool_ca",
]


@pytest.mark.parametrize("text", ANSWERS)
def test_a_streamed_answer_assembles_to_the_whole_answer(
    manifest: ModelManifest, text: str
) -> None:
    """However the text is cut into pieces, the content released as it comes plus what
    `finish` gives equals `parse_answer` of the whole, and no marker leaks into content."""
    prompt = render_prompt(manifest, [{"role": "user", "content": "hi"}], [SHELL])
    whole = parse_answer(manifest, prompt, text)
    rng = random.Random(text)
    for _ in range(20):
        stream = AnswerStream(manifest, prompt)
        content, at = "", 0
        while at < len(text):
            step = rng.randint(1, 6)
            released = stream.push(text[at : at + step])
            if whole.tool_calls:
                assert manifest.tool_call_start not in content + released
            content += released
            at += step
        rest = stream.finish()
        assert content + (rest.content or "") == (whole.content or "")
        strip = [{**c, "id": ""} for c in rest.tool_calls]
        assert strip == [{**c, "id": ""} for c in whole.tool_calls]


def test_without_tools_everything_is_content(manifest: ModelManifest) -> None:
    prompt = render_prompt(manifest, [{"role": "user", "content": "hi"}])
    text = ANSWERS[1]
    assert parse_answer(manifest, prompt, text) == ParsedAnswer(text, [])
    stream = AnswerStream(manifest, prompt)
    assert stream.push(text[:5]) + stream.push(text[5:]) == text
    assert "Tools:" not in prompt.text


def test_tool_choice_forces_or_withholds_calls(manifest: ModelManifest) -> None:
    user = [{"role": "user", "content": "hi"}]
    none = render_prompt(manifest, user, [SHELL], "none")
    assert "Tools:" not in none.text and none.tools == ()

    required = render_prompt(manifest, user, [SHELL], "required")
    assert required.text.endswith("<|assistant|><tool_call>")
    rest = '{"name": "shell", "arguments": {"command": "ls"}}</tool_call>'
    parsed = parse_answer(manifest, required, rest)
    assert parsed.content is None and parsed.tool_calls[0]["function"]["name"] == "shell"

    named = render_prompt(manifest, user, [SHELL], {"type": "function",
                                                    "function": {"name": "shell"}})  # fmt: skip
    assert named.text.endswith('<tool_call>{"name": "shell", "arguments": ')
    stream = AnswerStream(manifest, named)
    assert stream.push('{"command": "pwd"}}') == "" and stream.push("</tool_call>") == ""
    streamed = stream.finish()
    assert json.loads(streamed.tool_calls[0]["function"]["arguments"]) == {"command": "pwd"}
    # A forced call the model never closed is not a call: what it wrote is the content.
    assert parse_answer(manifest, named, '{"command": ') == ParsedAnswer('{"command": ', [])


def _tool(**function: Any) -> dict[str, Any]:
    return {"type": "function", "function": {"name": "shell", **function}}


@pytest.mark.parametrize(
    ("tools", "named"),
    [
        ("shell", "tools:"),
        ([{"type": "retrieval"}], "tools[0].type:"),
        ([{"type": "function"}], "tools[0].function:"),
        ([_tool(name="")], "tools[0].function.name:"),
        ([_tool(name="a" * 65)], "tools[0].function.name:"),
        ([_tool(name="run shell")], "tools[0].function.name:"),
        ([SHELL, SHELL], "tools[1].function.name:"),
        ([_tool(description=5)], "tools[0].function.description:"),
        ([_tool(parameters="object")], "tools[0].function.parameters:"),
        ([_tool(parameters={"type": "string"})], "tools[0].function.parameters.type:"),
        ([_tool(parameters={"type": "object", "properties": []})],
         "tools[0].function.parameters.properties:"),
        ([_tool(parameters={"type": "object", "properties": {"a": {"type": "str"}}})],
         "tools[0].function.parameters.properties.a.type:"),
        ([_tool(parameters={"type": "object", "properties": {}, "required": ["a"]})],
         "tools[0].function.parameters.required:"),
        ([_tool(parameters={"type": "object", "properties": {"a": {
            "type": "array", "items": {"type": "float"}}}})],
         "tools[0].function.parameters.properties.a.items.type:"),
        ([_tool(returns={})], "tools[0].function.returns:"),
        ([{**SHELL, "extra": 1}], "tools[0].extra:"),
        ([SHELL] * 129, "tools:"),
    ],
)  # fmt: skip
def test_bad_tools_are_refused_naming_the_field(tools: Any, named: str) -> None:
    with pytest.raises(InvalidArgument) as refused:
        check_tools(tools)
    assert refused.value.message.startswith(named), refused.value.message


def test_a_deeply_nested_schema_is_refused() -> None:
    schema: dict[str, Any] = {"type": "object", "properties": {}}
    inner = schema
    for _ in range(40):
        inner["properties"]["x"] = {"type": "object", "properties": {}}
        inner = inner["properties"]["x"]
    with pytest.raises(InvalidArgument, match="nested deeper"):
        check_tools([_tool(parameters=schema)])
    assert check_tools([_tool()])[0]["function"]["parameters"] == {"type": "object",
                                                                   "properties": {}}  # fmt: skip


@pytest.mark.parametrize(
    ("messages", "named"),
    [
        ([], "messages:"),
        ([{"role": "robot", "content": "x"}], "messages[0].role:"),
        ([{"role": "user"}], "messages[0].content:"),
        ([{"role": "user", "content": [{"type": "image_url"}]}], "messages[0].content[0].type:"),
        ([{"role": "user", "content": 3}], "messages[0].content:"),
        ([{"role": "assistant"}], "messages[0].content:"),
        ([{"role": "user", "content": "x", "tool_calls": [call("shell", {})]}],
         "messages[0].tool_calls:"),
        ([{"role": "tool", "content": "out"}], "messages[0].tool_call_id:"),
        ([{"role": "user", "content": "x"},
          {"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
                                                "function": {"name": "s", "arguments": "{"}}]}],
         "messages[1].tool_calls[0].function.arguments:"),
    ],
)  # fmt: skip
def test_bad_messages_are_refused_naming_the_field(messages: Any, named: str) -> None:
    with pytest.raises(InvalidArgument) as refused:
        check_messages(messages)
    assert refused.value.message.startswith(named), refused.value.message


def test_bad_tool_choices_are_refused(manifest: ModelManifest) -> None:
    user = [{"role": "user", "content": "hi"}]
    for tools, choice, named in (
        (None, "auto", "tool_choice:"),
        ([SHELL], "always", "tool_choice:"),
        ([SHELL], {"type": "function", "function": {"name": "ls"}}, "tool_choice.function.name:"),
        ([SHELL], {"type": "function"}, "tool_choice:"),
    ):
        with pytest.raises(InvalidArgument) as refused:
            render_prompt(manifest, user, tools, choice)
        assert refused.value.message.startswith(named), refused.value.message
