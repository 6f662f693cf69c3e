"""`dflash-train prepare` end to end: the real CLI on synthetic conversations."""

from __future__ import annotations

import json

import numpy as np
import pytest

from dflash_train.cli import main as cli
from dflash_train.data.chat import ChatFormat
from dflash_train.data.dataset import PreparedDataset
from dflash_train.data.formats import parse_conversation
from dflash_train.data.prepare import PREPARE_VERSION
from dflash_train.data.synthetic import corpus_texts, synthetic_conversations, write_jsonl
from dflash_train.data.tokenizer import build_chat_tokenizer


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    """(with generation markers, without) qwen3-style tokenizer directories."""
    texts = list(corpus_texts(synthetic_conversations(300, seed=9)))
    root = tmp_path_factory.mktemp("tokenizers")
    for markers in (True, False):
        build_chat_tokenizer(
            texts, root / f"m{int(markers)}", vocab_size=600, generation_markers=markers
        )
    return root / "m1", root / "m0"


@pytest.fixture
def data(tmp_path):
    """Two input files: 60 OpenAI-form and 40 ShareGPT-form conversations."""
    a = write_jsonl(synthetic_conversations(60, seed=0), tmp_path / "a.jsonl")
    b = write_jsonl(synthetic_conversations(40, seed=1, form="sharegpt"), tmp_path / "b.jsonl")
    return [a, b]


def prepare(data, tokenizer, out, *extra):
    files = [str(p) for p in data]
    return cli(
        [
            "prepare",
            "--data",
            *files,
            "--tokenizer",
            str(tokenizer),
            "--out",
            str(out),
            *map(str, extra),
        ]
    )


def test_prepared_rows_are_the_chat_template_tokens_and_masks(data, tokenizers, tmp_path, capsys):
    from transformers import AutoTokenizer

    assert prepare(data, tokenizers[0], tmp_path / "ds", "--max-length", 300) == 0
    ds = PreparedDataset(tmp_path / "ds")
    fmt = ChatFormat(AutoTokenizer.from_pretrained(tokenizers[0]))
    rows = [json.loads(line) for p in data for line in p.read_text().splitlines()]
    assert len(ds) == len(rows) == 100
    for i, row in enumerate(rows):
        ids, mask = fmt.encode(parse_conversation(row), max_length=300)
        got_ids, got_mask = ds.row(i)
        assert np.array_equal(got_ids, ids) and np.array_equal(got_mask, mask)
    s = ds.summary
    assert s["num_rows"] == 100 and s["num_supervised_tokens"] == int(ds.loss_mask.sum())
    assert sum(s["length_histogram"].values()) == 100
    assert s["settings"]["max_length"] == 300 and s["mask_method"] == "generation_markers"
    assert s["stats"]["kept"] == 100 and s["stats"]["truncated"] > 0
    assert [i["lines"] for i in s["inputs"]] == [60, 40]
    out = capsys.readouterr().out
    assert "100 kept" in out and "truncated" in out and "supervised" in out


def test_templates_with_and_without_markers_give_the_same_dataset(data, tokenizers, tmp_path):
    assert prepare(data, tokenizers[0], tmp_path / "marked") == 0
    assert prepare(data, tokenizers[1], tmp_path / "plain") == 0
    marked, plain = PreparedDataset(tmp_path / "marked"), PreparedDataset(tmp_path / "plain")
    assert plain.summary["mask_method"] == "prefix_diff"
    assert np.array_equal(marked.input_ids, plain.input_ids)
    assert np.array_equal(marked.loss_mask, plain.loss_mask)


def test_same_inputs_and_settings_reuse_the_output(data, tokenizers, tmp_path, capsys):
    out = tmp_path / "ds"
    assert prepare(data, tokenizers[0], out) == 0
    stamp = (out / "input_ids.npy").stat().st_mtime_ns
    capsys.readouterr()
    assert prepare(data, tokenizers[0], out) == 0
    assert "up to date" in capsys.readouterr().out
    assert (out / "input_ids.npy").stat().st_mtime_ns == stamp


