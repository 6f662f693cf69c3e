"""Prompts for evaluation (`dflash-train eval`, the in-loop `eval/tau`): read from JSON lines,
encoded with the target's chat template; the stop tokens decoding ends on.

Encoding is `ChatFormat.prompt_ids`, the one prompt encoder (regenerate's local back end uses it
too): the conversation rendered with the generation prompt (add_generation_prompt=True), then
tokenised without adding special tokens (the template writes them).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from dflash_train.data.chat import ChatFormat
from dflash_train.data.formats import (
    ConversationError,
    Message,
    parse_conversation,
    prompt_messages,
    read_jsonl,
)


def read_prompts(path: str | Path, limit: int | None = None) -> list[list[Message]]:
    """Prompt conversations (up to and including the last user turn) from a JSON-lines file in
    the OpenAI / ShareGPT / {"prompt": ...} forms; at most `limit`."""
    p = Path(path)
    if p.is_dir():
        raise ValueError(f"prompts file {p} is a directory, not a JSON-lines file")
    if not p.is_file():
        raise ValueError(f"prompts file {p} does not exist")
    prompts = []
    for n, obj in read_jsonl(p):
        try:
            prompts.append(prompt_messages(parse_conversation(obj, require_assistant=False)))
        except ValueError as e:
            raise ValueError(f"{p}:{n}: {e}") from None
        if limit is not None and len(prompts) >= limit:
            break
    if not prompts:
        raise ValueError(f"prompts file {p} holds no prompts")
    return prompts


def encode_prompts(
    tokenizer: Any,
    conversations: list[list[Message]],
    vocab_size: int,
    *,
    enable_thinking: bool | None = None,
) -> list[torch.Tensor]:
    """(n,) int64 ids of each prompt through the tokenizer's chat template, ready for the
    assistant's answer. An id beyond the target's `vocab_size` embedding rows is refused: the
    tokenizer and the target do not belong together."""
    fmt = ChatFormat(tokenizer, enable_thinking=enable_thinking)  # one template set-up for all
    out = []
    for messages in conversations:
        ids = torch.from_numpy(fmt.prompt_ids(messages)).long()
        if ids.numel() and int(ids.max()) >= vocab_size:
            raise ValueError(
                f"the tokenizer produced id {int(ids.max())}, beyond the target's {vocab_size} "
                "embedding rows: tokenizer and target do not belong together"
            )
        out.append(ids)
    return out


def eos_token_ids(target: Any, tokenizer: Any, end_of_turn: list[int] | None = None) -> list[int]:
    """The ids a turn ends at: the target model's generation config eos ids (where a serving
    engine stops it), the tokenizer's eos, and the chat template's end-of-turn token (where
    `prepare` ends an answer's supervision and `regenerate` stops; `end_of_turn`, or found from
    the tokenizer's own template). `eval`, in-loop eval, the reference client's tau, the engine
    check and regenerate's local back end stop on them alike."""
    ids: set[int] = set(_template_stops(tokenizer) if end_of_turn is None else end_of_turn)
    gen_cfg = getattr(target, "generation_config", None)
    for value in (getattr(gen_cfg, "eos_token_id", None), tokenizer.eos_token_id):
        if isinstance(value, int):
            ids.add(value)
        elif value:
            ids.update(int(v) for v in value)
    return sorted(ids)


def _template_stops(tokenizer: Any) -> list[int]:
    """The end-of-turn and eos ids of the tokenizer's own chat template (none without one)."""
    if not getattr(tokenizer, "chat_template", None):
        return []
    try:
        return ChatFormat(tokenizer).stop_token_ids
    except (ValueError, ConversationError):
        return []
