"""`dflash-train prepare`: JSON-lines conversations -> a tokenised dataset with loss masks.

read (formats) -> render + tokenise in chunks (chat) -> truncate, filter -> write (dataset).

A row is kept only if it has at least one valid DFlash anchor: two consecutive supervised tokens
(loss_mask[p] and loss_mask[p + 1]) after truncation. The output directory carries a fingerprint
of the inputs (file contents), the tokenizer (its serialised vocabulary, special tokens and chat
template) and the settings: a re-run with the same fingerprint reuses it, a different one is
refused unless --overwrite. (--on-error is not part of the fingerprint: it changes nothing when
no line was skipped, and reusing an output that skipped lines under --on-error fail is refused.)
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import sys
import warnings
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal, TextIO

import numpy as np

from dflash_train.data.chat import ChatFormat, RenderedChat, load_chat_template, tokenizer_digest
from dflash_train.data.dataset import PreparedDataset, write_prepared
from dflash_train.data.formats import (
    BadLine,
    BadLines,
    ConversationError,
    ConversationRow,
    file_digest,
    read_conversations,
)
from dflash_train.data.tokenizer import load_tokenizer
from dflash_train.dataclass_cli import field_docs
from dflash_train.objective import has_valid_anchor
from dflash_train.progress import Progress

# Bump when the way rows are produced changes, so that old outputs are not reused.
PREPARE_VERSION = 5
"""2: an answer its generator cut at a token limit (`finish_reasons` "length") no longer
supervises the end-of-turn token the template writes after it, and a row with the ids its last
answer was generated as (`token_ids`) trains on those, after its generation prompt. 3: an
earlier answer the template writes without its reasoning is kept as context (it was refused).
4: a last answer the template writes after a think block its generation prompt does not hold
(Qwen3's, before an answer cut inside its reasoning) follows that prompt instead; a row with
ids whose text the template rewrites is kept (it was refused); one-turn rows with ids under a
template without generation markers are prepared (prepare stopped). 5: an answer stored with
the empty think block its generation prompt ends with (Qwen3's, thinking off) trains once,
after the prompt (it was refused); special-token text in an answer is tokenised as plain text,
as its model wrote it, and a stop token inside an answer is never supervised; an end-of-turn
token the template writes after white space (Llama 2's) is supervised; a text row that records
its thinking switch is refused under another giving another prompt, and an assistant turn with
reasoning or tool-call fields the template renders is refused (they were dropped); an earlier
answer a regenerated row kept from its input (`--turns last`) is context (it was supervised)."""
CHUNK = 256  # conversations per batched tokenizer call

_NOT_FINGERPRINTED = ("chat_template", "on_error")
DROP_NO_PAIR = "no two consecutive supervised tokens"
DROP_TRUNCATED = "no two consecutive supervised tokens left after truncation"


@dataclass
class PrepareConfig:
    """Settings of one `prepare` run."""

    data: list[str]
    """JSON-lines conversation files, OpenAI (`messages`) or ShareGPT (`conversations`) form."""
    tokenizer: str
    """Directory of the target's tokenizer (Hugging Face format, normally with a chat template)."""
    out: str
    """Output directory of the prepared dataset."""
    max_length: int = 3072
    """Truncate every tokenised conversation to this many tokens."""
    chat_template: str | None = None
    """A Jinja chat template file to use instead of the tokenizer's own."""
    enable_thinking: bool | None = None
    """Pass enable_thinking to the chat template (Qwen3's thinking switch); unset: the
    template's default. A row `regenerate` wrote with another switch is refused."""
    on_error: Literal["fail", "skip"] = "fail"
    """A bad input line: stop with its file:line and reason (fail), or skip it and print a
    summary of skipped lines (skip)."""
    overwrite: bool = False
    """Replace --out when it holds something prepared from other inputs or settings."""

    def __post_init__(self) -> None:
        if not self.data:
            raise ValueError("data: give at least one JSON-lines file")
        if self.max_length < 2:
            raise ValueError(
                f"max_length must be >= 2 (a DFlash anchor pair), got {self.max_length}"
            )
        if self.on_error not in ("fail", "skip"):
            raise ValueError(f"on_error must be 'fail' or 'skip', got {self.on_error!r}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `dflash-train prepare`; help texts and defaults come from PrepareConfig."""
    docs = field_docs(PrepareConfig)
    defaults = {f.name: f.default for f in dataclasses.fields(PrepareConfig)}

    def add(name: str, *flags: str, **kwargs: Any) -> None:
        help_text = docs[name]
        if defaults[name] is not dataclasses.MISSING and defaults[name] is not None:
            kwargs["default"] = defaults[name]
            help_text += f" (default: {defaults[name]})"
        parser.add_argument(*flags, dest=name, help=help_text, **kwargs)

    add("data", "--data", nargs="+", required=True, metavar="FILE")
    add("tokenizer", "--tokenizer", required=True, metavar="DIR")
    add("out", "--out", required=True, metavar="DIR")
    add("max_length", "--max-length", type=int, metavar="N")
    add("chat_template", "--chat-template", metavar="FILE")
    add("enable_thinking", "--enable-thinking", action=argparse.BooleanOptionalAction)
    add("on_error", "--on-error", choices=["fail", "skip"])
    add("overwrite", "--overwrite", action="store_true")


def main(args: argparse.Namespace) -> int:
    names = [f.name for f in dataclasses.fields(PrepareConfig)]
    prepare(PrepareConfig(**{name: getattr(args, name) for name in names}))
    return 0


# ============================================================================ run


@dataclass
class PrepareStats:
    """What happened to the input conversations."""

    conversations: int = 0
    kept: int = 0
    truncated: int = 0
    cut_answers: int = 0
    """Answers their generator stopped at its token limit: no end-of-turn supervised there."""
    answers_from_ids: int = 0
    """Last answers trained on the ids their model generated (rows with `token_ids`)."""
    ids_not_in_text: int = 0
    """Of those, the answers whose text, tokenised again, gives other tokens."""
    context_turns: int = 0
    """Earlier answers the template writes without the reasoning they were generated after:
    kept as context only."""
    kept_answers: int = 0
    """Earlier answers a regenerated row kept from its input (`regenerate --turns last`): not
    the target's, so context only."""
    dropped: Counter[str] = field(default_factory=Counter)

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "dropped": dict(self.dropped)}


def prepare(config: PrepareConfig, *, stream: TextIO | None = None) -> dict[str, Any]:
    """Run `prepare`; returns the dataset summary (also in OUT/summary.json)."""
    out_stream = stream or sys.stdout
    tokenizer = load_tokenizer(config.tokenizer)
    fmt = ChatFormat(
        tokenizer,
        chat_template=load_chat_template(config.chat_template),
        enable_thinking=config.enable_thinking,
    )
    if fmt.end_of_turn is None:
        warnings.warn(
            "the chat template writes no end-of-turn token after an answer (no added token "
            "follows it): no row supervises one, so the drafter does not learn where answers end",
            stacklevel=2,
        )
    inputs = [_describe_input(p) for p in config.data]
    settings = {
        "max_length": config.max_length,
        "enable_thinking": config.enable_thinking,
        "on_error": config.on_error,
        "chat_template": "tokenizer" if config.chat_template is None else config.chat_template,
    }
    fingerprint = _fingerprint(inputs, tokenizer_digest(fmt), settings)
    out = Path(config.out)
    existing = _existing_summary(out)
    if existing is not None and existing.get("fingerprint") == fingerprint:
        skipped = existing.get("skipped_lines", {}).get("count", 0)
        if skipped and config.on_error == "fail":
            raise ValueError(
                f"{out} was prepared with --on-error skip, which skipped {skipped} bad input "
                f"line(s) (see {out / 'summary.json'}); fix them, or pass --on-error skip to "
                "reuse it"
            )
        print(
            f"{out} is up to date (same inputs, tokenizer and settings; fingerprint "
            f"{fingerprint[:12]}): reusing it, {existing['num_rows']} rows",
            file=out_stream,
        )
        return existing
    _check_out_dir(out, existing, inputs, settings, config.overwrite)

    bad_lines = BadLines()
    stats = PrepareStats()
    rows = _prepared_rows(config, fmt, inputs, stats, bad_lines)
    if stats.kept == 0:
        skipped = f"\n{bad_lines.summary()}" if bad_lines else ""
        raise ValueError(f"no usable rows: {_stats_line(stats, bad_lines)}{skipped}")
    extra = {
        "created_by": "dflash-train prepare",
        "prepare_version": PREPARE_VERSION,
        "fingerprint": fingerprint,
        "inputs": inputs,
        "tokenizer": {
            "path": str(Path(config.tokenizer).resolve()),
            "vocab_size": len(tokenizer),
            "eos_token": tokenizer.eos_token,
            "end_of_turn": fmt.end_of_turn,
        },
        "settings": settings,
        "mask_method": fmt.mask_method,
        "stats": stats.as_dict(),
        "skipped_lines": {"count": len(bad_lines), "by_reason": bad_lines.counts()},
    }
    summary = write_prepared(out, rows, extra_summary=extra)
    _report(summary, stats, bad_lines, out, out_stream)
    return summary


def _prepared_rows(
    config: PrepareConfig,
    fmt: ChatFormat,
    inputs: list[dict[str, Any]],
    stats: PrepareStats,
    bad_lines: BadLines,
) -> list[tuple[np.ndarray, np.ndarray]]:
    """Tokenised, truncated, filtered rows, in input order."""
    kept: list[tuple[np.ndarray, np.ndarray]] = []
    # Progress counts input lines: line numbers restart per file, so offset them.
    line_base: dict[Path, int] = {}
    base = 0
    for i in inputs:
        line_base.setdefault(Path(i["path"]), base)
        base += i["lines"]
    conversations = read_conversations(
        config.data,
        require_assistant=True,
        on_error=config.on_error,
        bad_lines=bad_lines,
        for_training=True,
    )
    with Progress(base, "prepare", unit="lines") as progress:
        chunk: list[RenderedChat] = []
        as_text: list[RenderedChat | None] = []  # rows with ids: the text's rendering, to compare
        for row in conversations:
            try:
                if row.answer_ids is None:
                    if row.thinking_recorded:
                        fmt.check_thinking(row.generated_thinking, "the row was regenerated")
                    rendered = fmt.render(row.messages, row.cut_turns, row.kept_turns)
                    text = None
                else:
                    rendered = fmt.render_generated(
                        row.messages,
                        row.answer_ids,
                        row.cut_turns,
                        row.generated_thinking,
                        row.kept_turns,
                    )
                    text = _text_rendering(fmt, row, stats)
                chunk.append(rendered)
                as_text.append(text)
                stats.cut_answers += len(row.cut_turns)
                stats.kept_answers += len(row.kept_turns)
                stats.context_turns += rendered.context_turns
            except ConversationError as e:
                _row_error(config, bad_lines, row.path, row.line, e)
            if len(chunk) == CHUNK:
                kept += _filter(_encode(fmt, chunk, as_text, stats), config.max_length, stats)
                chunk, as_text = [], []
                done = line_base[row.path.resolve()] + row.line
                progress.update(
                    max(0, done - progress.count), kept=stats.kept, skipped=len(bad_lines)
                )
        kept += _filter(_encode(fmt, chunk, as_text, stats), config.max_length, stats)
        progress.update(max(0, base - progress.count), kept=stats.kept, skipped=len(bad_lines))
    return kept


def _text_rendering(
    fmt: ChatFormat, row: ConversationRow, stats: PrepareStats
) -> RenderedChat | None:
    """A row with ids rendered from its text too, only to count whether its tokens would differ
    (`_encode`). A template that rewrites the last answer's text (Qwen3's normalises the
    newlines around `</think>`) leaves it nowhere to be found: counted as differing, and the
    row, built from its ids, is kept."""
    try:
        return fmt.render(row.messages, row.cut_turns, row.kept_turns)
    except ConversationError:
        stats.answers_from_ids += 1
        stats.ids_not_in_text += 1
        return None


def _encode(
    fmt: ChatFormat,
    chunk: list[RenderedChat],
    as_text: list[RenderedChat | None],
    stats: PrepareStats,
) -> list[tuple[np.ndarray, np.ndarray]]:
    """`chunk` tokenised; for each row with generated ids, counts whether its text, tokenised
    again, would have given the last answer other tokens than the model generated."""
    encoded = fmt.encode_rendered(chunk)
    texts = iter(fmt.encode_rendered([t for t in as_text if t is not None]))
    for rendered, text in zip(chunk, as_text, strict=True):
        if text is not None:
            ids, mask = next(texts)
            stats.answers_from_ids += 1
            stats.ids_not_in_text += not np.array_equal(_last_run(ids, mask), rendered.answer_ids)
    return encoded


def _last_run(ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """The ids of the last run of supervised tokens (a row's last answer)."""
    on = np.flatnonzero(mask)
    if not len(on):
        return ids[:0]
    breaks = np.flatnonzero(np.diff(on) > 1)
    start = on[breaks[-1] + 1] if len(breaks) else on[0]
    return ids[start : on[-1] + 1]


def _row_error(
    config: PrepareConfig, bad_lines: BadLines, path: Path, line: int, e: ConversationError
) -> None:
    bad = BadLine(path, line, e.kind, str(e))
    if config.on_error == "fail":
        raise ConversationError(str(bad), kind=e.kind)
    bad_lines.add(bad)


def _filter(
    encoded: list[tuple[np.ndarray, np.ndarray]], max_length: int, stats: PrepareStats
) -> list[tuple[np.ndarray, np.ndarray]]:
    """Truncate to max_length and keep rows with at least one anchor pair."""
    kept = []
    for ids, mask in encoded:
        stats.conversations += 1
        truncated = len(ids) > max_length
        if not has_valid_anchor(mask):
            stats.dropped[DROP_NO_PAIR] += 1
            continue
        if truncated:
            stats.truncated += 1
            ids, mask = ids[:max_length], mask[:max_length]
            if not has_valid_anchor(mask):
                stats.dropped[DROP_TRUNCATED] += 1
                continue
        stats.kept += 1
        kept.append((ids, mask))
    return kept


# ============================================================================ caching


def _describe_input(path: str) -> dict[str, Any]:
    """Path, content digest and line count of one input file."""
    sha256, lines = file_digest(path)
    return {"path": str(Path(path).resolve()), "sha256": sha256, "lines": lines}


def _fingerprint(inputs: list[dict[str, Any]], tokenizer_sha: str, settings: dict) -> str:
    key = {
        "prepare_version": PREPARE_VERSION,
        # Contents, not paths: a moved file is the same input, an edited one is not.
        "inputs": [i["sha256"] for i in inputs],
        "tokenizer": tokenizer_sha,
        # The template's text is in the tokenizer digest; its file name does not matter. Skipping
        # bad lines changes nothing when there are none, so --on-error is checked on reuse.
        "settings": {k: v for k, v in settings.items() if k not in _NOT_FINGERPRINTED},
    }
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode("utf-8")).hexdigest()


def _existing_summary(out: Path) -> dict[str, Any] | None:
    """The summary of a readable prepared dataset at `out`, else None."""
    if not (out / "summary.json").is_file():
        return None
    try:
        return PreparedDataset(out).summary
    except (ValueError, OSError):
        return None


def _was_prepared(out: Path) -> bool:
    """Whether `out` holds what `prepare` wrote, readable or not (its summary.json says so)."""
    try:
        summary = json.loads((out / "summary.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(summary, dict) and summary.get("created_by") == "dflash-train prepare"


def _check_out_dir(
    out: Path,
    existing: dict[str, Any] | None,
    inputs: list[dict[str, Any]],
    settings: dict[str, Any],
    overwrite: bool,
) -> None:
    """Refuse to replace something at `out` that differs, unless told to overwrite."""
    if out.exists() and not out.is_dir():
        raise ValueError(f"output {out} is a file; --out must be a directory")
    if not out.exists() or not any(out.iterdir()):
        return
    if existing is None and not _was_prepared(out):
        # --overwrite replaces a prepared dataset only: given a model's directory (the
        # tokenizer's) or a home directory, it deleted it whole.
        raise ValueError(
            f"output {out} is not empty and holds no prepared dataset; choose another --out "
            "(--overwrite replaces only a dataset prepare wrote)"
        )
    if overwrite:
        return
    if existing is None:
        why = "holds a prepared dataset that cannot be read"
    else:
        why = "was prepared with different " + _differences(existing, inputs, settings)
    raise ValueError(f"output {out} {why}; pass --overwrite to replace it or choose another --out")


def _differences(existing: dict[str, Any], inputs: list[dict], settings: dict) -> str:
    diffs = []
    if existing.get("prepare_version") != PREPARE_VERSION:
        diffs.append(
            f"prepare version ({existing.get('prepare_version')} -> {PREPARE_VERSION}: this "
            "release prepares rows differently)"
        )
    old_inputs = [i.get("sha256") for i in existing.get("inputs", [])]
    if old_inputs != [i["sha256"] for i in inputs]:
        diffs.append("input files")
    old_settings = existing.get("settings", {})
    changed = [
        k for k in settings if k not in _NOT_FINGERPRINTED and old_settings.get(k) != settings[k]
    ]
    if changed:
        shown = ", ".join(f"{k}: {old_settings.get(k)!r} -> {settings[k]!r}" for k in changed)
        diffs.append(f"settings ({shown})")
    return " and ".join(diffs) if diffs else "tokenizer or chat template"


# ============================================================================ report


def _stats_line(stats: PrepareStats, bad_lines: BadLines) -> str:
    dropped = sum(stats.dropped.values())
    parts = [f"{stats.conversations} conversations read", f"{stats.kept} kept"]
    parts.append(f"{dropped} dropped" + (f" ({_reasons(stats.dropped)})" if dropped else ""))
    parts.append(f"{stats.truncated} truncated")
    if stats.cut_answers:
        parts.append(
            f"{stats.cut_answers} answers cut at their generator's token limit (finish_reasons "
            '"length": their end-of-turn token is not supervised)'
        )
    if stats.answers_from_ids:
        parts.append(
            f"{stats.answers_from_ids} last answers trained on their generated ids (the text "
            f"of {stats.ids_not_in_text}, tokenised again, gives other tokens)"
        )
    if stats.kept_answers:
        parts.append(
            f"{stats.kept_answers} earlier answers kept from the input as context, not "
            "supervised (regenerate --turns last did not write them: not the target's answers)"
        )
    if stats.context_turns:
        parts.append(
            f"{stats.context_turns} earlier answers kept as context, not supervised (the chat "
            "template drops the reasoning they were generated after)"
        )
    if bad_lines:
        parts.append(f"{len(bad_lines)} bad lines skipped")
    return ", ".join(parts)


def _reasons(counts: Counter[str]) -> str:
    return "; ".join(f"{n} {reason}" for reason, n in counts.most_common())


def _report(
    summary: dict[str, Any], stats: PrepareStats, bad_lines: BadLines, out: Path, stream: TextIO
) -> None:
    print(_stats_line(stats, bad_lines), file=stream)
    if bad_lines:
        print(bad_lines.summary(), file=stream)
    print(
        f"wrote {out}: {summary['num_rows']} rows, {summary['num_tokens']} tokens, "
        f"{summary['num_supervised_tokens']} supervised ({summary['mask_method']} masks)",
        file=stream,
    )
    hist = ", ".join(f"{k}: {v}" for k, v in summary["length_histogram"].items())
    print(f"lengths (tokens: rows): {hist}", file=stream)
