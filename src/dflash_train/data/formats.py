"""Conversation records from JSON lines: the OpenAI form and the ShareGPT form.

OpenAI:   {"messages": [{"role": "system"|"user"|"assistant", "content": "..."}, ...]}
ShareGPT: {"conversations": [{"from": "system"|"human"|"gpt", "value": "..."}, ...]}
          (turns spelled {"role": ..., "content": ...} inside "conversations" are accepted too)
Prompt-only rows (evaluation, regeneration): {"prompt": "..."}.

Both normalise to a list of `{"role": ..., "content": ...}` dicts with roles system / user /
assistant; other fields are dropped, and for training an assistant turn holding one the chat
template renders (reasoning, tool calls: `TEMPLATE_FIELDS`) is refused. Problems raise
`ConversationError` with the reason and a short `kind` (used to count skipped lines by reason);
readers add the file and line number.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

ROLE_ALIASES = {
    "system": "system",
    "user": "user",
    "human": "user",
    "assistant": "assistant",
    "gpt": "assistant",
    "model": "assistant",
}

Message = dict[str, str]
OnError = Literal["fail", "skip"]


class ConversationError(ValueError):
    """A record that is not a usable conversation.

    `kind` names the reason in a few words (e.g. "unknown role") so that skipped lines can be
    counted by reason; the message says the details.
    """

    def __init__(self, message: str, kind: str = "invalid conversation") -> None:
        super().__init__(message)
        self.kind = kind


# Assistant-message fields a chat template renders and that only `content` stands for here:
# dropped, the row would train on its content alone (its reasoning or tool call missing).
TEMPLATE_FIELDS = {
    "reasoning_content": "reasoning",
    "reasoning": "reasoning",
    "thinking": "reasoning",
    "tool_calls": "tool calls",
    "function_call": "tool calls",
}


def parse_conversation(
    obj: Any, *, require_assistant: bool = True, for_training: bool = False
) -> list[Message]:
    """Normalise one decoded JSON record to a list of messages. `for_training`: an assistant
    turn with a field `TEMPLATE_FIELDS` names is refused (only its content would be trained on;
    prompts and regeneration keep the turns without it)."""
    if not isinstance(obj, dict):
        raise ConversationError(
            f"expected a JSON object, got {type(obj).__name__}", kind="not a JSON object"
        )
    if "messages" in obj:
        turns, role_key, text_key = obj["messages"], "role", "content"
    elif "conversations" in obj:
        turns, role_key, text_key = obj["conversations"], "from", "value"
    elif "prompt" in obj and not require_assistant:
        if not isinstance(obj["prompt"], str):
            raise ConversationError("'prompt' must be a string", kind="non-string content")
        return [{"role": "user", "content": obj["prompt"]}]
    else:
        raise ConversationError(
            "no 'messages' or 'conversations' field", kind="no conversation field"
        )
    if not isinstance(turns, list) or not turns:
        raise ConversationError("empty conversation", kind="empty conversation")
    messages = [_parse_turn(i, turn, role_key, text_key) for i, turn in enumerate(turns)]
    if for_training:
        for i, (turn, message) in enumerate(zip(turns, messages, strict=True)):
            if message["role"] == "assistant":
                _refuse_template_fields(i, turn)
    if require_assistant and not any(m["role"] == "assistant" for m in messages):
        raise ConversationError("no assistant turn", kind="no assistant turn")
    return messages


def _parse_turn(i: int, turn: Any, role_key: str, text_key: str) -> Message:
    # ShareGPT exports sometimes spell turns the OpenAI way; accept either spelling per turn.
    if isinstance(turn, dict) and role_key not in turn and "role" in turn:
        role_key, text_key = "role", "content"
    if not isinstance(turn, dict) or role_key not in turn or text_key not in turn:
        raise ConversationError(f"turn {i} needs '{role_key}' and '{text_key}'", kind="bad turn")
    role = turn[role_key]
    if not isinstance(role, str) or role not in ROLE_ALIASES:
        known = ", ".join(sorted(ROLE_ALIASES))
        raise ConversationError(
            f"turn {i} has unknown role {role!r} (known: {known})", kind="unknown role"
        )
    content = turn[text_key]
    if not isinstance(content, str):
        raise ConversationError(
            f"turn {i} content is {type(content).__name__}, not a string",
            kind="non-string content",
        )
    return {"role": ROLE_ALIASES[role], "content": content}


def _refuse_template_fields(i: int, turn: dict[str, Any]) -> None:
    """One line for an assistant turn that holds a field the template would render (empty
    placeholders, as OpenAI exports write them, are fine)."""
    for name, what in TEMPLATE_FIELDS.items():
        if not turn.get(name):
            continue
        if what == "reasoning":
            fix = (
                "regenerate the rows (regenerate writes the reasoning into the answer), or put "
                "the reasoning into 'content' as the template renders it (e.g. "
                "'<think>\\n...\\n</think>\\n\\n' before the answer)"
            )
        else:
            fix = "tool calls are not supported: drop these rows"
        raise ConversationError(
            f"turn {i} has '{name}', which the chat template renders but prepare would drop "
            f"(it trains on 'content' alone); {fix}",
            kind=f"{what} field",
        )


@dataclass(frozen=True)
class BadLine:
    """One input line that could not be used."""

    path: Path
    line: int
    kind: str
    reason: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.reason}"


def read_jsonl(
    path: str | Path, *, on_bad_line: Callable[[BadLine], None] | None = None
) -> Iterator[tuple[int, Any]]:
    """(1-based line number, decoded object) per non-blank line.

    A malformed line raises `ConversationError` naming the file and line, unless `on_bad_line` is
    given: then it is called with the `BadLine` and reading goes on.
    """
    p = Path(path)
    require_file(p, "data file")
    # Binary lines, decoded one by one, so that a bad byte sequence is reported with its line
    # instead of aborting the whole file.
    with p.open("rb") as f:
        for n, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            try:
                obj = json.loads(raw.decode("utf-8"))
            except UnicodeDecodeError:
                bad = BadLine(p, n, "malformed JSON", "not valid UTF-8")
            except json.JSONDecodeError as e:
                bad = BadLine(p, n, "malformed JSON", f"malformed JSON ({e.msg})")
            else:
                yield n, obj
                continue
            if on_bad_line is None:
                raise ConversationError(str(bad), kind=bad.kind)
            on_bad_line(bad)


@dataclass
class BadLines:
    """The lines skipped under `--on-error skip`, for the end-of-run summary."""

    lines: list[BadLine] = field(default_factory=list)

    def add(self, bad: BadLine) -> None:
        self.lines.append(bad)

    def __len__(self) -> int:
        return len(self.lines)

    def counts(self) -> dict[str, int]:
        """Number of skipped lines per reason, most frequent first."""
        return dict(Counter(b.kind for b in self.lines).most_common())

    def summary(self, limit: int = 10) -> str:
        """A few readable lines: counts by reason, then the first `limit` locations."""
        if not self.lines:
            return "no lines skipped"
        by_kind = ", ".join(f"{n} {kind}" for kind, n in self.counts().items())
        out = [f"skipped {len(self.lines)} line(s): {by_kind}"]
        out += [f"  {b}" for b in self.lines[:limit]]
        if len(self.lines) > limit:
            out.append(f"  ... and {len(self.lines) - limit} more")
        return "\n".join(out)


@dataclass(frozen=True)
class ConversationRow:
    """A parsed conversation and where it came from."""

    path: Path
    line: int
    messages: list[Message]
    cut_turns: frozenset[int] = frozenset()
    """Indices into `messages` of the assistant turns a generator stopped at its token limit
    (`finish_reasons` "length", as `regenerate` writes them): the model never ended them."""
    answer_ids: tuple[int, ...] | None = None
    """The ids the model generated for the last message, an assistant turn (`regenerate`'s
    local back end writes them as `token_ids`); None for text-only rows."""
    kept_turns: frozenset[int] = frozenset()
    """Indices into `messages` of the assistant turns a regenerated row kept from its input
    (`regenerate --turns last`): not the target's answers, so context, not supervised."""
    generated_thinking: bool | None = None
    """With `thinking_recorded`: the enable_thinking switch the row was generated with
    (`regenerated_with.thinking`; None: the template's default)."""
    thinking_recorded: bool = False
    """Whether the row says which switch generated it: it records `regenerated_with.thinking`
    (`regenerate` writes it), or has `answer_ids` (those without it: the template's default).
    Prepared with another switch, it would train in another chat mode than it was generated."""


