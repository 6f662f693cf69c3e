"""`dflash-train compare` with its subprocesses faked: the order of the runs, the record, the
resume after a failure, `--report-only`, and the one-line errors for bad input."""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import sys
from pathlib import Path

import pytest

from dflash_train.compare import command
from dflash_train.compare.runs import (
    RESULTS_FILE,
    SETTINGS_FILE,
    StepFailed,
    read_results,
    subprocess_runner,
)
from dflash_train.model.tiny import save_random_qwen3
from pipeline_helpers import write_random_dataset

VARIANTS = ["base=--optimizer adamw", "muon=--optimizer muon --lr 1e-3"]


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    command.add_arguments(parser)
    return parser.parse_args(argv)


def value(argv, flag):
    return argv[len(argv) - 1 - argv[::-1].index(flag) + 1]  # the last one wins, as argparse


class FakeSteps:
    """Stands in for the subprocesses: writes what train, export and eval would write. tau
    depends on the optimizer and the seed, so the comparison has something to find; `fail_at`
    makes the n-th call (1-based) of a step exit non-zero with an error line in its log."""

    def __init__(self, fail_at: tuple[str, int] | None = None, code: int = 1) -> None:
        self.calls: list[tuple[str, str]] = []
        self.argvs: list[list[str]] = []
        self.fail_at, self.code = fail_at, code

    def __call__(self, argv, log: Path, timeout_s: float) -> int:
        step = "reference" if argv[1] == "dflash_train.compare.reference" else argv[2]
        where = log.parent.relative_to(log.parents[2])
        self.calls.append((step, str(where)))
        self.argvs.append(list(argv))
        if self.fail_at == (step, sum(c[0] == step for c in self.calls)):
            log.write_text(f"usage: ...\ndflash-train {step}: error: something is wrong\n")
            return self.code
        log.write_text(f"{step} ok\n")
        getattr(self, step.replace("reference", "eval"))(list(argv))
        return 0

    def train(self, argv):
        out, seed = Path(value(argv, "--out")), int(value(argv, "--seed"))
        muon = "--optimizer" in argv and value(argv, "--optimizer") == "muon"
        out.mkdir(parents=True, exist_ok=True)
        summary = {
            "steps": 7,
            "wall_s": 1.5,
            "interrupted": None,
            "weights_digest": f"{seed}{muon}",
        }
        (out / "result.json").write_text(json.dumps(summary))
        (out / "tau").write_text(str(3.0 + 0.1 * seed + (1.0 + 0.05 * seed) * muon))

    def export(self, argv):
        out = Path(value(argv, "--out"))
        out.mkdir(parents=True, exist_ok=True)
        (out / "tau").write_text((Path(argv[3]) / "tau").read_text())

    def eval(self, argv):
        tau = float((Path(value(argv, "--draft")) / "tau").read_text())
        limit = int(value(argv, "--limit")) if "--limit" in argv else 4
        taus = [tau + d for d in (-0.3, -0.1, 0.1, 0.3)[:limit]]
        # A prompt whose response ends at the target's first token: no round, no tau.
        responses = [{"tau": t} for t in taus] + [{"tau": None}]
        report = {"tau": sum(taus) / len(taus), "responses": responses}
        Path(value(argv, "--json")).write_text(json.dumps(report))


@pytest.fixture(scope="module")
def made_inputs(tmp_path_factory):
    """A target, prepared data and prompts (what compare digests; the faked steps read none)."""
    root = tmp_path_factory.mktemp("inputs")
    save_random_qwen3(root / "target", num_layers=1)
    write_random_dataset(root / "data", num_rows=4)
    (root / "prompts.jsonl").write_text('{"prompt": "hi"}\n')
    return root


@pytest.fixture
def inputs(made_inputs, tmp_path):
    for name in ("target", "data", "prompts.jsonl"):
        copy = shutil.copytree if (made_inputs / name).is_dir() else shutil.copy
        copy(made_inputs / name, tmp_path / name)
    return tmp_path