def test_different_settings_are_refused_unless_overwrite(data, tokenizers, tmp_path, capsys):
    out = tmp_path / "ds"
    assert prepare(data, tokenizers[0], out) == 0
    assert prepare(data, tokenizers[0], out, "--max-length", 64) == 2
    err = capsys.readouterr().err
    assert "max_length: 3072 -> 64" in err and "--overwrite" in err
    assert prepare(data, tokenizers[0], out, "--max-length", 64, "--overwrite") == 0
    assert PreparedDataset(out).summary["max_length"] <= 64


def test_changed_input_content_is_refused(data, tokenizers, tmp_path, capsys):
    out = tmp_path / "ds"
    assert prepare(data, tokenizers[0], out) == 0
    write_jsonl(synthetic_conversations(60, seed=5), data[0])
    assert prepare(data, tokenizers[0], out) == 2
    assert "different input files" in capsys.readouterr().err


def test_a_directory_that_is_not_a_dataset_is_refused_even_with_overwrite(
    data, tokenizers, tmp_path, capsys
):
    """Regression: --overwrite replaced any directory, the tokenizer's model directory given as
    --out included (deleted whole)."""
    out = tmp_path / "ds"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    assert prepare(data, tokenizers[0], out) == 2
    assert "not empty and holds no prepared dataset" in capsys.readouterr().err
    assert prepare(data, tokenizers[0], out, "--overwrite") == 2
    assert prepare(data, tokenizers[1], tokenizers[1], "--overwrite") == 2  # the model's own
    assert capsys.readouterr().err.count("holds no prepared dataset") == 2
    assert (out / "notes.txt").exists() and (tokenizers[1] / "tokenizer.json").exists()
    assert prepare(data, tokenizers[0], tmp_path / "ds2") == 0  # a dataset: --overwrite replaces
    assert prepare(data[:1], tokenizers[0], tmp_path / "ds2", "--overwrite") == 0


def test_truncation_and_dropped_rows_are_counted_by_reason(tokenizers, tmp_path, capsys):
    def conv(answer, prompt="Count."):
        return {
            "messages": [
                {"role": "user", "content": prompt},
                {"role": "assistant", "content": answer},
            ]
        }

    rows = [
        conv("1, 2, 3, 4, 5."),
        conv(""),  # only the end-of-turn token is supervised: no anchor pair
        conv("1, 2.", prompt=" ".join(["red"] * 80)),  # the answer is cut off entirely
        conv(", ".join(map(str, range(100)))),  # truncated but keeps supervised tokens
    ]
    path = write_jsonl(rows, tmp_path / "d.jsonl")
    assert prepare([path], tokenizers[0], tmp_path / "ds", "--max-length", 40) == 0
    stats = PreparedDataset(tmp_path / "ds").summary["stats"]
    assert stats["kept"] == 2 and stats["truncated"] == 2
    assert stats["dropped"] == {
        "no two consecutive supervised tokens": 1,
        "no two consecutive supervised tokens left after truncation": 1,
    }
    assert "2 dropped" in capsys.readouterr().out