def cut_turns(obj: dict[str, Any], messages: list[Message]) -> frozenset[int]:
    """The assistant turns of `messages` that `obj`'s `finish_reasons` (one per generated turn,
    the last turns' when fewer than the assistant turns) say stopped at "length"."""
    reasons = obj.get("finish_reasons")
    if reasons is None:
        return frozenset()
    if not isinstance(reasons, list) or not all(isinstance(r, str) for r in reasons):
        raise ConversationError(
            "'finish_reasons' must be a list of strings", kind="bad finish_reasons"
        )
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if len(reasons) > len(turns):
        raise ConversationError(
            f"'finish_reasons' names {len(reasons)} generated turns, the conversation has "
            f"{len(turns)} assistant turns",
            kind="bad finish_reasons",
        )
    generated = turns[len(turns) - len(reasons) :]
    return frozenset(i for i, r in zip(generated, reasons, strict=True) if r == "length")


def kept_turns(obj: dict[str, Any], messages: list[Message]) -> frozenset[int]:
    """The assistant turns of a regenerated row (one with `finish_reasons`, one per generated
    turn, the last turns') that it kept from its input: those before the generated ones."""
    reasons = obj.get("finish_reasons")
    if not isinstance(reasons, list):
        return frozenset()
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    return frozenset(turns[: max(0, len(turns) - len(reasons))])