def argv(inputs, *extra, seeds=3, variants=VARIANTS, train_flags="--batch-cost blocks"):
    out = ["--out", str(inputs / "cmp"), "--target", str(inputs / "target")]
    out += ["--data", str(inputs / "data"), "--prompts", str(inputs / "prompts.jsonl")]
    out += ["--seeds", str(seeds), "--train-flags", f"--epochs 1 --lr 5e-3 {train_flags}"]
    for r in variants:
        out += ["--variant", r]
    return out + list(extra)


def test_every_variant_runs_at_every_seed_seed_by_seed_and_is_summarised(inputs, capsys):
    steps = FakeSteps()
    assert command.main(parse(argv(inputs)), runner=steps) == 0
    out = inputs / "cmp"
    records = read_results(out)
    assert [(r["variant"], r["seed"]) for r in records] == [
        (n, s) for s in range(3) for n in ("base", "muon")
    ]
    assert [c[0] for c in steps.calls] == ["train", "export", "eval"] * 6
    rec = records[1]
    assert rec["flags"] == "--optimizer muon --lr 1e-3" and rec["eval"] == "project"
    assert rec["tau"] == pytest.approx(4.0) and rec["num_prompts"] == 4
    assert rec["prompts_without_rounds"] == 1 and len(rec["prompt_taus"]) == 4
    assert rec["steps"] == 7 and rec["weights_digest"] == "0True"
    for step in ("train", "export", "eval"):
        assert (out / "runs" / "muon" / "seed2" / f"{step}.log").read_text() == f"{step} ok\n"
    summary = json.loads((out / "summary.json").read_text())
    (diff,) = summary["differences"]
    assert diff["variant"] == "muon" and diff["verdict"] == "win" and diff["n"] == 3
    assert diff["mean"] == pytest.approx(1.05)
    assert summary["flags"]["base"] == "--optimizer adamw"
    printed = capsys.readouterr().out
    assert (out / "summary.md").read_text().strip() in printed


def test_the_train_command_line_puts_the_variant_after_the_common_flags_and_the_seed_last(inputs):
    seen = []

    class Recording(FakeSteps):
        def train(self, argv):
            seen.append(argv)
            super().train(argv)

    command.main(parse(argv(inputs, seeds=2)), runner=Recording())
    first = seen[1]
    assert first[:3] == ["-m", "dflash_train", "train"]
    joined = shlex.join(first)
    assert joined.index("--lr 5e-3") < joined.index("--optimizer muon --lr 1e-3")
    assert first[-2:] == ["--seed", "0"] and "--overwrite" in first


def test_a_rerun_after_a_failure_runs_only_what_is_missing(inputs, capsys):
    # The 4th eval fails: base and muon at seed 0 and base at seed 1 are recorded; muon at
    # seed 1 has trained and exported.
    failing = FakeSteps(fail_at=("eval", 4))
    assert command.main(parse(argv(inputs)), runner=failing) == 1
    err = capsys.readouterr().err
    assert "eval of variant 'muon' seed 1 exited 1: dflash-train eval: error: something" in err
    assert str(inputs / "cmp" / "runs" / "muon" / "seed1" / "eval.log") in err
    assert len(read_results(inputs / "cmp")) == 3
    again = FakeSteps()
    assert command.main(parse(argv(inputs)), runner=again) == 0
    # muon seed 1 is evaluated again without training; then seed 2 in full.
    assert again.calls == [
        ("export", "muon/seed1"),
        ("eval", "muon/seed1"),
        *[(s, f"{n}/seed2") for n in ("base", "muon") for s in ("train", "export", "eval")],
    ]
    assert len(read_results(inputs / "cmp")) == 6
    nothing = FakeSteps()
    assert command.main(parse(argv(inputs)), runner=nothing) == 0 and nothing.calls == []
    # More seeds later: only the new ones run.
    more = FakeSteps()
    assert command.main(parse(argv(inputs, seeds=4)), runner=more) == 0
    assert {c[1] for c in more.calls} == {"base/seed3", "muon/seed3"}