def test_a_cut_answer_supervises_its_content_but_not_the_end_of_turn(tokenizers, tmp_path, capsys):
    # Rows as `regenerate` writes them: an answer that stopped at --max-new-tokens ("length")
    # ends where the generator stopped; the template's end-of-turn after it is not the model's.
    row = {
        "messages": [
            {"role": "user", "content": "Count."},
            {"role": "assistant", "content": "1, 2, 3, 4, 5."},
        ]
    }
    rows = [{**row, "finish_reasons": ["stop"]}, {**row, "finish_reasons": ["length"]}, row]
    path = write_jsonl(rows, tmp_path / "d.jsonl")
    assert prepare([path], tokenizers[0], tmp_path / "ds") == 0
    out = capsys.readouterr().out
    assert "1 answers cut at their generator's token limit" in out
    ds = PreparedDataset(tmp_path / "ds")
    assert ds.summary["stats"]["cut_answers"] == 1
    (stop_ids, stop_mask), (cut_ids, cut_mask), (_, plain_mask) = (ds.row(i) for i in range(3))
    assert np.array_equal(stop_ids, cut_ids) and np.array_equal(stop_mask, plain_mask)
    only_stop = np.flatnonzero(stop_mask.astype(bool) & ~cut_mask.astype(bool))
    assert only_stop.tolist() == [int(np.flatnonzero(stop_mask)[-1])]  # the last: end-of-turn
    from transformers import AutoTokenizer

    eot = ds.summary["tokenizer"]["end_of_turn"]
    assert int(stop_ids[only_stop[0]]) == AutoTokenizer.from_pretrained(
        tokenizers[0]
    ).convert_tokens_to_ids(eot)


@pytest.mark.parametrize("markers", [0, 1])
def test_answers_a_regenerated_row_kept_from_its_input_are_context(
    tokenizers, tmp_path, capsys, markers
):
    """Regression: a row `regenerate --turns last` wrote (one finish reason, two answers)
    supervised its first answer, the input's own (another model's), as if the target's."""
    messages = [
        {"role": "user", "content": "Count."},
        {"role": "assistant", "content": "one two three"},
        {"role": "user", "content": "Again."},
        {"role": "assistant", "content": "1, 2, 3."},
    ]
    rows = [{"messages": messages, "finish_reasons": ["stop"]}, {"messages": messages}]
    path = write_jsonl(rows, tmp_path / "d.jsonl")
    tokenizer = tokenizers[1 - markers]
    assert prepare([path], tokenizer, tmp_path / "ds") == 0
    assert "1 earlier answers kept from the input as context" in capsys.readouterr().out
    ds = PreparedDataset(tmp_path / "ds")
    assert ds.summary["stats"]["kept_answers"] == 1
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer)
    (ids, regenerated), (same, plain) = ds.row(0), ds.row(1)
    assert np.array_equal(ids, same)
    assert tok.decode(ids[regenerated == 1].tolist()).startswith("1, 2, 3.")
    assert "one two three" in tok.decode(same[plain == 1].tolist())  # not regenerated: as before


def test_a_dataset_of_an_older_prepare_version_says_so(data, tokenizers, tmp_path, capsys):
    out = tmp_path / "ds"
    assert prepare(data, tokenizers[0], out) == 0
    summary = json.loads((out / "summary.json").read_text())
    # What an older release wrote: its version, and so another fingerprint.
    old = {**summary, "prepare_version": 1, "fingerprint": "0" * 64}
    (out / "summary.json").write_text(json.dumps(old))
    assert prepare(data, tokenizers[0], out) == 2
    err = capsys.readouterr().err
    assert f"prepare version (1 -> {PREPARE_VERSION}" in err and "--overwrite" in err


QUESTION = {"role": "user", "content": "Count from 1 to 3."}
ANSWER = {"role": "assistant", "content": "1, 2, 3."}
ANSWERED = {"messages": [QUESTION, ANSWER]}

