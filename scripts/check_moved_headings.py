"""Check that every section of an old README landed on a page of the docs site.

    python scripts/check_moved_headings.py OLD_README.md   # e.g. from `git show REV:README.md`

Each heading of the old README (outside code blocks) must be a heading, at any level, or a line
of its own (a command page's synopsis) of some page under docs/, or be listed below as renamed
or replaced; it prints where each one went and exits 1 if any went nowhere.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parents[1] / "docs"
# Sections replaced rather than moved, and by what.
REPLACED = {
    "Contents": "the site's navigation (mkdocs.yml nav)",
    "Performance": "measurements/index.md, retitled Measurements",
    "On a real model": "get-started/first-model.md, retitled A real model, end to end",
}


def headings(text: str) -> list[str]:
    """Heading texts of a Markdown file, code blocks skipped."""
    out, fenced = [], False
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and (m := re.match(r"#{1,6} (.+)$", line)):
            out.append(m.group(1).strip())
    return out


def main(argv: list[str]) -> int:
    old = headings(Path(argv[0]).read_text())
    pages = {
        p: set(headings(p.read_text())) | set(p.read_text().splitlines())
        for p in sorted(DOCS.rglob("*.md"))
    }
    missing = []
    for heading in old:
        where = [str(p.relative_to(DOCS)) for p, hs in pages.items() if heading in hs]
        if heading in REPLACED:
            where = [f"replaced by {REPLACED[heading]}"]
        print(f"{heading[:70]:<72} -> {', '.join(where) or 'NOWHERE'}")
        if not where:
            missing.append(heading)
    print(f"{len(old) - len(missing)} of {len(old)} headings found on a page")
    return 1 if missing else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
