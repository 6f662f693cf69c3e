"""The synthetic corpus: deterministic, correct answers, varied lengths, a small vocabulary."""

from __future__ import annotations

import itertools
import re
from collections import Counter

import numpy as np

from dflash_train.data.chat import ChatFormat
from dflash_train.data.formats import parse_conversation, read_conversations
from dflash_train.data.synthetic import (
    WORLD,
    corpus_texts,
    synthetic_conversations,
    write_jsonl,
)


def test_same_seed_same_rows_and_prefix_stable_in_n():
    assert synthetic_conversations(50, seed=3) == synthetic_conversations(50, seed=3)
    assert synthetic_conversations(80, seed=3)[:50] == synthetic_conversations(50, seed=3)
    assert synthetic_conversations(50, seed=3) != synthetic_conversations(50, seed=4)


def test_both_forms_parse_to_the_same_conversations():
    openai = synthetic_conversations(40, seed=0, form="openai")
    sharegpt = synthetic_conversations(40, seed=0, form="sharegpt")
    assert "conversations" in sharegpt[0]
    assert [parse_conversation(r) for r in openai] == [parse_conversation(r) for r in sharegpt]


def test_answers_are_exact_functions_of_their_prompts():
    checked = Counter()
    for row in synthetic_conversations(400, seed=0):
        msgs = row["messages"]
        for user, answer in itertools.pairwise(msgs):
            if user["role"] != "user":
                continue
            p, a = user["content"], answer["content"]
            if m := re.fullmatch(r"(?:Please )?[Cc]ount from (\d+) to (\d+)\.", p):
                lo, hi = int(m[1]), int(m[2])
                assert a == ", ".join(map(str, range(lo, hi + 1))) + "."
                checked["count"] += 1
            elif m := re.fullmatch(r"Sort these numbers from smallest to largest: (.*)", p):
                numbers = sorted(int(x) for x in m[1].split(", "))
                assert a == ", ".join(map(str, numbers)) + "."
                checked["sort"] += 1
            elif m := re.fullmatch(r"Reverse this list: (.*)", p):
                assert a == ", ".join(m[1].split(", ")[::-1]) + "."
                checked["reverse"] += 1
            elif m := re.fullmatch(r"Spell the word (\w+)\.", p):
                assert a == f"The word {m[1]} is spelled {'-'.join(m[1])}."
                checked["spell"] += 1
            elif m := re.fullmatch(r"Tell me about (\w+)\.", p):
                town = next(t for t in WORLD if t.name == m[1])
                assert a.startswith(f"{town.name} is a town on the river {town.river}.")
                checked["town"] += 1
    assert min(checked.values()) >= 3 and len(checked) == 5, checked


def test_world_facts_are_the_same_for_every_seed():
    def facts(seed):
        out = {}
        for row in synthetic_conversations(300, seed=seed):
            msgs = row["messages"]
            for user, answer in itertools.pairwise(msgs):
                if user["content"].startswith("Tell me about"):
                    out[user["content"]] = answer["content"]
        return out

    a, b = facts(0), facts(1)
    shared = a.keys() & b.keys()
    assert shared and all(a[k] == b[k] for k in shared)


def test_rows_mix_system_prompts_multi_turn_and_follow_ups():
    rows = synthetic_conversations(500, seed=0)
    with_system = sum(r["messages"][0]["role"] == "system" for r in rows)
    multi = sum(sum(m["role"] == "user" for m in r["messages"]) > 1 for r in rows)
    follow_ups = sum(
        m["content"].startswith("Now ") or m["content"] == "Say that again."
        for r in rows
        for m in r["messages"]
    )
    assert 0.15 < with_system / 500 < 0.45
    assert 0.15 < multi / 500 < 0.45
    assert follow_ups > 20


def test_token_lengths_spread_from_tens_to_hundreds(make_tokenizer):
    fmt = ChatFormat(make_tokenizer("qwen3"))
    rows = synthetic_conversations(400, seed=2)
    lengths = np.array([len(fmt.encode(r["messages"])[0]) for r in rows])
    assert np.mean(lengths < 64) > 0.1
    assert np.mean((lengths >= 64) & (lengths < 256)) > 0.3
    assert np.mean(lengths >= 256) > 0.05
    supervised = np.array([fmt.encode(r["messages"])[1].sum() for r in rows[:100]])
    assert supervised.min() >= 5


def test_vocabulary_is_small():
    words = Counter()
    for text in corpus_texts(synthetic_conversations(2000, seed=0)):
        words.update(re.findall(r"[A-Za-z]+", text))
    assert len(words) < 400


def test_write_jsonl_round_trips_through_the_reader(tmp_path):
    rows = synthetic_conversations(20, seed=0, form="sharegpt")
    path = write_jsonl(rows, tmp_path / "sub" / "d.jsonl")
    parsed = list(read_conversations([path], require_assistant=True))
    assert [r.messages for r in parsed] == [parse_conversation(r) for r in rows]