# kind -> (line, what the error message must say)
BAD_LINES = {
    "malformed JSON": ('{"messages": [', "malformed JSON"),
    "unknown role": ('{"messages": [{"role": "robot", "content": "x"}]}', "unknown role 'robot'"),
    "empty conversation": ('{"conversations": []}', "empty conversation"),
    "no assistant turn": ('{"messages": [{"role": "user", "content": "x"}]}', "no assistant turn"),
    "non-string content": (
        '{"messages": [{"role": "user", "content": {"text": "x"}}]}',
        "content is dict, not a string",
    ),
    # Regressions: these three were prepared, training silently on what the model did not
    # generate (in another chat mode; without the reasoning or tool call the template renders).
    "thinking mismatch": (
        json.dumps({**ANSWERED, "regenerated_with": {"thinking": "off"}}),
        "the row was regenerated with thinking off, and this prepares with the template's "
        "default: thinking mode mismatch",
    ),
    "reasoning field": (
        json.dumps({"messages": [QUESTION, {**ANSWER, "reasoning_content": "Because."}]}),
        "turn 1 has 'reasoning_content', which the chat template renders but prepare would drop",
    ),
    "tool calls field": (
        json.dumps({"messages": [QUESTION, {**ANSWER, "content": "", "tool_calls": [{}]}]}),
        "turn 1 has 'tool_calls'",
    ),
}


@pytest.mark.parametrize("kind", list(BAD_LINES))
def test_a_bad_line_fails_with_its_file_line_and_reason(kind, tokenizers, tmp_path, capsys):
    good = json.dumps(synthetic_conversations(1)[0])
    line, reason = BAD_LINES[kind]
    path = tmp_path / "d.jsonl"
    path.write_text(f"{good}\n{good}\n{line}\n{good}\n")
    assert prepare([path], tokenizers[0], tmp_path / "ds") == 2
    err = capsys.readouterr().err
    assert "d.jsonl:3: " in err and reason in err
    assert not (tmp_path / "ds").exists()


def test_skip_mode_keeps_the_good_rows_and_summarises_the_bad_ones(tokenizers, tmp_path, capsys):
    good = [json.dumps(r) for r in synthetic_conversations(5)]
    path = tmp_path / "d.jsonl"
    bad = [line for line, _ in BAD_LINES.values()]
    path.write_text("\n".join([good[0], *bad, *good[1:]]) + "\n")
    assert prepare([path], tokenizers[0], tmp_path / "ds", "--on-error", "skip") == 0
    out = capsys.readouterr().out
    assert f"skipped {len(bad)} line(s)" in out
    for n in range(2, 2 + len(bad)):
        assert f"d.jsonl:{n}:" in out
    summary = PreparedDataset(tmp_path / "ds").summary
    assert summary["num_rows"] == 5 and summary["skipped_lines"]["count"] == len(bad)
    assert summary["skipped_lines"]["by_reason"] == dict.fromkeys(BAD_LINES, 1)


def test_a_regenerated_text_row_prepares_with_the_switch_it_was_generated_with(
    tokenizers, tmp_path, capsys
):
    """Regression: only rows with token_ids were checked; a text row regenerate wrote with
    --thinking off trained in the template's default mode, without the empty think block its
    prompt had (and summary.json said "default", so eval encoded that way too)."""
    from transformers import AutoTokenizer

    row = {**ANSWERED, "regenerated_with": {"thinking": "off"}}
    data = write_jsonl([row], tmp_path / "regen.jsonl")
    assert prepare([data], tokenizers[1], tmp_path / "on", "--enable-thinking") == 2
    assert "regen.jsonl:1: the row was regenerated with thinking off" in capsys.readouterr().err
    assert prepare([data], tokenizers[1], tmp_path / "off", "--no-enable-thinking") == 0
    fmt = ChatFormat(AutoTokenizer.from_pretrained(tokenizers[1]), enable_thinking=False)
    ids, mask = PreparedDataset(tmp_path / "off").row(0)
    prompt = fmt.prompt_ids([QUESTION])
    assert ids[: len(prompt)].tolist() == prompt.tolist()
    assert not mask[: len(prompt)].any() and mask[len(prompt)] == 1


