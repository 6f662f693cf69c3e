"""MkDocs hook: the reference's generated parts, built from the code's own definitions.

A page asks for a generated part with an HTML comment on a line of its own:

    <!-- generated: flags train -->      every flag of `dflash-train train`, from its parser
    <!-- generated: flags bench step -->  a benchmark's flags
    <!-- generated: flags engine-server -->  `python -m dflash_train.engine.server`'s flags
    <!-- generated: commands -->         every command, its one-line description and its page
    <!-- generated: config -->           the config file's sections and keys (TrainConfig)
    <!-- generated: export-config dflash -->  the config.json `export` writes (also dflash2)
    <!-- generated: metrics -->          every metric name the code logs
    <!-- generated: fault-stages -->     the fault plan's stages (faults.STAGES)

The parsers are the ones the CLI builds (`cli.command_parser`, `bench.command.benchmark_parser`,
`engine.server.build_parser`), so a flag cannot be documented wrong or forgotten. The same
functions serve `tests/unit/test_docs.py`, which checks the pages against the code.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import re
import textwrap
import typing
from pathlib import Path
from typing import Any

MARKER = re.compile(r"^<!-- generated: ([a-z-]+)((?: [a-z0-9-]+)*) -->$", re.MULTILINE)
SRC = Path(__file__).resolve().parents[2] / "src" / "dflash_train"
DEFAULT_IN_HELP = re.compile(r" ?\(default: ([^()]*)\)$")
METRIC_PREFIXES = ("train", "time", "queue", "store", "eval", "gpu")
METRIC_NAME = re.compile(rf"(?:{'|'.join(METRIC_PREFIXES)})/(?:[A-Za-z0-9_/]|\{{[^}}]*\}})+")


# ============================================================================ parsers


@functools.cache
def all_parsers() -> dict[str, argparse.ArgumentParser]:
    """Every command line users type, by its name in the docs: `train`, `bench step`, ...,
    `engine-server` (the vLLM engine's own process)."""
    from dflash_train import cli
    from dflash_train.bench.command import BENCHMARKS, benchmark_parser
    from dflash_train.engine.server import build_parser

    out = {name: cli.command_parser(name)[1] for name in cli.COMMANDS}
    out.update({f"bench {name}": benchmark_parser(name)[1] for name in BENCHMARKS})
    out["engine-server"] = build_parser()
    return out


def flags_of(parser: argparse.ArgumentParser) -> list[str]:
    """The option strings of a parser (`--help` left out)."""
    return [
        flag
        for action in parser._actions
        if not isinstance(action, argparse._HelpAction)
        for flag in action.option_strings
    ]


def _cell(text: str) -> str:
    """Text safe inside a Markdown table cell (no pipes, no HTML, no emphasis)."""
    text = " ".join(str(text).split())
    for ch in "\\|*_[]":
        text = text.replace(ch, "\\" + ch)
    return text.replace("<", "&lt;").replace(">", "&gt;")


def _value(action: argparse.Action) -> str:
    """What the flag takes: its choices, or its metavar as `--help` shows it."""
    if action.nargs == 0:
        return ""
    if action.choices is not None:
        return " \\| ".join(f"`{c}`" for c in action.choices)
    metavar = action.metavar or action.dest.upper()
    return f"`{' '.join(metavar) if isinstance(metavar, tuple) else metavar}`"


def _default(action: argparse.Action) -> str:
    """argparse's default, when the parser keeps one (on / off for a switch)."""
    default = action.default
    if default in (None, argparse.SUPPRESS) or (action.nargs == 0 and default is False):
        return ""
    if isinstance(default, bool):
        return "on" if default else "off"
    return f"`{default}`"


def _help(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    """The flag's help as `--help` prints it (`%(default)s` and the like filled in)."""
    text = "" if action.help in (None, argparse.SUPPRESS) else action.help
    if text:
        text = parser._get_formatter()._expand_help(action)
    return f"required. {text}" if action.required else text


def _row(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    name = ", ".join(f"`{f}`" for f in action.option_strings) or f"`{action.dest}`"
    if isinstance(action, argparse.BooleanOptionalAction):
        name = " / ".join(f"`{f}`" for f in action.option_strings)
    default, meaning = _default(action), " ".join(_help(parser, action).split())
    # The options dataclasses' flags carry their default in the help text (argparse's own
    # default is suppressed so that typed flags can be told apart): show it in its column.
    shown = DEFAULT_IN_HELP.search(meaning)
    if not default and shown:
        default = "" if shown.group(1) in ("None", "") else f"`{shown.group(1)}`"
        meaning = meaning[: shown.start()]
    return "| " + " | ".join((name, _value(action), default, _cell(meaning))) + " |"


def flags_table(parser: argparse.ArgumentParser) -> str:
    """One table per argument group: flag, value, default (when not in the help), meaning."""
    head = "| flag | value | default | meaning |\n|---|---|---|---|"
    parts, hidden = [], []
    for group in parser._action_groups:
        rows = []
        for action in group._group_actions:
            if isinstance(action, argparse._HelpAction):
                continue
            if action.help == argparse.SUPPRESS:
                if action.option_strings:  # a positional hidden so is the command's remainder
                    hidden.append(_row(parser, action))
                continue
            rows.append(_row(parser, action))
        if rows:
            parts.append(f"**{_cell(group.title or '')}**\n\n{head}\n" + "\n".join(rows))
    if hidden:
        title = "internal: hidden from `--help`, the command passes them to its own child processes"
        parts.append(f"**{title}**\n\n{head}\n" + "\n".join(hidden))
    return "\n\n".join(parts)


def flags_page_part(command: str) -> str:
    """A command's usage line (wrapped) and its flags' tables."""
    parser = all_parsers()[command]
    usage = textwrap.fill(
        " ".join(parser.format_usage().split()),
        width=70,
        subsequent_indent="    ",
        break_long_words=False,
        break_on_hyphens=False,
    )
    return f"```text\n{usage}\n```\n\n{flags_table(parser)}"


def commands_table() -> str:
    """Every command with the one-line description `dflash-train --help` prints, and its page."""
    from dflash_train import cli
    from dflash_train.bench.command import BENCHMARKS

    rows = [f"| [`{n}`]({n}.md) | {_cell(desc)} |" for n, (_, desc) in cli.COMMANDS.items()]
    rows += [f"| [`bench {n}`](bench.md) | {_cell(desc)} |" for n, (_, desc) in BENCHMARKS.items()]
    rows.append("| [`python -m dflash_train.engine.server`](engine-server.md) | the vLLM engine "
                "process of `--target-backend vllm` |")  # fmt: skip
    return "| command | what it does |\n|---|---|\n" + "\n".join(rows)


# ============================================================================ config file


def _type_name(tp: Any) -> str:
    text = getattr(tp, "__name__", None) if not typing.get_args(tp) else None
    return text or str(tp).replace("typing.", "")


def config_schema() -> str:
    """The `--config` YAML file: its sections, each key with type, default and meaning."""
    from dflash_train.config import SECTIONS
    from dflash_train.dataclass_cli import dataclass_fields, field_docs

    parts = []
    for section, cls in SECTIONS.items():
        hints = typing.get_type_hints(cls)
        docs = field_docs(cls)
        rows = []
        for f in dataclass_fields(cls):
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            shown = "" if default is None else f"`{default!r}`" if default == "" else f"`{default}`"
            cells = (f"`{f.name}`", _cell(_type_name(hints[f.name])), shown, _cell(docs[f.name]))
            rows.append("| " + " | ".join(cells) + " |")
        head = "| key | type | default | meaning (also the flag's `--help`) |\n|---|---|---|---|"
        parts.append(f"### `{section}`\n\n{_cell(cls.__doc__ or '')}\n\n{head}\n" + "\n".join(rows))
    return "\n\n".join(parts)


# ============================================================================ export


def export_config(arch: str) -> str:
    """The config.json `export` writes for a drafter of Qwen3-8B's shape (the qwen3-8b
    recipe's layout: 4 sliding-window layers under 1 full); for dflash2 its `dflash_config`."""
    import json

    from dflash_train.model.draft import DFlashConfig
    from dflash_train.model.serving import exported_config

    shape = dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=5)
    shape |= dict(num_attention_heads=32, num_key_value_heads=8, head_dim=128)
    shape |= dict(vocab_size=151936, num_target_layers=36, target_layer_ids=[1, 9, 17, 25, 33])
    shape |= dict(mask_token_id=151669)
    if arch == "dflash":
        layers = ["sliding_attention"] * 4 + ["full_attention"]
        data = exported_config(DFlashConfig(**shape, layer_types=layers, sliding_window=2048))
    else:
        dflash2 = dict(conv_kernel_size=2, conv_group_size=16, selector_rank=256)
        config = DFlashConfig(**shape, block_size=8, arch=arch, selector_top_k=16, **dflash2)
        data = exported_config(config)["dflash_config"]
    return "```json\n" + json.dumps(data, indent=2) + "\n```"


# ============================================================================ metrics


def _pattern(node: ast.AST) -> str | None:
    """A string literal, or an f-string with its fields as `{name}`."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        out = []
        for part in node.values:
            if isinstance(part, ast.Constant):
                out.append(str(part.value))
            else:
                out.append("{" + ast.unparse(part.value) + "}")
        return "".join(out)
    return None


def _stage_timer(node: ast.AST) -> str | None:
    """A stage timer's name (`timers.add("prefetch_s", ...)`, `segment(...)`, `_Stage(...)`),
    logged as `time/NAME`."""
    if not isinstance(node, ast.Call):
        return None
    func = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
    if func not in ("add", "segment", "_Stage"):
        return None
    for arg in node.args:
        text = arg.value if isinstance(arg, ast.Constant) else None
        if isinstance(text, str) and re.fullmatch(r"[a-z][a-z_]*_s", text):
            return "time/" + text
    return None


def metric_names() -> dict[str, set[str]]:
    """Every metric name in the source, with the modules that write or read it. Names built
    at run time keep their fields (`train/acc_k{k}`, `gpu/{i}/{name}`)."""
    found: dict[str, set[str]] = {}
    for path in sorted(SRC.rglob("*.py")):
        module = path.relative_to(SRC).as_posix()
        for node in ast.walk(ast.parse(path.read_text())):
            text = _pattern(node) or _stage_timer(node)
            if text and METRIC_NAME.fullmatch(text) and text != "time/{stage}":
                found.setdefault(_normal(text), set()).add(module)
    for name in _telemetry_fields():
        found.setdefault("gpu/{i}/" + name, set()).add("metrics/telemetry.py")
    # a prefix that code completes (`"train/acc_k"` + a number) is the templated name's
    templated = [name.split("{", 1)[0] for name in found if "{" in name]
    return {k: v for k, v in found.items() if k not in templated and "{name}" not in k}


def _normal(name: str) -> str:
    """`train/acc_k{k + 1}` and the prefix `train/acc_k` (code appends the offset) as
    `train/acc_k{k}`: one name per metric family."""
    name = re.sub(r"\{[^}]*?([A-Za-z_]\w*)[^}]*\}", r"{\1}", name)
    return name + "{k}" if name.endswith("_k") else name


def _telemetry_fields() -> list[str]:
    """The names of the NVML readings (`Telemetry._queries`)."""
    tree = ast.parse((SRC / "metrics" / "telemetry.py").read_text())
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and node.name == "_queries":
            for sub in ast.walk(node):
                if (
                    isinstance(sub, ast.Tuple)
                    and sub.elts
                    and isinstance(sub.elts[0], ast.Constant)
                ):
                    names.append(sub.elts[0].value)
    return names


def metrics_table() -> str:
    rows = [
        f"| `{name}` | {', '.join(f'`{m}`' for m in sorted(modules))} |"
        for name, modules in sorted(metric_names().items())
    ]
    return "| metric | where in `src/dflash_train/` |\n|---|---|\n" + "\n".join(rows)


# ============================================================================ faults


def fault_stages() -> str:
    """The fault plan's stages with the comment each carries in `faults.py`."""
    lines = (SRC / "faults.py").read_text().splitlines()
    from dflash_train.faults import STAGES

    rows = []
    for stage in STAGES:
        line = next(x for x in lines if x.strip().startswith(f'"{stage}",'))
        rows.append(f"| `{stage}` | {_cell(line.split('#', 1)[-1].strip())} |")
    return "| stage | where it fires |\n|---|---|\n" + "\n".join(rows)


# ============================================================================ the hook


def render(kind: str, arg: str) -> str:
    """The Markdown a marker stands for; an unknown marker fails the build."""
    if kind == "flags" and arg in all_parsers():
        return flags_page_part(arg)
    if kind == "commands" and not arg:
        return commands_table()
    if kind == "export-config" and arg in ("dflash", "dflash2"):
        return export_config(arg)
    if kind == "config" and not arg:
        return config_schema()
    if kind == "metrics" and not arg:
        return metrics_table()
    if kind == "fault-stages" and not arg:
        return fault_stages()
    raise ValueError(f"unknown generated part {kind!r} {arg!r}")


END = "<!-- end generated -->"


def expand(markdown: str, keep_markers: bool = False) -> str:
    """A page with each generated part rendered afresh: between its marker and the `END`
    line when `keep_markers` (the page as committed, readable as plain Markdown too), in
    their place otherwise (the site). A marker without its `END` (a new one) has no part yet."""
    markers = list(MARKER.finditer(markdown))
    out, pos = [], 0
    for i, m in enumerate(markers):
        limit = markers[i + 1].start() if i + 1 < len(markers) else len(markdown)
        end = markdown.find("\n" + END, m.end(), limit)
        part = render(m.group(1), m.group(2).strip())
        out.append(markdown[pos : m.start()])
        out.append(f"{m.group(0)}\n\n{part}\n\n{END}" if keep_markers else part)
        pos = m.end() if end < 0 else end + 1 + len(END)
    out.append(markdown[pos:])
    return "".join(out)


def on_page_markdown(markdown: str, **kwargs: Any) -> str:
    """MkDocs event: each generated part of the page rendered from the code."""
    return expand(markdown)


def write_pages(docs: Path) -> list[Path]:
    """Render every page's generated parts into the page itself (`python
    docs/hooks/reference.py`): the flags, config and metrics tables are then readable where
    Markdown is read without the site (a repository's web view, an editor). The pages changed."""
    changed = []
    for page in sorted(docs.rglob("*.md")):
        text = page.read_text()
        fresh = expand(text, keep_markers=True)
        if fresh != text:
            page.write_text(fresh)
            changed.append(page)
    return changed


if __name__ == "__main__":
    for path in write_pages(Path(__file__).resolve().parents[1]):
        print(f"wrote {path}")
