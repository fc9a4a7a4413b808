"""Tool-using chat transcripts for training the shipped language model (see train-llm).

Each transcript is a list of OpenAI-style messages: a user asks something a shell command
answers, the assistant calls the `shell` tool, the tool message holds the command's output,
and the assistant answers quoting it. Outputs are computed here, never by running a shell, so
the data is the same on every machine; file contents, listings and user names are invented.
Wording, numbers and words vary widely so the model copies and adapts rather than memorises.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from typing import Any

from gateway.llm.chat import SHELL_TOOL

Message = dict[str, Any]
Task = tuple[str, str, str, str]
"""A user request, the shell command that answers it, its output, the final answer."""


WORDS = [
    "apple", "river", "stone", "cloud", "green", "quick", "lazy", "brown", "fox", "dog", "cat",
    "bird", "tree", "house", "light", "dark", "water", "fire", "earth", "wind", "music", "paper",
    "table", "chair", "window", "door", "garden", "flower", "summer", "winter", "spring",
    "autumn", "morning", "evening", "night", "star", "moon", "sun", "ocean", "mountain", "valley",
    "forest", "road", "city", "village", "bridge", "train", "car", "boat", "plane", "ticket",
    "letter", "number", "word", "story", "book", "page", "pencil", "orange", "lemon", "cherry",
    "grape", "melon", "bread", "butter", "cheese", "honey", "sugar", "salt", "pepper", "coffee",
    "tea", "milk", "red", "blue", "yellow", "purple", "silver", "golden", "small", "large",
    "happy", "calm", "brave", "bright", "soft", "loud", "quiet", "fast", "slow", "warm", "cold",
    "early", "late", "open", "close", "north", "south", "east", "west", "left", "right", "first",
    "last", "alpha", "beta", "gamma", "delta", "kernel", "socket", "buffer", "packet", "server",
    "client", "cache", "queue", "token", "model", "batch", "fleet", "host", "agent", "rollout",
    "image", "layer", "shell", "script", "file", "folder", "data", "report", "robot", "engine",
    "rocket", "planet", "comet", "signal", "vector", "matrix", "tensor", "graph", "node", "edge",
    "path",
]  # fmt: skip
SYLLABLES = [
    "ka", "lo", "mi", "re", "su", "ta", "ne", "vo", "pi", "da", "fu", "ri", "ze", "mo", "la", "ki", "no", "be", "ga", "tu", "sha", "qua", "xen",
]  # fmt: skip
DIRS = ["src", "docs", "data", "logs", "tests", "build", "notes", "images", "out", "tmp"]
EXTS = ["txt", "md", "py", "csv", "log", "json", "toml", "sh"]
USERS = ["alice", "bob", "carol", "dave", "erin", "frank", "grace", "heidi", "ivan", "judy"]

SYSTEM_PROMPTS = [
    "You are a helpful assistant with a shell.",
    "You are a careful assistant. Use the shell tool when a command can answer.",
    "Answer briefly. Run commands with the shell tool.",
    "You help with small tasks on a Linux machine.",
]
GREETINGS = [
    ("hello", "Hello! Ask me something a shell command can answer."),
    ("hi", "Hi! What should I run for you?"),
    ("thanks", "You are welcome."),
    ("thank you!", "Glad to help."),
    ("who are you?", "I am a small assistant that answers with shell commands."),
    ("what can you do?", "I can run shell commands to count, sort, compute and read files."),
]


def word(rng: random.Random) -> str:
    if rng.random() < 0.75:
        return rng.choice(WORDS)
    return "".join(rng.choice(SYLLABLES) for _ in range(rng.randint(2, 3)))


def words(rng: random.Random, low: int, high: int) -> list[str]:
    return [word(rng) for _ in range(rng.randint(low, high))]


def filename(rng: random.Random) -> str:
    return f"{word(rng)}.{rng.choice(EXTS)}"


def number(rng: random.Random) -> int:
    return rng.choice([rng.randint(0, 9), rng.randint(10, 99), rng.randint(100, 9999)])


def pick(rng: random.Random, options: list[str], **values: Any) -> str:
    return rng.choice(options).format(**values)


def lines_arg(items: list[str]) -> str:
    r"""A printf argument holding one item per line (printf turns each \n into a newline)."""
    return "\\n".join(items) + "\\n"


# --- tasks: each returns (request, command, output, answer) -------------------------------


def count_words(rng: random.Random) -> Task:
    text = " ".join(words(rng, 2, 12))
    n = len(text.split())
    request = pick(rng, [
        "How many words are in '{t}'?", "Count the words in: {t}",
        "Please count the words in the sentence \"{t}\".", "word count of: {t}",
        "How many words does this have? {t}",
    ], t=text)  # fmt: skip
    answer = pick(rng, ["There are {n} words.", "The text has {n} words.", "{n} words."], n=n)
    return request, f"echo '{text}' | wc -w", str(n), answer


def count_lines(rng: random.Random) -> Task:
    items = words(rng, 1, 8)
    n = len(items)
    request = pick(rng, [
        "How many lines does this text have?\n{t}", "Count the lines:\n{t}",
        "Number of lines in the following?\n{t}",
    ], t="\n".join(items))  # fmt: skip
    answer = pick(rng, ["It has {n} lines.", "There are {n} lines.", "{n} lines."], n=n)
    return request, f"printf '{lines_arg(items)}' | wc -l", str(n), answer


def count_chars(rng: random.Random) -> Task:
    w = word(rng) if rng.random() < 0.7 else " ".join(words(rng, 2, 3))
    request = pick(rng, [
        "How many characters are in '{w}'?", "Count the characters of \"{w}\".",
        "What is the length of '{w}'?", "How long is the string '{w}'?",
    ], w=w)  # fmt: skip
    command = rng.choice([f"printf '%s' '{w}' | wc -c", f"echo -n '{w}' | wc -c"])
    if rng.random() < 0.3:
        command = f"python3 -c 'print(len(\"{w}\"))'"
    answer = pick(rng, ["'{w}' has {n} characters.", "It is {n} characters long.", "{n}."],
                  w=w, n=len(w))  # fmt: skip
    return request, command, str(len(w)), answer


def arithmetic(rng: random.Random) -> Task:
    a, b = number(rng), number(rng)
    op = rng.choice(["+", "-", "*", "/"])
    if op == "/":
        b = max(b, 1)
    result = {"+": a + b, "-": a - b, "*": a * b, "/": a // b if b else 0}[op]
    verb = {
        "+": ["What is {a} plus {b}?", "Add {a} and {b}.", "Compute {a} + {b}.", "{a} + {b} = ?"],
        "-": ["What is {a} minus {b}?", "Subtract {b} from {a}.", "Compute {a} - {b}."],
        "*": ["What is {a} times {b}?", "Multiply {a} by {b}.", "Compute {a} * {b}."],
        "/": ["What is {a} divided by {b}, rounded down?", "Integer division: {a} / {b}?"],
    }[op]
    request = pick(rng, verb, a=a, b=b)
    if rng.random() < 0.5:
        symbol = "\\*" if op == "*" else op  # expr needs its * escaped from the shell
        command = f"expr {a} {symbol} {b}"
    else:
        symbol = "//" if op == "/" else op
        command = f"python3 -c 'print({a} {symbol} {b})'"
    answer = pick(rng, ["{a} {op} {b} = {r}.", "The answer is {r}.", "It is {r}.", "{r}"],
                  a=a, b=b, op=op, r=result)  # fmt: skip
    return request, command, str(result), answer


def sum_numbers(rng: random.Random) -> Task:
    values = [number(rng) for _ in range(rng.randint(2, 6))]
    listed = ", ".join(map(str, values))
    request = pick(rng, ["What is the sum of {v}?", "Add up these numbers: {v}", "Total of {v}?"],
                   v=listed)  # fmt: skip
    command = f"python3 -c 'print(sum([{listed}]))'"
    answer = pick(rng, ["The sum is {s}.", "They add up to {s}.", "Total: {s}."], s=sum(values))
    return request, command, str(sum(values)), answer


def change_case(rng: random.Random) -> Task:
    text = " ".join(words(rng, 1, 5))
    if rng.random() < 0.6:
        request = pick(rng, ["Convert '{t}' to uppercase.", "Uppercase this: {t}",
                             "Make \"{t}\" all capitals."], t=text)  # fmt: skip
        return request, f"echo '{text}' | tr a-z A-Z", text.upper(), f"In uppercase: {text.upper()}"
    upper = text.upper()
    request = pick(rng, ["Convert '{t}' to lowercase.", "Lowercase this: {t}"], t=upper)
    return request, f"echo '{upper}' | tr A-Z a-z", text, f"In lowercase: {text}"


def sort_words(rng: random.Random) -> Task:
    items = words(rng, 2, 7)
    ordered = sorted(items)
    reverse = rng.random() < 0.2
    if reverse:
        ordered = ordered[::-1]
    request = pick(rng, [
        "Sort these words{r}: {w}", "Put {w} in{r2} alphabetical order.",
        "Can you sort{r}: {w}?",
    ], w=", ".join(items), r=" in reverse" if reverse else "",
        r2=" reverse" if reverse else "")  # fmt: skip
    flag = " -r" if reverse else ""
    command = rng.choice([
        f"printf '{lines_arg(items)}' | sort{flag}",
        f"echo '{' '.join(items)}' | tr ' ' '\\n' | sort{flag}",
    ])  # fmt: skip
    answer = pick(rng, ["Sorted: {s}.", "In order: {s}.", "{s}"], s=", ".join(ordered))
    return request, command, "\n".join(ordered), answer


def reverse_text(rng: random.Random) -> Task:
    w = word(rng)
    request = pick(rng, ["Reverse the letters of '{w}'.", "What is '{w}' backwards?",
                         "Spell {w} in reverse."], w=w)  # fmt: skip
    return (
        request,
        f"echo '{w}' | rev",
        w[::-1],
        pick(rng, ["Backwards: {r}", "It is {r}."], r=w[::-1]),
    )


def file_line(rng: random.Random) -> Task:
    name = filename(rng)
    if rng.random() < 0.3:
        name = f"{rng.choice(DIRS)}/{name}"
    line = " ".join(words(rng, 2, 8))
    if rng.random() < 0.6:
        request = pick(rng, ["What is the first line of {f}?", "Show me the first line of {f}.",
                             "Read the first line of the file {f}."], f=name)  # fmt: skip
        command = rng.choice([f"head -n 1 {name}", f"head -1 {name}"])
        answer = pick(rng, ["The first line of {f} is: {l}", "It reads: {l}"], f=name, l=line)
    else:
        request = pick(rng, ["What is the last line of {f}?", "Show the last line of {f}."],
                       f=name)  # fmt: skip
        command = f"tail -n 1 {name}"
        answer = pick(rng, ["The last line of {f} is: {l}", "It reads: {l}"], f=name, l=line)
    return request, command, line, answer


def list_files(rng: random.Random) -> Task:
    directory = rng.choice([*DIRS, "."])
    names = sorted({filename(rng) for _ in range(rng.randint(1, 6))})
    shown = "the current directory" if directory == "." else directory
    if rng.random() < 0.35:
        request = pick(rng, ["How many files are in {d}?", "Count the files in {d}."], d=shown)
        command = "ls | wc -l" if directory == "." else f"ls {directory} | wc -l"
        n = len(names)
        return (
            request,
            command,
            str(n),
            pick(rng, ["{d} has {n} files.", "{n} files."], d=shown, n=n),
        )
    request = pick(rng, ["What files are in {d}?", "List the files in {d}.", "Show me {d}."],
                   d=shown)  # fmt: skip
    command = "ls" if directory == "." else f"ls {directory}"
    answer = pick(rng, ["{d} contains: {n}.", "Files: {n}."], d=shown, n=", ".join(names))
    return request, command, "\n".join(names), answer


def grep_count(rng: random.Random) -> Task:
    needle, name, n = word(rng), filename(rng), rng.randint(0, 40)
    request = pick(rng, ["How many lines of {f} contain '{w}'?", "Count lines with {w} in {f}."],
                   f=name, w=needle)  # fmt: skip
    answer = pick(
        rng, ["{n} lines of {f} contain '{w}'.", "{n} lines match."], f=name, w=needle, n=n
    )
    return request, f"grep -c '{needle}' {name}", str(n), answer


def whoami(rng: random.Random) -> Task:
    user = rng.choice(USERS) if rng.random() < 0.7 else word(rng)
    if rng.random() < 0.5:
        request = rng.choice(["What is my user name?", "Who am I logged in as?", "whoami?"])
        return (
            request,
            "whoami",
            user,
            pick(rng, ["You are {u}.", "Your user name is {u}."], u=user),
        )
    path = f"/home/{user}/{word(rng)}"
    request = rng.choice(["Which directory am I in?", "What is the current directory?"])
    return (
        request,
        "pwd",
        path,
        pick(rng, ["You are in {p}.", "The current directory is {p}."], p=path),
    )


TASKS: list[Callable[[random.Random], Task]] = [
    count_words, count_lines, count_chars, arithmetic, sum_numbers, change_case, sort_words,
    reverse_text, file_line, list_files, grep_count, whoami,
]  # fmt: skip


def tool_call(command: str) -> dict[str, Any]:
    return {
        "id": "call_0",
        "type": "function",
        "function": {"name": "shell", "arguments": json.dumps({"command": command})},
    }


def exchange(rng: random.Random, task: Task) -> list[Message]:
    request, command, output, answer = task
    if rng.random() < 0.2:
        request = (
            request.lower() if rng.random() < 0.5 else "Please " + request[0].lower() + request[1:]
        )
    content = output + ("\n" if rng.random() < 0.3 else "")
    return [
        {"role": "user", "content": request},
        {"role": "assistant", "content": None, "tool_calls": [tool_call(command)]},
        {"role": "tool", "tool_call_id": "call_0", "content": content},
        {"role": "assistant", "content": answer},
    ]


def transcript(rng: random.Random) -> tuple[list[Message], list[dict[str, Any]]]:
    """One conversation and the tools offered with it."""
    messages: list[Message] = []
    if rng.random() < 0.3:
        messages.append({"role": "system", "content": rng.choice(SYSTEM_PROMPTS)})
    if rng.random() < 0.05:
        said, reply = rng.choice(GREETINGS)
        messages += [{"role": "user", "content": said}, {"role": "assistant", "content": reply}]
        if rng.random() < 0.5:
            return messages, [SHELL_TOOL] if rng.random() < 0.5 else []
    for _ in range(1 if rng.random() < 0.8 else rng.randint(2, 3)):
        messages += exchange(rng, rng.choice(TASKS)(rng))
    return messages, [SHELL_TOOL]


def held_out_tasks(seed: int, count: int) -> list[Task]:
    """Tasks from a seed the training set does not use, for checking generations."""
    rng = random.Random(seed)
    return [TASKS[i % len(TASKS)](rng) for i in range(count)]
