"""Conversations through a chat template: token ids and the assistant-only loss mask.

The loss mask is 1 exactly on the tokens the assistant generates: its content and the
end-of-turn token that closes each of its turns (the model must learn to stop), and 0 on
system / user turns and on everything the template writes around them (headers, the generation
prompt, an injected empty think block, newlines after the end-of-turn token).

How the mask is derived, in character space first, then mapped to tokens:
1. Assistant character spans.
   - Templates with `{% generation %}` markers: the spans the markers enclose, as transformers'
     own template renderer records them.
   - Templates without markers: render the conversation before assistant turn i (R_i) and the
     same with the generation prompt (R_i + header); the turn's content starts after the part of
     the header that the full rendering repeats, and is located there verbatim (or trimmed, for
     templates that trim). Every R_i must be a prefix of the full rendering, else the template is
     not prefix-stable and markers are required.
   - Either way, a span that stops right before the template's end-of-turn token (found once by
     rendering a probe conversation, after the white space the template writes before it) is
     extended over it: "including the end-of-turn token".
2. Tokens: a token is supervised only if its character range lies entirely inside a span. A
   token that straddles a span boundary (e.g. the header's newline merged with a response that
   starts with whitespace) is a token the model never generates after the generation prompt, so
   it stays 0. (transformers' `return_assistant_tokens_mask` marks any overlapping token 1.)
   Assistant content holding a special token's text is tokenised without parsing special tokens
   (its model wrote plain text there); the rest of the text, the template's tokens, as usual.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import json
import re
import warnings
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from dflash_train.data.formats import ConversationError, Message, require_file

_MARKER = re.compile(r"\{%-?\s*generation\s*-?%\}")
_PROBE_CONTENT = "DFLASHPROBE"
THINK_END = "</think>"
"""Ends a reasoning model's think block (Qwen3, DeepSeek-R1 and their kin)."""


@dataclass(frozen=True)
class RenderedChat:
    """A conversation rendered by the chat template, with its supervised character spans."""

    text: str
    spans: list[tuple[int, int]]
    """[start, end) character ranges the assistant generates, in order."""
    answer_ids: tuple[int, ...] = ()
    """Ids the model generated after `text` (its generation prompt), all supervised."""
    context_turns: int = 0
    """Earlier assistant turns the template writes without the reasoning they were generated
    after (Qwen3's drops the think block of a turn before the last user turn): not what the
    model generated after the text before them, so kept as context, not supervised. (Thinking
    off's empty block, dropped alike, holds no reasoning: those turns stay supervised.)"""
    plain_spans: tuple[tuple[int, int], ...] = ()
    """[start, end) of the supervised assistant text that holds a special token's text (an
    answer explaining ChatML writes "<|im_end|>"): tokenised as plain text, as its model wrote it
    (had it generated the special id, its turn would have ended there)."""


def load_chat_template(path: str | Path | None) -> str | None:
    """The Jinja text of a `--chat-template FILE`, or None when no file is given."""
    if path is None:
        return None
    p = Path(path)
    require_file(p, "chat template file")
    text = p.read_text(encoding="utf-8")
    if not text.strip():
        raise ValueError(f"chat template file {p} is empty")
    return text


def _resolve_template(tokenizer: Any, chat_template: str | None) -> str:
    template = chat_template if chat_template is not None else tokenizer.chat_template
    if isinstance(template, dict):
        # Tokenizers may ship several named templates; "default" is what apply_chat_template uses.
        template = template.get("default")
    if not template:
        name = getattr(tokenizer, "name_or_path", "") or "the tokenizer"
        raise ValueError(
            f"{name} has no chat template: pass --chat-template FILE with the Jinja template the "
            "model is served with"
        )
    return template


