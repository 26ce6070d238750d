"""Render the settings table of docs/settings.md from ``django_workpump.conf.SETTINGS``.

    python docs/settings_table.py

rewrites the table between the settings-table markers of docs/settings.md. Each row is
one key: its name, its default and its meaning as the table in ``conf.py`` declares them.
tests/api/test_docs.py fails when the committed page differs from what this renders.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

PAGE = Path(__file__).resolve().parent / "settings.md"
START = "<!-- settings-table:start -->"
END = "<!-- settings-table:end -->"


def _default(value: Any) -> str:
    return f'`"{value}"`' if isinstance(value, str) else str(value)


def _meaning(text: str) -> str:
    # conf.py links pages from the repository root; the table lives in docs/ beside them
    return text.replace("](docs/", "](").replace("(docs/", "(")


def render() -> str:
    """The Markdown table of every setting, one row per key, in the table's order."""
    from django_workpump.conf import SETTINGS

    rows = ["| key | default | meaning |", "|---|---|---|"]
    rows += [f"| `{s.name}` | {_default(s.default)} | {_meaning(s.meaning)} |" for s in SETTINGS]
    return "\n".join(rows) + "\n"


def splice(page: str) -> str:
    """``page`` with the text between the markers replaced by the rendered table."""
    head, start, rest = page.partition(START)
    _, end, tail = rest.partition(END)
    if not start or not end:
        raise ValueError(f"{PAGE.name} must hold the markers {START} and {END}, in that order.")
    return f"{head}{START}\n{render()}{END}{tail}"


def main() -> None:
    current = PAGE.read_text(encoding="utf-8")
    updated = splice(current)
    if updated != current:
        PAGE.write_text(updated, encoding="utf-8")
    sys.stdout.write(
        f"docs/{PAGE.name}: settings table {'updated' if updated != current else 'up to date'}.\n"
    )


if __name__ == "__main__":
    main()