def test_tokenizer_without_chat_template_needs_the_flag(data, tokenizers, tmp_path, capsys):
    import shutil

    bare = tmp_path / "bare"
    shutil.copytree(tokenizers[0], bare)
    (bare / "chat_template.jinja").unlink()
    assert prepare(data, bare, tmp_path / "ds") == 2
    assert "no chat template" in capsys.readouterr().err
    template = tmp_path / "template.jinja"
    template.write_text((tokenizers[0] / "chat_template.jinja").read_text())
    assert prepare(data, bare, tmp_path / "ds", "--chat-template", template) == 0
    assert prepare(data, tokenizers[0], tmp_path / "ref") == 0
    ref, got = PreparedDataset(tmp_path / "ref"), PreparedDataset(tmp_path / "ds")
    assert np.array_equal(ref.input_ids, got.input_ids)


def test_a_template_without_an_end_of_turn_token_is_said_once(data, tokenizers, tmp_path):
    """Regression: a template that writes none after an answer (or one after white space, which
    the probe did not see) trained drafters that never learn where answers end, silently."""
    template = tmp_path / "plain.jinja"
    template.write_text(
        "{% for m in messages %}{{ m.role + ': ' + m.content + '\\n' }}{% endfor %}"
        "{% if add_generation_prompt %}assistant: {% endif %}"
    )
    with pytest.warns(UserWarning, match="writes no end-of-turn token") as caught:
        assert prepare(data, tokenizers[0], tmp_path / "ds", "--chat-template", template) == 0
    assert len([w for w in caught if "end-of-turn" in str(w.message)]) == 1


def test_enable_thinking_changes_the_tokens_and_the_fingerprint(data, tokenizers, tmp_path):
    assert prepare(data, tokenizers[0], tmp_path / "on") == 0
    assert prepare(data, tokenizers[0], tmp_path / "off", "--no-enable-thinking") == 0
    on, off = PreparedDataset(tmp_path / "on"), PreparedDataset(tmp_path / "off")
    assert off.summary["settings"]["enable_thinking"] is False
    assert off.summary["fingerprint"] != on.summary["fingerprint"]
    # The empty think block is template text: more tokens, the same supervised count.
    assert off.summary["num_tokens"] > on.summary["num_tokens"]
    assert off.summary["num_supervised_tokens"] == on.summary["num_supervised_tokens"]


def test_no_usable_rows_is_an_error(tokenizers, tmp_path, capsys):
    path = write_jsonl(
        [{"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": ""}]}],
        tmp_path / "d.jsonl",
    )
    assert prepare([path], tokenizers[0], tmp_path / "ds") == 2
    assert "no usable rows" in capsys.readouterr().err


def test_missing_inputs_are_clear_errors(data, tokenizers, tmp_path, capsys):
    assert prepare([tmp_path / "nope.jsonl"], tokenizers[0], tmp_path / "ds") == 2
    assert "nope.jsonl does not exist" in capsys.readouterr().err
    assert prepare(data, tmp_path / "no_tokenizer", tmp_path / "ds") == 2
    assert "tokenizer directory" in capsys.readouterr().err


def test_on_error_alone_does_not_invalidate_the_cache_unless_lines_were_skipped(
    data, tokenizers, tmp_path, capsys
):
    clean = tmp_path / "clean"
    assert prepare(data, tokenizers[0], clean) == 0
    assert prepare(data, tokenizers[0], clean, "--on-error", "skip") == 0
    assert "up to date" in capsys.readouterr().out
    dirty = tmp_path / "d.jsonl"
    dirty.write_text(data[0].read_text() + "{broken\n")
    assert prepare([dirty], tokenizers[0], tmp_path / "ds", "--on-error", "skip") == 0
    # Reusing it under --on-error fail would hide the bad line that fail must report.
    assert prepare([dirty], tokenizers[0], tmp_path / "ds") == 2
    assert "skipped 1 bad input line(s)" in capsys.readouterr().err


def test_out_that_is_a_file_is_refused(data, tokenizers, tmp_path, capsys):
    (tmp_path / "ds").write_text("x")
    assert prepare(data, tokenizers[0], tmp_path / "ds", "--overwrite") == 2
    assert "must be a directory" in capsys.readouterr().err


