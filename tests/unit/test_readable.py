"""The pipeline and the trainer stay readable: no function over 60 lines (issue 34)."""

from __future__ import annotations

import ast
from pathlib import Path

import dflash_train

MAX_LINES = 60
PACKAGES = ("pipeline", "train")


def test_no_function_in_the_pipeline_or_the_trainer_is_over_60_lines():
    root = Path(dflash_train.__file__).parent
    long = []
    for pkg in PACKAGES:
        for path in sorted((root / pkg).glob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                    lines = node.end_lineno - node.lineno + 1
                    if lines > MAX_LINES:
                        long.append(f"{pkg}/{path.name}:{node.lineno} {node.name} ({lines})")
    assert not long, long
