"""SQL sources.

``schema.sql`` is the current workpump schema, whole, and the migrations load it;
the ``db`` package loads the named queries of the other files.
"""

from __future__ import annotations

import re
from functools import cache
from importlib.resources import files

_NAME = re.compile(r"^--\s*name:\s*(\w+)\s*$", re.MULTILINE)

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
        queries[name] = body.strip().rstrip(";")
    return queries