def test_multi_turn_thinking_rows_keep_earlier_answers_as_context(tokenizers, tmp_path, capsys):
    # A template like Qwen3's writes an answer before the last user turn without its think
    # block: such rows were refused; now the earlier answer is context, the last one supervised.
    template = tmp_path / "history_without_think.jinja"
    template.write_text(
        "{% for m in messages %}<|im_start|>{{ m.role }}\n"
        "{% if m.role == 'assistant' and not loop.last %}{{ m.content.split('</think>')[-1] }}"
        "{% else %}{{ m.content }}{% endif %}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    rows = [
        {
            "messages": [
                {"role": "user", "content": f"question {i}"},
                {"role": "assistant", "content": f"<think>first {i}</think>one {i}"},
                {"role": "user", "content": "and then?"},
                {"role": "assistant", "content": f"<think>second {i}</think>two {i}"},
            ]
        }
        for i in range(5)
    ]
    data = write_jsonl(rows, tmp_path / "in.jsonl")
    out = tmp_path / "ds"
    assert prepare([data], tokenizers[1], out, "--chat-template", template) == 0
    said = capsys.readouterr().out
    ds = PreparedDataset(out)
    assert len(ds) == 5 and ds.summary["stats"]["context_turns"] == 5
    assert "5 earlier answers kept as context, not supervised" in said
    from transformers import AutoTokenizer

    ids, mask = ds.row(0)
    supervised = AutoTokenizer.from_pretrained(tokenizers[1]).decode(
        ids[mask.astype(bool)].tolist()
    )
    assert supervised == "<think>second 0</think>two 0<|im_end|>"


def test_rows_with_ids_train_on_them_whatever_the_template_makes_of_their_text(
    tokenizers, tmp_path, capsys
):
    """Regressions, templates without {% generation %} markers (Qwen3's and Llama 3's own):
    a one-turn row with ids (regenerate on a prompt dataset) stopped prepare with a bare
    ValueError, even with --on-error skip; and a row whose answer the template rewrites
    (Qwen3's normalises the newlines around </think>) was refused, though its ids were what
    it trains on: the text's rendering only counts `ids_not_in_text`."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizers[1])
    template = tmp_path / "rewrites.jinja"  # the answer's spaces normalised (Qwen3: newlines)
    template.write_text(
        "{%- for m in messages %}{{- '<|im_start|>' + m.role + '\\n' }}"
        "{%- if m.role == 'assistant' %}{{- m.content | replace('  ', ' ') }}"
        "{%- else %}{{- m.content }}"
        "{%- endif %}{{- '<|im_end|>\\n' }}{%- endfor %}"
        "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
    )
    stop = tok.convert_tokens_to_ids("<|im_end|>")
    rows = []
    for answer in ("abc", "a  bc"):  # the second is not in the template's text
        ids = [*tok.encode(answer, add_special_tokens=False), stop]
        rows.append(
            {
                "messages": [
                    {"role": "user", "content": "Count from 1 to 3."},
                    {"role": "assistant", "content": answer},
                ],
                "finish_reasons": ["stop"],
                "token_ids": [ids],
            }
        )
    data = tmp_path / "generated.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    argv = ["--chat-template", template, "--on-error", "fail"]
    assert prepare([data], tokenizers[1], tmp_path / "ds", *argv) == 0
    ds = PreparedDataset(tmp_path / "ds")
    fmt = ChatFormat(tok, chat_template=template.read_text())
    prompt = fmt.prompt_ids(rows[0]["messages"][:1])
    for i, row in enumerate(rows):
        ids, mask = ds.row(i)
        assert ids.tolist() == [*prompt.tolist(), *row["token_ids"][0]]
        assert mask[len(prompt) :].all() and not mask[: len(prompt)].any()
    stats = ds.summary["stats"]
    assert (stats["answers_from_ids"], stats["ids_not_in_text"]) == (2, 1)
    capsys.readouterr()