def test_report_only_recomputes_the_summary_from_the_results(inputs, capsys):
    command.main(parse(argv(inputs)), runner=FakeSteps())
    out = inputs / "cmp"
    first = json.loads((out / "summary.json").read_text())
    (out / "summary.json").unlink()
    (out / "summary.md").unlink()
    capsys.readouterr()
    never = FakeSteps()
    report = parse(["--out", str(out), "--report-only"])
    assert command.main(report, runner=never) == 0 and never.calls == []
    assert json.loads((out / "summary.json").read_text()) == first
    assert (out / "summary.md").read_text().strip() in capsys.readouterr().out
    # Another baseline: muon against base is now base against muon, a loss.
    command.main(parse(["--out", str(out), "--report-only", "--baseline", "muon"]), never)
    (diff,) = json.loads((out / "summary.json").read_text())["differences"]
    assert diff["variant"] == "base" and diff["verdict"] == "loss"


def test_a_torn_last_line_counts_as_not_done(inputs):
    command.main(parse(argv(inputs, seeds=2)), runner=FakeSteps())
    path = inputs / "cmp" / RESULTS_FILE
    lines = path.read_text().splitlines()
    path.write_text("\n".join(lines[:-1]) + "\n" + lines[-1][:20])
    assert len(read_results(inputs / "cmp")) == 3
    again = FakeSteps()
    command.main(parse(argv(inputs, seeds=2)), runner=again)
    # Its training had finished: only export and eval run again.
    assert again.calls == [("export", "muon/seed1"), ("eval", "muon/seed1")]
    # Its record is whole, after the torn fragment, which is gone: every run counts once.
    records = read_results(inputs / "cmp")
    assert sorted((r["variant"], r["seed"]) for r in records) == [
        ("base", 0),
        ("base", 1),
        ("muon", 0),
        ("muon", 1),
    ]
    assert len(path.read_text().splitlines()) == 4


def test_a_train_error_is_the_train_commands_own_line_and_exit_status(inputs, capsys):
    steps = FakeSteps(fail_at=("train", 2), code=2)
    assert command.main(parse(argv(inputs)), runner=steps) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert err[0].startswith("dflash-train compare: error: train of variant 'muon' seed 0 exited 2")
    assert "dflash-train train: error: something is wrong" in err[0]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (dict(prompts="missing.jsonl"), "--prompts .*missing.jsonl does not exist"),
        (dict(seeds=1), "--seeds must be >= 2 for an interval, got 1"),
        (dict(variants=["a=--seed 3"]), "variant 'a': --seed is set by compare"),
        (dict(variants=["a=--out=x"]), "variant 'a': --out is set by compare"),
        (dict(variants=["a=", "a=--lr 1"]), "given more than once: a"),
        (dict(variants=["a b=--lr 1"]), "a variant is NAME=FLAGS"),
        (dict(variants=["a=--lr '1"]), "variant 'a': No closing quotation"),
        (dict(variants=[]), "give at least one --variant"),
        (dict(target="nowhere"), "--target nowhere is not a directory"),
        (
            dict(variants=["a=--lr 1", "b=--optimiser muon"]),
            "variant 'b': train refuses its flags: unrecognized arguments: --optimiser muon",
        ),
        (dict(variants=["a=", "b=--hs-min-ready 0"]), "variant 'b': .*must be positive"),
        (dict(variants=["a=", "b=--lr nan"]), "variant 'b': .*--lr must be a finite number"),
        # One new token is the prefill's: no verify round, so no tau, found after training.
        (dict(extra=["--max-new-tokens", "1"]), "--max-new-tokens must be >= 2 .*got 1"),
        (dict(extra=["--limit", "0"]), "--limit must be >= 1, got 0"),
    ],
)
def test_bad_input_is_one_line_before_anything_runs(inputs, change, message):
    args = argv(inputs, seeds=change.get("seeds", 2), variants=change.get("variants", VARIANTS))
    args += change.get("extra", [])
    for flag in ("prompts", "target"):
        if flag in change:
            args[args.index(f"--{flag}") + 1] = change[flag]
    steps = FakeSteps()
    with pytest.raises(ValueError, match=message):
        command.main(parse(args), runner=steps)
    assert steps.calls == []


def test_a_rerun_with_changed_flags_or_settings_is_refused(inputs):
    command.main(parse(argv(inputs, seeds=2)), runner=FakeSteps())
    changed = argv(inputs, seeds=2, variants=["base=--optimizer adamw --lr 1", VARIANTS[1]])
    with pytest.raises(ValueError, match="variant 'base' ran with flags '--optimizer adamw'"):
        command.main(parse(changed), runner=FakeSteps())
    other = argv(inputs, "--max-new-tokens", "64", seeds=2)
    with pytest.raises(ValueError, match="other max_new_tokens"):
        command.main(parse(other), runner=FakeSteps())
    with pytest.raises(ValueError, match="does not exist: run `dflash-train compare`"):
        command.main(parse(["--out", str(inputs / "elsewhere"), "--report-only"]))


