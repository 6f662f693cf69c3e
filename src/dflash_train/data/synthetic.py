"""A built-in synthetic conversation corpus: deterministic, seedable, no third-party data.

It feeds tests and the demo, where a tiny target is trained on it for a few minutes and a drafter
is then trained against that target. So every response is a long-ish, exactly predictable
function of its prompt (counting ranges, multiplication tables, spelling, repeating, reversing
and sorting short lists, letter ranges, templated facts about a small fixed fictional world),
responses span roughly 20 to 400 tokens (so length buckets matter), the vocabulary stays small
(digits, lower-case letters and a few hundred words), some rows have a system prompt and some
are multi-turn (a follow-up that transforms the previous answer, or a fresh task).

Prompts are phrased in a few ways; the answer to a given request is always written the same way,
which is what lets a tiny model learn it nearly deterministically. The fictional world is the
same for every seed, so held-out prompts (another seed) ask about facts the target has seen.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

Form = Literal["openai", "sharegpt"]

_WORD_TEXT = (
    "apple river stone cloud green table window garden bread water light music paper "
    "orange silver forest candle winter summer pencil rabbit tiger horse mountain valley "
    "ocean island bridge castle tower market village road wagon basket lemon cherry "
    "button mirror ladder rocket planet comet sun moon star bird fish whale turtle "
    "spoon plate glass chair door floor roof wall clock bell drum flute violin piano "
    "garlic onion carrot potato tomato pepper honey sugar salt butter cheese milk "
    "copper iron gold wood sand snow rain wind storm thunder shadow circle square "
    "yellow purple brown black white blue red pink gray happy quiet bright quick slow"
)
WORDS = tuple(_WORD_TEXT.split())

SYSTEM_PROMPTS = (
    "You are a helpful assistant.",
    "You are a careful assistant. Answer exactly what is asked.",
    "Answer the request.",
    "You are the demo assistant of a small model.",
)

LETTERS = "abcdefghijklmnopqrstuvwxyz"


@dataclass(frozen=True)
class Town:
    """One town of the fixed fictional world."""

    name: str
    river: str
    founded: int
    flag: str
    animal: str
    population: int
    neighbour: str
    trade: str


def _build_world() -> tuple[Town, ...]:
    # A fixed seed, independent of the caller's: facts must agree across seeds and runs.
    rng = random.Random(20240611)
    first = ["Var", "Lin", "Mor", "Tal", "Bren", "Cal", "Dor", "Fen", "Gal", "Hol", "Ost", "Pel"]
    second = ["holt", "mere", "wick", "dale", "ford", "stead", "bury", "moor"]
    names = sorted({a + b for a in first for b in second})
    names = rng.sample(names, 24)
    rivers = ["Lum", "Sarn", "Edda", "Morva", "Tessel", "Quill", "Ardent", "Pell"]
    flags = ["green", "red", "blue", "yellow", "white", "black", "purple", "orange"]
    animals = ["heron", "fox", "otter", "owl", "stag", "badger", "swan", "wolf", "hare", "crow"]
    trades = ["wool", "salt", "copper", "cheese", "glass", "timber", "honey", "bread", "iron"]
    towns = []
    for i, name in enumerate(names):
        towns.append(
            Town(
                name=name,
                river=rng.choice(rivers),
                founded=rng.randint(1100, 1900),
                flag=rng.choice(flags),
                animal=rng.choice(animals),
                population=rng.randint(2, 90) * 1000,
                neighbour=names[(i + 1 + rng.randrange(len(names) - 1)) % len(names)],
                trade=rng.choice(trades),
            )
        )
    return tuple(towns)


WORLD = _build_world()


@dataclass(frozen=True)
class Exchange:
    """A request and its answer; `items` is the answer as a list when it is one (follow-ups
    such as "now reverse it" transform it)."""

    prompt: str
    answer: str
    items: tuple[str, ...] | None = None


def _join(items: Iterable[Any]) -> str:
    return ", ".join(str(x) for x in items) + "."


def _listing(items: list[Any], prompt: str) -> Exchange:
    return Exchange(prompt, _join(items), tuple(str(x) for x in items))


# ---------------------------------------------------------------------------- tasks


def _count_up(rng: random.Random) -> Exchange:
    a = rng.randint(0, 300)
    b = a + rng.choice([rng.randint(4, 20), rng.randint(20, 90)])
    phrase = rng.choice(["Count from {a} to {b}.", "Please count from {a} to {b}."])
    return _listing(list(range(a, b + 1)), phrase.format(a=a, b=b))


def _count_down(rng: random.Random) -> Exchange:
    a = rng.randint(0, 200)
    b = a + rng.randint(4, 60)
    phrase = rng.choice(["Count down from {b} to {a}.", "Count backwards from {b} to {a}."])
    return _listing(list(range(b, a - 1, -1)), phrase.format(a=a, b=b))


def _count_step(rng: random.Random) -> Exchange:
    step = rng.choice([2, 3, 5, 10])
    a = rng.randint(0, 100)
    b = a + step * rng.randint(4, 40)
    prompt = f"Count from {a} to {b} in steps of {step}."
    return _listing(list(range(a, b + 1, step)), prompt)


def _times_table(rng: random.Random) -> Exchange:
    n = rng.randint(2, 19)
    m = rng.choice([5, 10, 12])
    phrase = rng.choice(
        ["Write the multiplication table of {n} up to {m}.", "Show the {n} times table up to {m}."]
    )
    lines = [f"{n} x {i} = {n * i}" for i in range(1, m + 1)]
    return Exchange(phrase.format(n=n, m=m), "\n".join(lines), tuple(lines))


def _spell(rng: random.Random) -> Exchange:
    word = rng.choice(WORDS)
    phrase = rng.choice(["Spell the word {w}.", "How do you spell {w}?"])
    answer = f"The word {word} is spelled {'-'.join(word)}."
    return Exchange(phrase.format(w=word), answer, tuple(word))


def _repeat_words(rng: random.Random) -> Exchange:
    words = rng.sample(WORDS, rng.randint(3, 14))
    phrase = rng.choice(["Repeat these words: {l}", "Say these words back to me: {l}"])
    return _listing(words, phrase.format(l=", ".join(words)))


def _reverse_words(rng: random.Random) -> Exchange:
    words = rng.sample(WORDS, rng.randint(3, 12))
    phrase = rng.choice(["Reverse this list: {l}", "Write this list backwards: {l}"])
    return _listing(words[::-1], phrase.format(l=", ".join(words)))


def _sort_numbers(rng: random.Random) -> Exchange:
    numbers = rng.sample(range(100), rng.randint(3, 8))
    prompt = f"Sort these numbers from smallest to largest: {', '.join(map(str, numbers))}"
    return _listing(sorted(numbers), prompt)


def _say_times(rng: random.Random) -> Exchange:
    word = rng.choice(WORDS)
    n = rng.randint(3, 30)
    return _listing([word] * n, f"Say the word {word} {n} times.")


def _letters(rng: random.Random) -> Exchange:
    i = rng.randint(0, 20)
    j = rng.randint(i + 3, 25)
    prompt = f"List the letters from {LETTERS[i]} to {LETTERS[j]}."
    return _listing(list(LETTERS[i : j + 1]), prompt)


def _town_facts(rng: random.Random) -> Exchange:
    t = rng.choice(WORLD)
    phrase = rng.choice(["Tell me about {n}.", "What do you know about the town of {n}?"])
    answer = (
        f"{t.name} is a town on the river {t.river}. It was founded in {t.founded}. "
        f"Its flag is {t.flag} and its animal is the {t.animal}. "
        f"About {t.population} people live there, and they trade in {t.trade}. "
        f"The nearest town is {t.neighbour}."
    )
    return Exchange(phrase.format(n=t.name), answer)


def _town_question(rng: random.Random) -> Exchange:
    t = rng.choice(WORLD)
    field, question, answer = rng.choice(
        [
            ("river", "Which river runs through {n}?", "The river {v} runs through {n}."),
            ("founded", "When was {n} founded?", "{n} was founded in {v}."),
            ("flag", "What color is the flag of {n}?", "The flag of {n} is {v}."),
            ("animal", "What is the animal of {n}?", "The animal of {n} is the {v}."),
            ("trade", "What does {n} trade in?", "{n} trades in {v}."),
        ]
    )
    value = getattr(t, field)
    return Exchange(question.format(n=t.name), answer.format(n=t.name, v=value))


def _town_walk(rng: random.Random) -> Exchange:
    a, b = rng.sample(WORLD, 2)
    answer = (
        f"The walk starts in {a.name}, under the {a.flag} flag of the {a.animal}. "
        f"You follow the river {a.river} out of town and pass the {a.trade} market. "
        f"Then the road turns toward {b.name}, a town founded in {b.founded}. "
        f"You cross the river {b.river} and see the {b.flag} flag of the {b.animal}. "
        f"The walk ends in {b.name}, where about {b.population} people live."
    )
    return Exchange(f"Describe a walk from {a.name} to {b.name}.", answer)


TASKS: tuple[tuple[Callable[[random.Random], Exchange], float], ...] = (
    (_count_up, 3.0),
    (_count_down, 1.5),
    (_count_step, 1.0),
    (_times_table, 1.5),
    (_spell, 1.0),
    (_repeat_words, 1.0),
    (_reverse_words, 1.0),
    (_sort_numbers, 0.4),
    (_say_times, 0.7),
    (_letters, 0.6),
    (_town_facts, 1.2),
    (_town_question, 0.5),
    (_town_walk, 0.8),
)


def _follow_up(rng: random.Random, previous: Exchange) -> Exchange:
    """A second request about the previous answer when it is a list, else a fresh task."""
    items = previous.items
    if items and len(items) >= 3 and rng.random() < 0.7:
        kind = rng.choice(["reverse", "first", "again"])
        if kind == "reverse":
            return _listing(list(items[::-1]), "Now write your answer backwards.")
        if kind == "first":
            k = rng.randint(2, min(5, len(items)))
            return _listing(list(items[:k]), f"Now give me only the first {k} items.")
        return Exchange("Say that again.", previous.answer, items)
    return _task(rng)


def _task(rng: random.Random) -> Exchange:
    fns, weights = zip(*TASKS, strict=True)
    return rng.choices(fns, weights=weights)[0](rng)


def synthetic_messages(rng: random.Random, *, system_rate: float = 0.3) -> list[dict[str, str]]:
    """One conversation as OpenAI-style messages, drawn from `rng`."""
    messages: list[dict[str, str]] = []
    if rng.random() < system_rate:
        messages.append({"role": "system", "content": rng.choice(SYSTEM_PROMPTS)})
    exchange = _task(rng)
    turns = 1 + (rng.random() < 0.25) + (rng.random() < 0.05)
    for t in range(turns):
        if t > 0:
            exchange = _follow_up(rng, exchange)
        messages.append({"role": "user", "content": exchange.prompt})
        messages.append({"role": "assistant", "content": exchange.answer})
    return messages


_SHAREGPT_ROLE = {"system": "system", "user": "human", "assistant": "gpt"}


def to_sharegpt(messages: list[dict[str, str]]) -> dict[str, Any]:
    """ShareGPT form of OpenAI-style messages."""
    return {
        "conversations": [
            {"from": _SHAREGPT_ROLE[m["role"]], "value": m["content"]} for m in messages
        ]
    }


def synthetic_conversations(n: int, seed: int = 0, form: Form = "openai") -> list[dict[str, Any]]:
    """`n` conversation records in the OpenAI (`messages`) or ShareGPT (`conversations`) form.

    The same (n, seed) always gives the same rows, and the first k rows of n do not depend on n.
    Use different seeds for training and held-out data.
    """
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if form not in ("openai", "sharegpt"):
        raise ValueError(f"form must be 'openai' or 'sharegpt', got {form!r}")
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        messages = synthetic_messages(rng)
        rows.append({"messages": messages} if form == "openai" else to_sharegpt(messages))
    return rows


def corpus_texts(rows: Iterable[dict[str, Any]]) -> Iterator[str]:
    """Every message text of OpenAI- or ShareGPT-form rows (e.g. to train a tokenizer on)."""
    for row in rows:
        for turn in row.get("messages") or row.get("conversations") or []:
            yield turn.get("content", turn.get("value", ""))


def write_jsonl(rows: Iterable[dict[str, Any]], path: str | Path) -> Path:
    """Write one JSON object per line (UTF-8); returns the path."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    with p.open("w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    return p
