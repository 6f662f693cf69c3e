"""The comparison of `dflash-train bench engine`: an engine's per-request speculative decoding
metrics against this project's decoding of the same prompts, greedy. Plain data in, plain data
out (no model, no engine), so a unit test can feed it fabricated counts.

What must agree, per prompt (tolerance 0 everywhere; the one difference allowed is computed, not
tolerated):
- the engine's output == plain greedy decoding of the target == the project's speculative output;
- every verify step: the engine's accepted drafts + 1 == the project's acceptance length of that
  cycle, taken from the project's UNCLIPPED run (no stop tokens, B more tokens: its cycles are
  the engine's, none cut short), and every step drafted B - 1 tokens;
- the response ends inside the engine's last step (no step missing or extra);
- `eval`'s cycles (the project's run as `eval` decodes: stop tokens, the token limit) == the
  engine's, except where the two differ by design, in the last B - 1 tokens before the limit.
  There `eval` (like the reference client) shortens its block so that it never verifies past
  the last token it may emit, and clips its last cycle at the limit or a stop token; the engine
  drafts a full block to the end and counts the drafts its last step accepted beyond them (the
  "surplus"). So: every `eval` cycle with a full block equals the engine's cycle (its last one
  clipped: engine's minus the surplus), and the cycles `eval` runs on shortened blocks (the
  "tail", at most B - 2 tokens) are free, their tokens being equal through the output.
  With m engine steps, n `eval` cycles and the same X tokens after the prefill, tau_eval =
  X / n and tau_engine = (X + s) / m, so exactly
      tau_engine - tau_eval = (s + tau_eval * (n - m)) / m,
  the gap the table shows beside the measured one ("explained"; the check requires the two to
  agree). That is the stated tolerance: s <= B - 1 drafts counted past the end and
  |n - m| <= B - 2 tail cycles, against m steps per prompt; it goes to 0 as responses grow.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass
class ProjectDecode:
    """The project's decoding of every prompt with one drafter (index = prompt)."""

    eval_tokens: list[list[int]]
    """Speculative output as `eval` decodes (stops, the token limit)."""
    eval_lengths: list[list[int]]
    """`eval`'s acceptance lengths per cycle (the last cycle clipped)."""
    unclipped_lengths: list[list[int]]
    """Acceptance lengths with no stop token and B more tokens: no cycle that the engine runs is
    clipped or shortened here."""


@dataclass
class RequestCheck:
    """One prompt, one drafter: the engine against the project."""

    outputs_equal: bool
    """Engine tokens == plain greedy decoding == the project's speculative output."""
    steps: int
    """The engine's verify steps (cycles)."""
    first_mismatch: int | None
    """The first verify step that disagrees (its acceptance, its draft count, or the response
    ending elsewhere than in the last step); None when every step agrees."""
    eval_agrees: bool
    """`eval`'s full-block cycles == the engine's (the last clipped), the same tokens out, and
    the taus `explained_gap` apart (module doc)."""
    surplus: int
    """Drafts the engine's last step accepted beyond the tokens it returned."""
    shared_cycles: int
    """`eval`'s leading cycles with a full block: the ones that must equal the engine's."""
    explained_gap: float
    """What engine tau - eval tau must be, from the surplus and the tail (module doc)."""
    engine_tau: float
    """The engine's mean acceptance length of this request, as it reports it."""
    unclipped_tau: float
    """The project's mean acceptance length over the same cycles, unclipped."""
    eval_tau: float | None
    """`eval`'s (last cycle clipped); None when no cycle ran."""
    engine_lengths: list[int]
    project_lengths: list[int]
    eval_lengths: list[int]

    @property
    def passed(self) -> bool:
        return (
            self.outputs_equal
            and self.first_mismatch is None
            and self.eval_agrees
            and abs(self.engine_tau - self.unclipped_tau) < 1e-9
        )


