"""SQL sources.

``schema.sql`` is the current workpump schema, whole, and the migrations load it;
the ``db`` package loads the named queries of the other files.

A named query that reads every work table alike writes the part once, between
``-- each category, joined by <SQL>`` and ``-- end each`` lines: the part is repeated for
each category, in ``categories.CATEGORIES`` order, with ``{category}``, ``{table}``,
``{index_prefix}`` and ``{topic_scopes_streams}`` (``true`` or ``false``) filled in, and
the copies joined by ``<SQL>`` (``UNION ALL``, ``,``).
"""

from __future__ import annotations

import re
from functools import cache
from importlib.resources import files

from django_workpump.categories import CATEGORIES

_NAME = re.compile(r"^--\s*name:\s*(\w+)\s*$", re.MULTILINE)
_EACH = re.compile(
    r"^[ \t]*-- each category, joined by (?P<joiner>.+?)[ \t]*\n"
    r"(?P<part>.*?)^[ \t]*-- end each[ \t]*$",
    re.MULTILINE | re.DOTALL,
)

# Every migration that creates or replaces functions ends with this (schema.sql does too).
PIN_SEARCH_PATH = "SELECT workpump.pin_search_path();"


def read(path: str) -> str:
    """Return the text of one SQL source, e.g. ``read("schema.sql")``."""
    return (files(__package__) / path).read_text(encoding="utf-8")


@cache
def named_queries(path: str = "queries.sql") -> dict[str, str]:
    """Return ``{name: sql}`` for every ``-- name: x`` block of a query file."""
    text = read(path)
    parts = _NAME.split(text)
    # parts = [preamble, name1, body1, name2, body2, ...]
    queries = {}
    for name, body in zip(parts[1::2], parts[2::2], strict=True):
        if name in queries:
            raise ValueError(f"Query {name!r} is defined twice in {path}.")
        queries[name] = _each_category(body.strip().rstrip(";"))
    return queries


def _each_category(body: str) -> str:
    """``body`` with each ``-- each category`` part written out once per category."""

    def expand(match: re.Match[str]) -> str:
        copies = []
        for category in CATEGORIES:
            part = match["part"].rstrip("\n")
            for token, value in (
                ("{category}", category.name),
                ("{table}", category.table),
                ("{index_prefix}", category.index_prefix),
                ("{topic_scopes_streams}", str(category.topic_scopes_streams).lower()),
            ):
                part = part.replace(token, value)
            copies.append(part)
        return f"\n{match['joiner']}\n".join(copies)

    expanded = _EACH.sub(expand, body)
    if "-- each category" in expanded or "-- end each" in expanded:
        raise ValueError("An '-- each category' part has no '-- end each' line, or the reverse.")
    return expanded
