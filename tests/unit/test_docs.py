"""The docs name only what exists, and the reference holds every flag of every command.

The site's reference is generated from the CLI's own parsers by `docs/hooks/reference.py`; these
tests check the other direction (a command, flag or script a page names that the code lacks),
and that every parser has a page asking for its generated flags. No MkDocs needed.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [*sorted((ROOT / "docs").rglob("*.md")), ROOT / "README.md"]
# Flags the pages name that belong to other programs, and which.
EXTERNAL = {
    "--no-deps": "pip",
    "--no-build-isolation": "pip",
    "--no-index": "pip",
    "--nnodes": "torchrun",
    "--nproc-per-node": "torchrun",
    "--node-rank": "torchrun",
    "--rdzv-backend": "torchrun",
    "--rdzv-endpoint": "torchrun",
    "--rdzv-id": "torchrun",
    "--standalone": "torchrun",
    "--no-python": "torchrun",
    "--shutdown-timeout": "torchrun",
    "--shm-size": "docker run",
    "--speculative-algorithm": "SGLang",
    "--speculative-draft-model-path": "SGLang",
    "--speculative-num-draft-tokens": "SGLang",
    "--model-path": "SGLang",
    "--speculative-config": "vLLM",
    "--local-dir": "huggingface-cli",
    "--lf": "pytest",
    "--strict": "mkdocs build",
    "--help": "argparse, every command",
    "--flag": "a placeholder in prose",
    # the measurement scripts' own flags (scripts/*.py)
    "--backend": "SpecForge's baseline script",
    "--seq": "SpecForge's baseline script",
    "--prompt-len": "SpecForge's baseline script",
    "--batch": "SpecForge's baseline script",
    "--variants": "scripts/step_cost.py",
    "--reference": "scripts/store_error.py",
    "--store": "scripts/store_error.py, scripts/feature_stage_rates.py",
    "--epoch": "scripts/epoch_rates.py",
    "--shards": "scripts/store_fds.py",
    "--gsm8k": "scripts/gsm8k_target.py",
    "--previous": "scripts/gpu_check.py",
    "--no-install": "scripts/gpu_check.py",
    "--k": "scripts/teacher_topk.py",
}
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")
COMMAND = re.compile(r"(?:dflash-train|python3? -m dflash_train)\s+([a-z][a-z-]*)(?:\s+([a-z]+))?")


def _load_hook():
    spec = importlib.util.spec_from_file_location(
        "docs_reference", ROOT / "docs/hooks/reference.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def hook():
    return _load_hook()


@pytest.fixture(scope="module")
def parsers(hook):
    return hook.all_parsers()


def _code(text: str) -> list[str]:
    """The pieces of a page that are code: fenced lines (continuations joined) and `spans`."""
    out, fenced = [], False
    for line in text.replace("\\\n", " ").splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif fenced:
            out.append(line.split(" #", 1)[0])
        else:
            out.extend(re.findall(r"`([^`]+)`", line))
    return out


def _invocations(parsers) -> list[tuple[str, str, str]]:
    """(page, command, the rest of the code) for every command the pages run in code."""
    found = []
    for page in PAGES:
        for code in _code(page.read_text()):
            for m in COMMAND.finditer(code):
                name, sub = m.group(1), m.group(2)
                key = f"bench {sub}" if name == "bench" and f"bench {sub}" in parsers else name
                found.append((page.name, key, code[m.end() :]))
    return found


def test_every_command_the_docs_run_exists(parsers):
    unknown = {(page, cmd) for page, cmd, _ in _invocations(parsers) if cmd not in parsers}
    assert not unknown, f"commands named in the docs that the CLI lacks: {sorted(unknown)}"


def test_every_flag_in_a_command_line_of_the_docs_is_that_commands(hook, parsers):
    wrong = set()
    for page, cmd, rest in _invocations(parsers):
        if cmd not in parsers:
            continue
        own = set(hook.flags_of(parsers[cmd])) | {"--help"}
        # a later command on the line (`... && dflash-train eval ...`) has its own flags
        rest = re.split(r"&&|\||;|dflash-train|dflash_train", rest)[0]
        rest = re.sub(r"\"[^\"]*\"|'[^']*'", "", rest)  # `--recipe N="--flag ..."`: train's
        wrong |= {(page, cmd, f) for f in FLAG.findall(rest) if f not in own}
    assert not wrong, f"flags given to a command that has no such flag: {sorted(wrong)}"


def test_every_flag_the_docs_name_exists(hook, parsers):
    known = {f for p in parsers.values() for f in hook.flags_of(p)} | set(EXTERNAL)
    unknown = {
        (page.relative_to(ROOT).as_posix(), flag)
        for page in PAGES
        for flag in FLAG.findall(page.read_text())
        if flag not in known
    }
    assert not unknown, f"flags in the docs that no command has: {sorted(unknown)}"


def test_every_script_the_docs_run_exists():
    named = {m for page in PAGES for m in re.findall(r"scripts/[\w]+\.py", page.read_text())}
    assert named
    assert not {s for s in named if not (ROOT / s).is_file()}


def test_every_command_has_a_reference_of_all_its_flags(hook, parsers):
    markers = {
        " ".join(m.group(2).split())
        for page in PAGES
        for m in hook.MARKER.finditer(page.read_text())
        if m.group(1) == "flags"
    }
    assert set(parsers) <= markers, f"commands without a reference: {set(parsers) - markers}"
    for name, parser in parsers.items():
        table = hook.flags_page_part(name)
        missing = [f for f in hook.flags_of(parser) if f"`{f}`" not in table]
        assert not missing, f"{name}: flags missing from its reference: {missing}"


def test_the_config_reference_holds_every_key(hook):
    from dflash_train.config import SECTIONS
    from dflash_train.dataclass_cli import dataclass_fields

    schema = hook.config_schema()
    for section, cls in SECTIONS.items():
        assert f"### `{section}`" in schema
        for f in dataclass_fields(cls):
            assert f"| `{f.name}` |" in schema, f.name


def test_metric_names_are_found_in_the_source(hook):
    names = hook.metric_names()
    # One of each family: literal, stage timer, templated, telemetry.
    for name in ("train/loss", "time/prefetch_s", "train/acc_k{k}", "gpu/{i}/util_pct"):
        assert name in names, name
    assert all("/" in n and " " not in n for n in names)


def test_an_unknown_marker_fails_the_build(hook):
    with pytest.raises(ValueError, match="unknown generated part"):
        hook.expand("<!-- generated: flags no-such-command -->")


def test_the_generated_listings_hold_every_command_and_the_export_fields(hook, parsers):
    table = hook.render("commands", "")
    for name in parsers:
        shown = name if name != "engine-server" else "python -m dflash_train.engine.server"
        assert f"[`{shown}`]" in table, name
    assert '"DFlashDraftModel"' in hook.render("export-config", "dflash")
    assert '"selector_top_k": 16' in hook.render("export-config", "dflash2")


USAGE_FENCE = re.compile(r"```text\nusage:.*?```", re.DOTALL)


def test_the_pages_hold_their_generated_parts_as_the_code_renders_them(hook):
    """The pages read whole without the site (the repository's web view showed empty flag
    tables); this fails while one is stale. The usage lines are left out: argparse formats
    them differently from one Python version to the next."""
    stale = [
        str(page.relative_to(ROOT))
        for page in sorted((ROOT / "docs").rglob("*.md"))
        if hook.MARKER.search(text := page.read_text())
        and USAGE_FENCE.sub("", hook.expand(text, keep_markers=True)) != USAGE_FENCE.sub("", text)
    ]
    assert not stale, f"stale generated parts in {stale}: run `python docs/hooks/reference.py`"


def test_a_generated_part_is_replaced_whole_and_the_text_around_it_kept(hook):
    commands = hook.render("commands", "")
    page = "intro\n<!-- generated: commands -->\n\nold table\n\n<!-- end generated -->\noutro\n"
    assert hook.expand(page) == f"intro\n{commands}\noutro\n"
    fresh = hook.expand(page, keep_markers=True)
    assert fresh == f"intro\n<!-- generated: commands -->\n\n{commands}\n\n{hook.END}\noutro\n"
    assert hook.expand(fresh, keep_markers=True) == fresh
    new = "a\n<!-- generated: commands -->\nb\n<!-- generated: fault-stages -->\nc\n"
    assert hook.expand(new) == f"a\n{commands}\nb\n{hook.render('fault-stages', '')}\nc\n"


def test_the_generated_parts_hold_nothing_of_this_checkout_or_machine(hook):
    """Regression: a default shown as this checkout's absolute path made the committed pages
    stale in every other clone (CI's among them)."""
    for page in sorted((ROOT / "docs").rglob("*.md")):
        for m in hook.MARKER.finditer(page.read_text()):
            part = hook.render(m.group(1), m.group(2).strip())
            assert str(ROOT) not in part and str(Path.home()) not in part, (page, m.group(0))