class ChatFormat:
    """A tokenizer plus the chat template and template switches to render conversations with.

    Resolve it once and reuse it: construction renders a probe conversation to find the
    template's end-of-turn token.
    """

    def __init__(
        self,
        tokenizer: Any,
        *,
        chat_template: str | None = None,
        enable_thinking: bool | None = None,
    ) -> None:
        if not getattr(tokenizer, "is_fast", False):
            raise ValueError(
                "a fast tokenizer (tokenizer.json) is required: loss masks need character offsets"
            )
        self.tokenizer = tokenizer
        self.template = _resolve_template(tokenizer, chat_template)
        self.template_kwargs: dict[str, Any] = {}
        if enable_thinking is not None:
            if "enable_thinking" not in self.template:
                warnings.warn(
                    "enable_thinking has no effect: the chat template does not read it",
                    stacklevel=2,
                )
            self.template_kwargs["enable_thinking"] = enable_thinking
        self.has_generation_markers = bool(_MARKER.search(self.template))
        self._thinking_prompts: dict[bool | None, str] = {}
        specials = [t.content for t in tokenizer.added_tokens_decoder.values() if t.special]
        self._special_text = (
            re.compile("|".join(re.escape(t) for t in sorted(specials, key=len, reverse=True)))
            if specials
            else None
        )
        self.end_of_turn, self._end_of_turn_gap = self._probe_end_of_turn()

    @property
    def mask_method(self) -> str:
        """How assistant spans are found: "generation_markers" or "prefix_diff"."""
        return "generation_markers" if self.has_generation_markers else "prefix_diff"

    @property
    def stop_token_ids(self) -> list[int]:
        """Ids that end an assistant turn in generation: the end-of-turn token and eos."""
        ids: list[int] = []
        for tok in (self.end_of_turn, self.tokenizer.eos_token):
            if tok is not None:
                tid = self.tokenizer.convert_tokens_to_ids(tok)
                if tid is not None and tid not in ids:
                    ids.append(int(tid))
        return ids

    def check_thinking(self, thinking: bool | None, what: str) -> None:
        """Refuse a row generated with another thinking switch than this renders with (`what`:
        how it was generated, e.g. "token_ids were generated"): its generation prompt was not
        this one, and it would train in a chat mode it was not generated in."""
        mine = self.template_kwargs.get("enable_thinking")
        if self._thinking_prompt(thinking) != self._thinking_prompt(mine):
            raise ConversationError(
                f"{what} with thinking {_switch(thinking)}, and this prepares with "
                f"{_switch(mine)}: thinking mode mismatch, the answer would follow another "
                "generation prompt than it was generated after; prepare with the switch "
                "regenerate used (--enable-thinking or --no-enable-thinking)",
                kind="thinking mismatch",
            )

    def _thinking_prompt(self, thinking: bool | None) -> str:
        """A probe question's generation prompt under the thinking switch `thinking` (None:
        the template's default): two switches that give the same prompt are the same mode
        (Qwen3's default is thinking on), whatever they are called."""
        if thinking not in self._thinking_prompts:
            kwargs = {k: v for k, v in self.template_kwargs.items() if k != "enable_thinking"}
            if thinking is not None:
                kwargs["enable_thinking"] = thinking
            self._thinking_prompts[thinking] = self.tokenizer.apply_chat_template(
                [{"role": "user", "content": _PROBE_CONTENT}],
                chat_template=self.template,
                tokenize=False,
                add_generation_prompt=True,
                **kwargs,
            )
        return self._thinking_prompts[thinking]

    # ------------------------------------------------------------------ rendering

    def render_text(self, messages: list[Message], *, add_generation_prompt: bool = False) -> str:
        """The template's text for `messages` (template errors become `ConversationError`)."""
        import jinja2

        try:
            return self.tokenizer.apply_chat_template(
                messages,
                chat_template=self.template,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                **self.template_kwargs,
            )
        except jinja2.TemplateError as e:
            raise ConversationError(
                f"the chat template rejected the conversation: {e}", kind="template error"
            ) from None

    def render(
        self, messages: list[Message], cut: Collection[int] = (), kept: Collection[int] = ()
    ) -> RenderedChat:
        """The full conversation's text and its assistant character spans. `cut`: indices into
        `messages` of assistant turns whose generator stopped at its token limit: their span
        ends with their content, without the end-of-turn token that the template writes after
        it but the model did not generate there. `kept`: assistant turns the model did not
        write (a regenerated row's turns kept from its input): context, no span."""
        context_turns = 0
        if self.has_generation_markers:
            text, owned = self._render_with_markers(messages)
        else:
            text = self.render_text(messages)
            owned, context_turns, inserted = self._spans_by_prefix_diff(messages, text)
            if inserted:
                text, owned = self._as_generated(messages, text, owned)
        owned = [(s, e, turn) for s, e, turn in owned if turn is None or turn not in kept]
        spans = [
            self._without_end_of_turn(text, (s, e))
            if turn in cut
            else self._with_end_of_turn(text, (s, e))
            for s, e, turn in owned
        ]
        plain = self._plain_spans(messages, text, owned)
        return RenderedChat(text, spans, context_turns=context_turns, plain_spans=plain)

    def render_generated(
        self,
        messages: list[Message],
        answer_ids: tuple[int, ...],
        cut: Collection[int] = (),
        thinking: bool | None = None,
        kept: Collection[int] = (),
    ) -> RenderedChat:
        """The conversation as its model generated its last turn: the generation prompt of the
        turns before it (earlier assistant turns supervised as `render` does) and the ids it
        generated, exactly, not the decoded text tokenised again. `thinking`: the switch they
        were generated with; the prompt must be the one they followed, and the ids must decode
        to the turn's text (ids of another tokenizer do not)."""
        # No bound from the tokenizer: a target's embedding may have more rows than its
        # tokenizer has tokens, and the ids are the target's (train checks them against it).
        self.check_thinking(thinking, "token_ids were generated")
        # As regenerate decoded them: the stop token that ended the turn is no part of its text.
        text_ids = list(answer_ids)
        if text_ids and text_ids[-1] in self.stop_token_ids:
            text_ids.pop()
        decoded = self.tokenizer.decode(text_ids, skip_special_tokens=True)
        text = messages[-1]["content"]
        # A turn can end inside a character (cut at its token limit, or a stop token after part
        # of one): decode gives U+FFFD for the bytes it has, a server's streaming detokenizer
        # (vLLM's) holds them back and never writes them.
        if decoded.rstrip("\ufffd") != text.rstrip("\ufffd"):
            raise ConversationError(
                "token_ids do not decode to the last answer's text: ids of another tokenizer, "
                "or an edited answer",
                kind="bad token_ids",
            )
        history = messages[:-1]
        prompt = self.prompt_text(history)
        # The prompt is tokenised as served (`prompt_ids`), special-token text included: the
        # ids followed exactly that.
        before = self.render(history, cut, kept)
        if not prompt.startswith(before.text):
            raise ConversationError(
                "the chat template renders the turns before the answer differently once the "
                "generation prompt follows, so their assistant text cannot be located",
                kind="template error",
            )
        return RenderedChat(prompt, before.spans, tuple(answer_ids), before.context_turns)

    def _render_with_markers(
        self, messages: list[Message]
    ) -> tuple[str, list[tuple[int, int, int | None]]]:
        """The text and each non-empty {% generation %} block's (start, end, message index).
        Blocks belong to the assistant turns in order when there is one per turn; otherwise
        (a template that marks only some turns) to the last turns, the newest last."""
        import jinja2

        # transformers' renderer is what apply_chat_template(return_assistant_tokens_mask=True)
        # uses; calling it directly gives the marked CHARACTER spans, so that one exact
        # containment rule maps spans to tokens for both derivations.
        from transformers.utils.chat_template_utils import render_jinja_template

        kwargs = {**self.tokenizer.special_tokens_map, **self.template_kwargs}
        try:
            rendered, indices = render_jinja_template(
                conversations=[messages],
                chat_template=self.template,
                return_assistant_tokens_mask=True,
                **kwargs,
            )
        except jinja2.TemplateError as e:
            raise ConversationError(
                f"the chat template rejected the conversation: {e}", kind="template error"
            ) from None
        blocks = indices[0]
        turns: list[int | None] = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        owners = ([None] * len(blocks) + turns)[-len(blocks) :] if blocks else []
        spans = [(int(s), int(e), t) for (s, e), t in zip(blocks, owners, strict=True) if e > s]
        if not spans and turns:
            raise ConversationError(
                "the chat template's {% generation %} markers enclose no assistant text",
                kind="template error",
            )
        return rendered[0], spans

    def _spans_by_prefix_diff(
        self, messages: list[Message], text: str
    ) -> tuple[list[tuple[int, int, int | None]], int, bool]:
        """Each assistant turn's (start, end, turn) in `text`, how many earlier turns the
        template wrote otherwise than after their generation prompt (no span: context), and
        whether it did so for the last turn (`_as_generated` puts it after that prompt)."""
        turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        starts = [self._content_search_start(messages, i, text) for i in turns]
        # A turn's content lies before the next assistant turn's own turns begin (the text of
        # the conversation before it): a template that rewrites an earlier turn (Qwen3's drops
        # its think block) must not have it found in a later one that repeats it.
        ends = [before for before, _, _ in starts[1:]] + [len(text)] if turns else []
        spans, context_turns, inserted = [], 0, False
        for i, (before, cursor, header), end in zip(turns, starts, ends, strict=True):
            last = i == len(messages) - 1
            content = messages[i]["content"]
            try:
                start, stop = self._locate_turn(content, text, cursor, header, i, end)
            except ConversationError:
                # A reasoning model's template drops an earlier turn's think block: what it
                # shows was generated after that block, not after this text. Any other rewrite,
                # and one of the conversation's last turn, leave nothing to train on: refused.
                if last or THINK_END not in content:
                    raise
                context_turns += 1
                continue
            # A think block between the turn's header and its content that its generation
            # prompt does not hold (Qwen3's writes an empty one before a last answer cut inside
            # its reasoning), or one the prompt holds and the text not (Qwen3's drops the empty
            # block of thinking off for a turn before the last user turn): the model generated
            # the turn after the prompt, not after this text. The last turn is put after its
            # prompt (`_as_generated`). An earlier one stays supervised where the block is
            # empty: it holds no reasoning the answer followed, and thinking off's multi-turn
            # rows would otherwise train on their last answer alone; one with reasoning is
            # context (as a non-empty think block the template drops, above).
            block = text[cursor:start] + header[cursor - before :]
            if THINK_END in block:
                if last:
                    inserted = True
                elif _reasoning(block):
                    context_turns += 1
                    continue
            spans.append((start, stop, i))
        return spans, context_turns, inserted

    def _locate_turn(
        self, content: str, text: str, cursor: int, header: str, turn: int, end: int
    ) -> tuple[int, int]:
        """The [start, end) of assistant turn `turn`'s content in `text[cursor:end]`, `header`
        the generation prompt's part after the turns before it. Content that starts with the
        think block that prompt ends with (thinking off: some pipelines store it with the
        answer, and Qwen3's template writes it once) is what the model generated after it;
        content with reasoning of its own under such a prompt was generated in another mode."""
        repeated = _prompt_tail(header, content)
        try:
            return _locate_content(text, content[len(repeated) :], cursor, turn, end)
        except ConversationError:
            reasoning = content.split(THINK_END)[0].replace("<think>", "").strip()
            if THINK_END in header and THINK_END in content and reasoning:
                raise ConversationError(
                    f"assistant turn {turn} holds a think block, and its generation prompt "
                    f"(thinking {_switch(self.template_kwargs.get('enable_thinking'))}) "
                    "already holds one: thinking mode mismatch; prepare with the switch the "
                    "answers were generated with (--enable-thinking or --no-enable-thinking)",
                    kind="thinking mismatch",
                ) from None
            raise

    def _as_generated(
        self, messages: list[Message], text: str, owned: list[tuple[int, int, int | None]]
    ) -> tuple[str, list[tuple[int, int, int | None]]]:
        """The conversation with its last answer right after the generation prompt it followed
        (as `render_generated` builds a row from ids), not after the template's rewrite of
        that prompt; the turns before as rendered, and what the template writes after the
        answer (its end-of-turn token) kept."""
        prompt = self.prompt_text(messages[:-1])
        start, stop, turn = owned[-1]
        before = self.render_text(messages[:-1])
        if not prompt.startswith(before):
            raise ConversationError(
                "the chat template renders the turns before the answer differently once the "
                "generation prompt follows, so their assistant text cannot be located",
                kind="template error",
            )
        shift = len(prompt) - start
        return prompt + text[start:], [*owned[:-1], (start + shift, stop + shift, turn)]

    def _content_search_start(
        self, messages: list[Message], i: int, text: str
    ) -> tuple[int, int, str]:
        """(where the turns before assistant turn i end, where its content may start) in the
        full text `text`, and the generation prompt's part after those turns."""
        if i == 0:
            return 0, 0, ""
        before = self.render_text(messages[:i])
        if not text.startswith(before):
            raise ConversationError(
                f"the chat template renders the turns before turn {i} differently once later "
                "turns follow, so assistant text cannot be located; use a template with "
                "{% generation %} markers (--chat-template)",
                kind="template error",
            )
        prompt = self.render_text(messages[:i], add_generation_prompt=True)
        header = prompt[len(before) :] if prompt.startswith(before) else ""
        # The generation prompt may hold more than the turn header (e.g. an empty think block
        # that the template writes only for the newest turn); only the part the full text repeats
        # precedes this turn's content.
        return len(before), len(before) + _common_prefix_len(header, text[len(before) :]), header

    def _with_end_of_turn(self, text: str, span: tuple[int, int]) -> tuple[int, int]:
        """`span` extended over the end-of-turn token the template writes after it (and the
        white space it writes before that token, Llama 2's space)."""
        start, end = span
        if self.end_of_turn is not None:
            closing = self._end_of_turn_gap + self.end_of_turn
            if text.startswith(closing, end):
                end += len(closing)
        return start, end

    def _without_end_of_turn(self, text: str, span: tuple[int, int]) -> tuple[int, int]:
        """`span` ending before an end-of-turn token that closes it (markers may enclose one,
        with only whitespace after it) and the white space the template writes before it."""
        start, end = span
        if self.end_of_turn is not None:
            body = text[start:end].rstrip()
            if body.endswith(self.end_of_turn):
                body = body[: -len(self.end_of_turn)]
                gap = self._end_of_turn_gap
                end = start + len(body) - (len(gap) if gap and body.endswith(gap) else 0)
        return start, end

    def _probe_end_of_turn(self) -> tuple[str | None, str]:
        """The added token the template writes after an assistant's content, if any, and the
        white space it writes between the two (Llama 2's template writes a space)."""
        probe = [
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": _PROBE_CONTENT},
        ]
        try:
            text = self.render_text(probe)
        except ConversationError as e:
            raise ValueError(f"the chat template fails on a minimal conversation: {e}") from None
        at = text.rfind(_PROBE_CONTENT)
        if at < 0:
            raise ValueError("the chat template does not write the assistant's content verbatim")
        rest = text[at + len(_PROBE_CONTENT) :]
        closing = rest.lstrip()
        gap = rest[: len(rest) - len(closing)]
        added = sorted(
            (t.content for t in self.tokenizer.added_tokens_decoder.values()), key=len, reverse=True
        )
        return next((tok for tok in added if closing.startswith(tok)), None), gap

    def _plain_spans(
        self, messages: list[Message], text: str, owned: list[tuple[int, int, int | None]]
    ) -> tuple[tuple[int, int], ...]:
        """The assistant content of `owned` that holds a special token's text (`plain_spans`).
        With markers, the content within its block (the template's own tokens around it stay
        special); content the template rewrites is left as it is."""
        if self._special_text is None:
            return ()
        found = []
        for start, stop, turn in owned:
            if turn is None:
                continue
            if self.has_generation_markers:
                content = messages[turn]["content"]
                try:
                    start, stop = _locate_content(text, content, start, turn, stop)
                except ConversationError:
                    continue
            if self._special_text.search(text, start, stop) is None:
                continue
            if not self._splits_cleanly:
                # Tokenised in pieces, a SentencePiece tokenizer writes a space before each:
                # the special id stays, and a stop token's is left unsupervised.
                return ()
            found.append((start, stop))
        return tuple(found)

    @functools.cached_property
    def _splits_cleanly(self) -> bool:
        """Whether text tokenised in pieces gives the tokens of the whole (byte-level BPEs do;
        SentencePiece ones prefix each piece with a space)."""

        def ids(text: str) -> list[int]:
            return self.tokenizer(text, add_special_tokens=False)["input_ids"]

        return ids("Hi there\nagain") == ids("Hi") + ids(" there") + ids("\nagain")

    # ------------------------------------------------------------------ tokens

    def encode(
        self, messages: list[Message], *, max_length: int | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """(input_ids int32, loss_mask uint8) of one conversation, truncated to max_length."""
        return self.encode_rendered([self.render(messages)], max_length=max_length)[0]

    def encode_rendered(
        self, rendered: list[RenderedChat], *, max_length: int | None = None
    ) -> list[tuple[np.ndarray, np.ndarray]]:
        """Tokenise many rendered conversations in one batched tokenizer call."""
        if not rendered:
            return []
        enc = self.tokenizer(
            [r.text for r in rendered], add_special_tokens=False, return_offsets_mapping=True
        )
        out = []
        for r, ids, offsets in zip(rendered, enc["input_ids"], enc["offset_mapping"], strict=True):
            if r.plain_spans:
                ids, offsets = self._encode_pieces(r.text, r.plain_spans)
            ids_a = np.asarray(ids, dtype=np.int32)
            mask = spans_to_token_mask(np.asarray(offsets, dtype=np.int64).reshape(-1, 2), r.spans)
            if r.answer_ids:
                ids_a = np.concatenate([ids_a, np.asarray(r.answer_ids, dtype=np.int32)])
                mask = np.concatenate([mask, np.ones(len(r.answer_ids), dtype=mask.dtype)])
            _unsupervise_inner_stops(ids_a, mask, self.stop_token_ids)
            if max_length is not None:
                ids_a, mask = ids_a[:max_length], mask[:max_length]
            out.append((ids_a, mask))
        return out

    def _encode_pieces(
        self, text: str, plain: tuple[tuple[int, int], ...]
    ) -> tuple[list[int], list[tuple[int, int]]]:
        """Ids and character offsets of `text`, its `plain` ranges tokenised without parsing
        special tokens, the text between them as usual."""
        bounds = [0, *(x for span in plain for x in span), len(text)]
        ids: list[int] = []
        offsets: list[tuple[int, int]] = []
        for k, (start, end) in enumerate(itertools.pairwise(bounds)):
            if end <= start:
                continue
            enc = self.tokenizer(
                text[start:end],
                add_special_tokens=False,
                return_offsets_mapping=True,
                split_special_tokens=k % 2 == 1,
            )
            ids += enc["input_ids"]
            offsets += [(a + start, b + start) for a, b in enc["offset_mapping"]]
        return ids, offsets

    def prompt_text(self, messages: list[Message]) -> str:
        """The text a model continues to answer `messages` (add_generation_prompt=True)."""
        return self.render_text(messages, add_generation_prompt=True)

    def prompt_ids(self, messages: list[Message]) -> np.ndarray:
        """(n,) int32 token ids of `prompt_text(messages)`. The one prompt encoder: regenerate's
        local back end calls it, and so do the eval prompts (`prompts.encode_prompts`)."""
        ids = self.tokenizer(self.prompt_text(messages), add_special_tokens=False)["input_ids"]
        return np.asarray(ids, dtype=np.int32)


def _reasoning(think: str) -> str:
    """The reasoning a think block holds (empty for thinking off's `<think>\\n\\n</think>`)."""
    return think.split(THINK_END)[0].split("<think>")[-1].strip()


def _unsupervise_inner_stops(ids: np.ndarray, mask: np.ndarray, stop_ids: list[int]) -> None:
    """A stop token (end of turn, eos) inside an answer, not at its end, is left unsupervised,
    in place: its model wrote that text as plain text (a turn ends at a stop token), so the
    drafter must not learn to end a draft there. Tokenised as the special id it is where the
    answer could not be tokenised apart (an earlier turn of a row trained on its ids, whose
    prompt is tokenised as served; a tokenizer that cannot split special-token text off)."""
    inner = np.zeros(len(ids), dtype=bool)
    inner[:-1] = (mask[:-1] == 1) & (mask[1:] == 1) & np.isin(ids[:-1], stop_ids)
    mask[inner] = 0


def tokenizer_digest(fmt: ChatFormat) -> str:
    """Digest of what decides the token ids: vocabulary and merges, special tokens, template.

    Part of every fingerprint that says "same tokens" (prepared datasets, the demo's target)."""
    tok = fmt.tokenizer
    parts = [
        tok.backend_tokenizer.to_str(),
        json.dumps(tok.special_tokens_map, sort_keys=True, default=str),
        fmt.template,
    ]
    return hashlib.sha256("\0".join(parts).encode("utf-8")).hexdigest()


def _common_prefix_len(a: str, b: str) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _prompt_tail(header: str, content: str) -> str:
    """The longest end of a generation prompt `header` holding a think block that `content`
    starts with ('' when none): thinking off's empty think block, stored with the answer."""
    last = header.rfind(THINK_END)
    for at in range(last + 1 if last >= 0 else 0):
        if content.startswith(header[at:]):
            return header[at:]
    return ""


def _locate_content(
    text: str, content: str, cursor: int, turn: int, end: int | None = None
) -> tuple[int, int]:
    """The [start, end) of assistant `content` in `text[cursor:end]`."""
    for candidate in (content, content.strip()):
        if not candidate:
            # Empty content: only the end-of-turn token (added later) is generated.
            return cursor, cursor
        at = text.find(candidate, cursor, len(text) if end is None else end)
        if at >= 0:
            return at, at + len(candidate)
    raise ConversationError(
        f"assistant turn {turn} does not appear in the rendered text (the template rewrites it); "
        "use a template with {% generation %} markers (--chat-template)",
        kind="template error",
    )


def _switch(thinking: bool | None) -> str:
    return "the template's default" if thinking is None else ("on" if thinking else "off")


def spans_to_token_mask(offsets: np.ndarray, spans: list[tuple[int, int]]) -> np.ndarray:
    """uint8 mask over tokens: 1 where the token's characters lie entirely inside a span.

    offsets: (num_tokens, 2) character [start, end) per token. Zero-width tokens (nothing of the
    text) are never supervised.
    """
    starts, ends = offsets[:, 0], offsets[:, 1]
    mask = np.zeros(len(offsets), dtype=bool)
    for s, e in spans:
        mask |= (starts >= s) & (ends <= e)
    mask &= ends > starts
    return mask.astype(np.uint8)