def generated_thinking(obj: dict[str, Any]) -> bool | None:
    """The enable_thinking switch `regenerate` generated `obj` with (its `--thinking`)."""
    settings = obj.get("regenerated_with")
    thinking = settings.get("thinking") if isinstance(settings, dict) else None
    if thinking not in (None, "on", "off"):
        raise ConversationError(
            f"'regenerated_with' has thinking {thinking!r}, not 'on', 'off' or null",
            kind="bad regenerated_with",
        )
    return None if thinking is None else thinking == "on"


def records_thinking(obj: dict[str, Any]) -> bool:
    """Whether `obj` records the enable_thinking switch it was generated with."""
    settings = obj.get("regenerated_with")
    return isinstance(settings, dict) and "thinking" in settings


def answer_ids(obj: dict[str, Any], messages: list[Message]) -> tuple[int, ...] | None:
    """The last generated turn's ids from `obj`'s `token_ids` (one list per generated turn, as
    `finish_reasons`), when that turn ends the conversation; None when the row has none."""
    ids = obj.get("token_ids")
    if ids is None:
        return None
    if (
        not isinstance(ids, list)
        or not ids
        or not all(isinstance(t, list) for t in ids)
        or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids[-1])
    ):
        raise ConversationError(
            "'token_ids' must be a list of lists of token ids", kind="bad token_ids"
        )
    reasons = obj.get("finish_reasons")
    if isinstance(reasons, list) and len(reasons) != len(ids):
        raise ConversationError(
            f"'token_ids' has {len(ids)} turns, 'finish_reasons' {len(reasons)}",
            kind="bad token_ids",
        )
    if messages[-1]["role"] != "assistant":
        raise ConversationError(
            "'token_ids' given, but the conversation does not end with an assistant turn",
            kind="bad token_ids",
        )
    if not ids[-1]:
        return None  # an empty answer: nothing generated to train on exactly
    return tuple(ids[-1])


def read_conversations(
    paths: Iterable[str | Path],
    *,
    require_assistant: bool,
    on_error: OnError = "fail",
    bad_lines: BadLines | None = None,
    for_training: bool = False,
) -> Iterator[ConversationRow]:
    """Parsed conversations from JSON-lines files, in file then line order.

    With on_error="fail" the first bad line raises `ConversationError` with its file:line and
    reason; with "skip" it is recorded in `bad_lines` (required then) and reading goes on.
    `for_training`: as `parse_conversation`'s.
    """
    if on_error not in ("fail", "skip"):
        raise ValueError(f"on_error must be 'fail' or 'skip', got {on_error!r}")
    if on_error == "skip" and bad_lines is None:
        raise ValueError("on_error='skip' needs a BadLines to record the skipped lines")
    on_bad = bad_lines.add if on_error == "skip" and bad_lines is not None else None
    for path in paths:
        p = Path(path)
        for n, obj in read_jsonl(p, on_bad_line=on_bad):
            try:
                messages = parse_conversation(
                    obj, require_assistant=require_assistant, for_training=for_training
                )
                cut = cut_turns(obj, messages)
                generated = answer_ids(obj, messages)
                thinking = generated_thinking(obj)
            except ConversationError as e:
                bad = BadLine(p, n, e.kind, str(e))
                if on_bad is None:
                    raise ConversationError(str(bad), kind=e.kind) from None
                on_bad(bad)
                continue
            recorded = generated is not None or records_thinking(obj)
            kept = kept_turns(obj, messages)
            yield ConversationRow(p, n, messages, cut, generated, kept, thinking, recorded)


def prompt_messages(messages: list[Message]) -> list[Message]:
    """The conversation up to and including its LAST user turn (what a model answers next)."""
    last_user = max((i for i, m in enumerate(messages) if m["role"] == "user"), default=None)
    if last_user is None:
        raise ConversationError("no user turn to use as a prompt", kind="no user turn")
    return messages[: last_user + 1]


def require_file(path: Path, what: str) -> None:
    """One line when `path` is not a file to read: missing, or a directory."""
    if path.is_dir():
        raise ValueError(f"{what} {path} is a directory, not a file")
    if not path.is_file():
        raise ValueError(f"{what} {path} does not exist")


def file_digest(path: str | Path) -> tuple[str, int]:
    """(sha256 hex digest, number of newline characters) of a file, in one streaming pass."""
    p = Path(path)
    require_file(p, "data file")
    digest = hashlib.sha256()
    lines = 0
    with p.open("rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
            lines += block.count(b"\n")
    return digest.hexdigest(), lines