def test_inputs_compare_by_content_so_a_moved_comparison_resumes_and_a_changed_input_is_refused(
    inputs, tmp_path_factory
):
    """The record names the inputs by content: the whole comparison moved elsewhere (its record
    kept in a repository, say) runs only what is missing; other weights under the same target
    path, or other prompts, are refused."""
    first = FakeSteps()
    command.main(parse(argv(inputs, seeds=2)), runner=first)
    assert len(first.calls) == 12  # 2 variants x 2 seeds x (train, export, eval)
    moved = tmp_path_factory.mktemp("moved")
    for name in ("target", "data", "prompts.jsonl"):
        (inputs / name).rename(moved / name)
    (moved / "cmp").mkdir()
    for name in (SETTINGS_FILE, RESULTS_FILE):
        shutil.copy(inputs / "cmp" / name, moved / "cmp" / name)
    again = FakeSteps()
    command.main(parse(argv(moved, seeds=3)), runner=again)
    assert {where.split("/")[1] for _, where in again.calls} == {"seed2"}  # only the new seed
    doc = json.loads((moved / "cmp" / SETTINGS_FILE).read_text())
    assert doc["settings"]["target"] == str(moved / "target")  # where they are now
    assert [r["seed"] for r in read_results(moved / "cmp")] == [0, 0, 1, 1, 2, 2]
    (moved / "prompts.jsonl").write_text('{"prompt": "another"}\n')
    with pytest.raises(ValueError, match="other prompts"):
        command.main(parse(argv(moved, seeds=3)), runner=FakeSteps())
    (moved / "prompts.jsonl").write_text('{"prompt": "hi"}\n')
    save_random_qwen3(moved / "target", num_layers=1, seed=1)
    with pytest.raises(ValueError, match="other target"):
        command.main(parse(argv(moved, seeds=3)), runner=FakeSteps())


def test_the_reference_client_is_evaluated_by_its_module(inputs):
    pytest.importorskip("dflash")
    steps = FakeSteps()
    assert command.main(parse(argv(inputs, "--eval", "reference", "--limit", "2")), steps) == 0
    assert {c[0] for c in steps.calls} == {"train", "export", "reference"}
    rec = read_results(inputs / "cmp")[0]
    assert rec["eval"] == "reference" and rec["num_prompts"] == 2


def test_the_subprocess_runner_keeps_the_log_and_stops_a_step_past_its_timeout(tmp_path):
    log = tmp_path / "step.log"
    code = subprocess_runner(["-c", "import sys; print('out'); sys.exit(3)"], log, 60)
    assert code == 3
    command_line, output = log.read_text().splitlines()
    assert command_line.startswith(f"$ {sys.executable} -c ") and output == "out"
    with pytest.raises(StepFailed, match="ran past --step-timeout 0.5 s"):
        subprocess_runner(["-c", "import time; time.sleep(120)"], log, 0.5)


STAGED = ["sft=--optimizer adamw", "opd=--init-from {run:sft} --anchors on-policy --epochs 1"]


def test_a_stage_trained_on_from_another_variants_run_gets_that_run_at_the_same_seed(inputs):
    steps = FakeSteps()
    command.main(parse(argv(inputs, seeds=2, variants=STAGED)), runner=steps)
    calls = zip(steps.calls, steps.argvs, strict=True)
    trains = [(where, a) for (step, where), a in calls if step == "train"]
    assert [w for w, _ in trains] == ["sft/seed0", "opd/seed0", "sft/seed1", "opd/seed1"]
    for where, a in trains:
        seed = where[-1]
        if where.startswith("opd"):
            assert value(a, "--init-from") == str(inputs / "cmp/runs/sft" / f"seed{seed}" / "run")
    # A stage's training cost is its own with its source's (FakeSteps: 1.5 s a train).
    summary = json.loads((inputs / "cmp" / "summary.json").read_text())
    assert [v["train_s"] for v in summary["variants"]] == [1.5, 3.0]
    # The record keeps the flags as written, so it stays true wherever the runs are.
    assert {r["flags"] for r in read_results(inputs / "cmp")} == {
        "--optimizer adamw", "--init-from '{run:sft}' --anchors on-policy --epochs 1"
    }  # fmt: skip