def check_request(
    tokens: Sequence[int],
    accepted: Sequence[int],
    drafted: Sequence[int],
    engine_tau: float,
    plain_tokens: Sequence[int],
    project: ProjectDecode,
    index: int,
    block_size: int,
    max_new_tokens: int,
) -> RequestCheck:
    """Compare one engine response (its tokens; accepted and drafted counts per verify step; its
    reported mean acceptance length) with the project's decoding of prompt `index`."""
    engine = [a + 1 for a in accepted]
    m = len(engine)
    ours = list(project.unclipped_lengths[index][:m])
    first = next((i for i, (a, b) in enumerate(zip(engine, ours, strict=False)) if a != b), None)
    if first is None and len(ours) < m:
        first = len(ours)
    bad_draft = next((i for i, d in enumerate(drafted) if d != block_size - 1), None)
    if bad_draft is not None or len(drafted) != m:
        first = min(x for x in (first, bad_draft, len(drafted)) if x is not None)
    if first is None and m and not _ends_in(len(tokens), engine):
        first = m - 1  # the response needed another step (or one fewer): say where
    surplus = 1 + sum(engine) - len(tokens) if m else 0
    eval_lengths = list(project.eval_lengths[index])
    shared = _full_block_cycles(eval_lengths, block_size, max_new_tokens)
    expected = engine[:shared]
    clipped = surplus if shared == len(eval_lengths) == m and m else 0
    if clipped:
        expected[-1] -= clipped  # a full last block: eval clips where the engine ran on
    eval_agrees = eval_lengths[:shared] == expected and 1 + sum(eval_lengths) == len(tokens)
    eval_tau = sum(eval_lengths) / len(eval_lengths) if eval_lengths else None
    tau = engine_tau if m else 1.0
    # tau_engine - tau_eval as the surplus and the tail's cycle counts make it (module doc)
    explained = (surplus + eval_tau * (len(eval_lengths) - m)) / m if m and eval_tau else 0.0
    if eval_tau is not None and abs(tau - eval_tau - explained) > 1e-9:
        eval_agrees = False
    return RequestCheck(
        outputs_equal=list(tokens) == list(plain_tokens) == list(project.eval_tokens[index]),
        steps=m,
        first_mismatch=first,
        eval_agrees=eval_agrees,
        surplus=surplus,
        shared_cycles=shared,
        explained_gap=explained,
        engine_tau=tau,
        unclipped_tau=sum(ours) / len(ours) if ours else 1.0,
        eval_tau=eval_tau,
        engine_lengths=engine,
        project_lengths=ours,
        eval_lengths=eval_lengths,
    )


def _full_block_cycles(lengths: Sequence[int], block_size: int, max_new_tokens: int) -> int:
    """How many leading cycles of an `eval` run had a full block: the cycle starting with t
    tokens out verifies min(B, max_new_tokens - t + 1) positions (`speculative.py`)."""
    out = 1  # the prefill's token
    for i, length in enumerate(lengths):
        if max_new_tokens - out + 1 < block_size:
            return i
        out += length
    return len(lengths)


def _ends_in(num_tokens: int, lengths: Sequence[int]) -> bool:
    """Whether a response of `num_tokens` (the first from the prefill) ends inside the last of
    these cycles: 1 + sum(all but last) < num_tokens <= 1 + sum(all)."""
    before = 1 + sum(lengths[:-1])
    return before < num_tokens <= before + lengths[-1]


@dataclass
class DrafterCheck:
    """One served drafter against one project decoding of it."""

    name: str
    """The drafter as served."""
    compared_with: str
    """The project's decoding it is compared with."""
    must_match: bool
    """True: any difference is a failure; False: the row measures a known deviation."""
    requests: list[RequestCheck]

    @property
    def outputs_equal(self) -> int:
        return sum(r.outputs_equal for r in self.requests)

    @property
    def steps(self) -> int:
        return sum(r.steps for r in self.requests)

    @property
    def mismatched_requests(self) -> list[int]:
        return [i for i, r in enumerate(self.requests) if not r.passed]

    @property
    def mismatched_steps(self) -> int:
        return sum(
            sum(a != b for a, b in zip(r.engine_lengths, r.project_lengths, strict=False))
            + abs(len(r.engine_lengths) - len(r.project_lengths))
            for r in self.requests
        )

    def tau(self, which: str) -> float:
        """Mean over requests of one per-request figure (as `eval` averages tau)."""
        values = [getattr(r, which) for r in self.requests]
        values = [v for v in values if v is not None]
        return sum(values) / len(values) if values else 1.0

    @property
    def passed(self) -> bool:
        return not self.mismatched_requests

    def row(self) -> dict[str, Any]:
        n = len(self.requests)
        engine_tau, eval_tau = self.tau("engine_tau"), self.tau("eval_tau")
        return {
            "served": self.name,
            "project decodes": self.compared_with,
            "exact": "required" if self.must_match else "measured",
            "outputs = greedy": f"{self.outputs_equal}/{n}",
            "prompts agreeing": f"{n - len(self.mismatched_requests)}/{n}",
            "steps": self.steps,
            "steps differing": self.mismatched_steps,
            "tau vLLM": engine_tau,
            "tau project unclipped": self.tau("unclipped_tau"),
            "tau eval": eval_tau,
            "vLLM - eval": engine_tau - eval_tau,
            "explained": self.tau("explained_gap"),
            "passed": self.passed,
        }

    def problem(self) -> str:
        """One line naming the prompts that disagree and how."""
        bad = self.mismatched_requests
        how = [
            f"prompt {i}: "
            + ", ".join(
                what
                for what, failed in (
                    ("output != greedy", not r.outputs_equal),
                    (f"step {r.first_mismatch} differs", r.first_mismatch is not None),
                    ("eval's cycles differ", not r.eval_agrees),
                    ("reported tau differs", abs(r.engine_tau - r.unclipped_tau) >= 1e-9),
                )
                if failed
            )
            for i, r in ((i, self.requests[i]) for i in bad[:8])
        ]
        return (
            f"{self.name!r} against the project decoding it {self.compared_with}: "
            f"{len(bad)}/{len(self.requests)} prompts disagree ({'; '.join(how)})"
        )
