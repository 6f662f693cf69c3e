"""Conversation records from JSON lines: the OpenAI form and the ShareGPT form.

OpenAI:   {"messages": [{"role": "system"|"user"|"assistant", "content": "..."}, ...]}
ShareGPT: {"conversations": [{"from": "system"|"human"|"gpt", "value": "..."}, ...]}
Prompt-only rows (evaluation): {"prompt": "..."}.

Both normalise to a list of `{"role": ..., "content": ...}` dicts with roles system / user /
assistant. Problems raise `ConversationError` with the reason; readers add the line number.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROLE_ALIASES = {
    "system": "system",
    "user": "user",
    "human": "user",
    "assistant": "assistant",
    "gpt": "assistant",
    "model": "assistant",
}

Message = dict[str, str]


class ConversationError(ValueError):
    """A record that is not a usable conversation."""


def parse_conversation(obj: Any, *, require_assistant: bool = True) -> list[Message]:
    """Normalise one decoded JSON record to a list of messages."""
    if not isinstance(obj, dict):
        raise ConversationError(f"expected a JSON object, got {type(obj).__name__}")
    if "messages" in obj:
        turns, role_key, text_key = obj["messages"], "role", "content"
    elif "conversations" in obj:
        turns, role_key, text_key = obj["conversations"], "from", "value"
    elif "prompt" in obj and not require_assistant:
        if not isinstance(obj["prompt"], str):
            raise ConversationError("'prompt' must be a string")
        return [{"role": "user", "content": obj["prompt"]}]
    else:
        raise ConversationError("no 'messages' or 'conversations' field")
    if not isinstance(turns, list) or not turns:
        raise ConversationError("empty conversation")
    messages = []
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict) or role_key not in turn or text_key not in turn:
            raise ConversationError(f"turn {i} needs '{role_key}' and '{text_key}'")
        role = turn[role_key]
        if role not in ROLE_ALIASES:
            raise ConversationError(f"turn {i} has unknown role {role!r}")
        content = turn[text_key]
        if not isinstance(content, str):
            raise ConversationError(f"turn {i} content is {type(content).__name__}, not a string")
        messages.append({"role": ROLE_ALIASES[role], "content": content})
    if require_assistant and not any(m["role"] == "assistant" for m in messages):
        raise ConversationError("no assistant turn")
    return messages


def read_jsonl(path: str | Path) -> Iterator[tuple[int, Any]]:
    """(1-based line number, decoded object) per non-blank line; bad JSON raises with the line."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"data file {p} does not exist")
    with p.open(encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield n, json.loads(line)
            except json.JSONDecodeError as e:
                raise ConversationError(f"{p}:{n}: malformed JSON ({e.msg})") from None


def prompt_messages(messages: list[Message]) -> list[Message]:
    """The conversation up to and including its LAST user turn (what a model answers next)."""
    last_user = max((i for i, m in enumerate(messages) if m["role"] == "user"), default=None)
    if last_user is None:
        raise ConversationError("no user turn to use as a prompt")
    return messages[: last_user + 1]