def test_a_record_whose_variants_name_each_other_round_is_refused_not_recursed():
    records = [
        {"variant": v, "seed": 0, "train_wall_s": 1.0, "tau": 2.0, "prompt_taus": [2.0]}
        for v in "abc"
    ]
    flags = {"a": "--init-from {run:c}", "b": "--init-from {run:a}", "c": "--init-from {run:b}"}
    with pytest.raises(ValueError, match=r"name each other round \(a -> c -> b -> a\)"):
        command.with_sources_time(records, flags)


def test_a_stage_after_a_carried_record_trains_its_source_again_and_checks_its_weights(
    inputs, capsys
):
    """Only the record travelled (no run directories): the missing stage's source run is trained
    again, and must reproduce the weights its record names."""
    command.main(parse(argv(inputs, seeds=2, variants=STAGED)), runner=FakeSteps())
    lines = (inputs / "cmp" / RESULTS_FILE).read_text().splitlines()
    shutil.rmtree(inputs / "cmp" / "runs")
    (inputs / "cmp" / RESULTS_FILE).write_text("\n".join(lines[:3]) + "\n")  # opd seed1 left
    again = FakeSteps()
    command.main(parse(argv(inputs, seeds=2, variants=STAGED)), runner=again)
    assert [c for c in again.calls if c[0] == "train"] == [
        ("train", "sft/seed1"), ("train", "opd/seed1")
    ]  # fmt: skip
    assert ("eval", "sft/seed1") not in again.calls  # its tau is recorded already
    shutil.rmtree(inputs / "cmp" / "runs")
    (inputs / "cmp" / RESULTS_FILE).write_text("\n".join(lines[:3]) + "\n")
    code = command.main(parse(argv(inputs, seeds=2, variants=STAGED)), runner=OtherWeights())
    assert code == 1
    err = capsys.readouterr().err
    assert "variant 'sft' seed 1 trained again to weights" in err and "did not reproduce" in err


class OtherWeights(FakeSteps):
    """Trains to other weights than FakeSteps did."""

    def train(self, argv):
        super().train(argv)
        result = Path(value(argv, "--out")) / "result.json"
        summary = json.loads(result.read_text())
        result.write_text(json.dumps({**summary, "weights_digest": "other"}))


@pytest.mark.parametrize("variants", [STAGED[::-1], ["opd=--init-from {run:opd}"]])
def test_a_stage_must_name_a_variant_given_before_it(inputs, variants):
    with pytest.raises(ValueError, match="give variant '(sft|opd)' before it"):
        command.main(parse(argv(inputs, seeds=2, variants=variants)), runner=FakeSteps())


@pytest.mark.parametrize(
    "flags, timed",
    [
        ("--epochs 1", False),
        ("--batch-cost auto", True),
        ("--batch-cost blocks", False),
        ("--batch-cost=0.45", False),
        ("--batch-cost blocks --batch-cost auto", True),
        ("--batching fixed", False),
        ("--batching=fixed --batching work", False),
        ("--batch-cost auto --batching=fixed --batching work", True),
    ],
)
def test_a_variant_planned_by_a_timed_cost_is_noted(inputs, capsys, flags, timed):
    """--batch-cost auto times the drafter on the machine, so its runs need not plan the same
    batches when made again: compare says so before it runs them (the default, flops, is a
    function of the drafter's shape: no note)."""
    variants = [f"v={flags}", "w=--batch-cost 0.5"]
    command.main(parse(argv(inputs, seeds=2, variants=variants, train_flags="")), FakeSteps())
    err = capsys.readouterr().err
    assert ("note: v plan batches by a cost timed on this machine" in err) == timed
    assert "note: v, w" not in err


