"""Typed dataclasses as the single source of truth for command-line flags and YAML files.

Each dataclass field is documented once, by the string literal that follows it in the class body
(an "attribute docstring"). That text becomes the flag's `--help`. Field `foo_bar` becomes the flag
`--foo-bar`. Supported field types: `int`, `float`, `str`, `bool` (`--x` / `--no-x`), `Literal[...]`
(choices), `list[int]` / `list[str]` (comma-separated on the command line, lists in YAML), and any
of these `| None`.

A config is assembled in three layers, later ones winning: the dataclass defaults, a YAML file,
then the flags the user actually typed.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import inspect
import textwrap
import types
import typing
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

import yaml


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """Map each field of dataclass `cls` to the docstring written under it in the source."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        try:
            source = textwrap.dedent(inspect.getsource(klass))
        except (OSError, TypeError):
            continue
        body = ast.parse(source).body[0].body
        for node, nxt in zip(body, [*body[1:], None], strict=True):
            if (
                isinstance(node, ast.AnnAssign)
                and isinstance(node.target, ast.Name)
                and isinstance(nxt, ast.Expr)
                and isinstance(nxt.value, ast.Constant)
                and isinstance(nxt.value.value, str)
            ):
                docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


def _unwrap_optional(tp: Any) -> tuple[Any, bool]:
    origin = get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in get_args(tp) if a is not type(None)]
        if len(args) == 1 and len(get_args(tp)) == 2:
            return args[0], True
    return tp, False


def _field_types(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _parse_scalar(tp: Any, text: str) -> Any:
    if tp is bool:
        lowered = text.strip().lower()
        if lowered in ("1", "true", "yes", "on"):
            return True
        if lowered in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"expected a boolean, got {text!r}")
    return tp(text.strip())


def _converter(tp: Any, optional: bool):
    """An argparse `type=` callable for one field type."""

    def convert(text: str) -> Any:
        if optional and text.strip().lower() in ("none", "null", ""):
            return None
        origin = get_origin(tp)
        if origin is list:
            (item,) = get_args(tp)
            return [_parse_scalar(item, part) for part in text.split(",") if part.strip()]
        if origin is Literal:
            return text
        return _parse_scalar(tp, text)

    convert.__name__ = getattr(tp, "__name__", str(tp))
    return convert


def dataclass_fields(cls: type) -> list[dataclasses.Field]:
    """The fields of a (flat) options dataclass."""
    return [f for f in dataclasses.fields(cls) if f.init]


def add_arguments(parser: argparse.ArgumentParser, cls: type, *, title: str | None = None) -> None:
    """Add one flag per field of dataclass `cls`, with the field's docstring as help.

    Defaults are suppressed so that `parsed_overrides` can tell typed flags from untyped ones.
    """
    group = parser.add_argument_group(title or cls.__name__)
    hints = _field_types(cls)
    docs = field_docs(cls)
    for f in dataclass_fields(cls):
        tp, optional = _unwrap_optional(hints[f.name])
        flag = "--" + f.name.replace("_", "-")
        default = _default_of(f)
        help_text = docs.get(f.name, "")
        if default is not dataclasses.MISSING and default not in (None, ""):  # unset says nothing
            shown = ",".join(map(str, default)) if isinstance(default, list) else default
            help_text = f"{help_text} (default: {shown})"
        kwargs: dict[str, Any] = {"help": help_text, "default": argparse.SUPPRESS, "dest": f.name}
        if tp is bool and not optional:
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            kwargs["type"] = _converter(tp, optional)
            if get_origin(tp) is Literal:
                kwargs["choices"] = list(get_args(tp))
            kwargs["metavar"] = _metavar(tp)
        group.add_argument(flag, **kwargs)


def _metavar(tp: Any) -> str:
    origin = get_origin(tp)
    if origin is list:
        (item,) = get_args(tp)
        return f"{item.__name__.upper()},..."
    if origin is Literal:
        return "{" + ",".join(map(str, get_args(tp))) + "}"
    return getattr(tp, "__name__", "VALUE").upper()


def _default_of(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def parsed_overrides(args: argparse.Namespace, cls: type) -> dict[str, Any]:
    """The fields of `cls` that the user set on the command line."""
    return {f.name: getattr(args, f.name) for f in dataclass_fields(cls) if hasattr(args, f.name)}


def _coerce(cls: type, name: str, value: Any) -> Any:
    """Check and convert a YAML value for field `name` of `cls`."""
    tp, optional = _unwrap_optional(_field_types(cls)[name])
    if value is None:
        if not optional:
            raise ValueError(f"{name}: null is not allowed")
        return None
    origin = get_origin(tp)
    if origin is list:
        (item,) = get_args(tp)
        if isinstance(value, str):
            return _converter(tp, optional)(value)
        if not isinstance(value, list):
            raise ValueError(f"{name}: expected a list, got {value!r}")
        return [item(v) for v in value]
    if origin is Literal:
        return str(value)
    if tp is float and isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    if tp is bool and isinstance(value, str):
        return _parse_scalar(bool, value)
    if not isinstance(value, tp) or (tp is int and isinstance(value, bool)):
        raise ValueError(f"{name}: expected {tp.__name__}, got {value!r}")
    return value


def build(cls: type, *layers: dict[str, Any]) -> Any:
    """Instantiate flat dataclass `cls` from defaults overridden by each dict in `layers`."""
    return cls(**coerced(cls, *layers))


def coerced(cls: type, *layers: dict[str, Any]) -> dict[str, Any]:
    """The options `layers` set for flat dataclass `cls`, each checked and converted (later
    layers win); an unknown name or a value of the wrong type is one `ValueError`."""
    known = {f.name for f in dataclass_fields(cls)}
    values: dict[str, Any] = {}
    for layer in layers:
        for key, value in layer.items():
            name = key.replace("-", "_")
            if name not in known:
                raise ValueError(f"unknown option {key!r} for {cls.__name__}")
            values[name] = _coerce(cls, name, value)
    return values


def load_yaml(path: str | Path) -> dict[str, Any]:
    """Read a YAML mapping; a missing file or non-mapping content is a clear error."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"config file {p} does not exist")
    try:
        data = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as e:
        raise ValueError(f"config file {p} is not valid YAML: {e}") from e
    if not isinstance(data, dict):
        raise ValueError(f"config file {p} must hold a mapping of option names to values")
    return data


def to_dict(obj: Any) -> dict[str, Any]:
    """A dataclass (possibly nested) as plain JSON/YAML-ready data."""
    return dataclasses.asdict(obj)