def test_the_inputs_are_digested_once_per_invocation(inputs, monkeypatch):
    """The target's weights (GiBs for a real one) are read once, though both the check against
    the record and the record's update need their digest."""
    reads = []

    def digest(path):
        reads.append(path)
        return "d"

    monkeypatch.setattr("dflash_train.compare.runs.target_weights_digest", digest)
    command.main(parse(argv(inputs, seeds=2)), runner=FakeSteps())
    command.main(parse(argv(inputs, seeds=2)), runner=FakeSteps())  # checked against the record
    assert len(reads) == 2


class NoRounds(FakeSteps):
    """An eval in which every response ends at the target's first token."""

    def eval(self, argv):
        report = {"tau": 1.0, "responses": [{"tau": None}, {"tau": None}]}
        Path(value(argv, "--json")).write_text(json.dumps(report))


def test_an_eval_without_any_verify_round_is_one_line_not_a_crash(inputs, capsys):
    """Regression: `standard_error` of no prompt taus raised a bare ValueError('no values')
    after the variant's training, export and eval."""
    assert command.main(parse(argv(inputs, seeds=2)), runner=NoRounds()) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no prompt had a verify round" in err[0], err
    assert read_results(inputs / "cmp") == []


def test_a_run_recorded_twice_is_refused_not_counted_as_two_seeds(inputs):
    """Regression: results.jsonl files joined from two machines (or a line copied) counted a
    run twice in its variant's interval, which narrowed as if it had another seed."""
    command.main(parse(argv(inputs, seeds=2)), runner=FakeSteps())
    path = inputs / "cmp" / RESULTS_FILE
    lines = path.read_text().splitlines()
    path.write_text("\n".join([*lines, lines[0]]) + "\n")
    with pytest.raises(ValueError, match=r"results.jsonl:5 records variant 'base' seed 0 again"):
        read_results(inputs / "cmp")


def test_a_record_whose_tau_is_not_finite_is_refused(inputs):
    command.main(parse(argv(inputs, seeds=2)), runner=FakeSteps())
    path = inputs / "cmp" / RESULTS_FILE
    records = [json.loads(line) for line in path.read_text().splitlines()]
    records[1]["tau"] = float("nan")
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    with pytest.raises(ValueError, match="variant 'muon' seed 0 holds a tau that is not a finite"):
        command.main(parse(["--out", str(inputs / "cmp"), "--report-only"]), runner=FakeSteps())


class SeedIgnored(FakeSteps):
    """Trains one drafter whatever the seed (a seed that reaches neither the data order nor
    the initialisation): tau depends on the optimizer only."""

    def train(self, argv):
        super().train(argv)
        muon = "--optimizer" in argv and value(argv, "--optimizer") == "muon"
        (Path(value(argv, "--out")) / "tau").write_text(str(3.0 + 1.0 * muon))


def test_runs_the_seed_did_not_vary_are_undetermined_not_a_win(inputs, capsys):
    """Regression: the same difference at every seed had sd 0 and an interval of no width,
    which compare printed as a win."""
    assert command.main(parse(argv(inputs)), runner=SeedIgnored()) == 0
    summary = json.loads((inputs / "cmp" / "summary.json").read_text())
    (diff,) = summary["differences"]
    assert diff["verdict"] == "undetermined" and diff["identical"] is True
    assert diff["mean"] == pytest.approx(1.0) and diff["low"] is None
    assert all(v["identical"] and v["low"] is None for v in summary["variants"])
    printed = capsys.readouterr().out
    assert "- (identical at every seed) | undetermined |" in printed
    assert "the seed did not vary the runs" in printed


def test_a_run_of_one_prompt_has_no_prompt_se(inputs, capsys):
    """Regression: with --limit 1 the record's prompt se was 0.0 (one prompt's spread is
    unknown, not 0); printed as a number, None would not format."""
    assert command.main(parse(argv(inputs, "--limit", "1", seeds=2)), runner=FakeSteps()) == 0
    records = read_results(inputs / "cmp")
    assert [r["num_prompts"] for r in records] == [1] * 4
    assert all(r["prompt_se"] is None for r in records)
    out = capsys.readouterr().out
    assert "(prompt se -, 1 prompts)" in out
    summary = json.loads((inputs / "cmp" / "summary.json").read_text())
    assert [v["prompt_se"] for v in summary["variants"]] == [None, None]
