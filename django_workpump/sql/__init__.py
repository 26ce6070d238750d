"""SQL sources.

``schema.sql`` is the current workpump schema, whole; migrations load the deltas that
build it, ``v<N>/*.sql``; ``db.py`` loads the named queries.
"""

from __future__ import annotations

import re
from functools import cache
from importlib.resources import files

_NAME = re.compile(r"^--\s*name:\s*(\w+)\s*$", re.MULTILINE)
# A dollar-quoted function, up to its closing line; never across the next CREATE, so a
# function with a SQL-standard body (no $$) does not swallow the one after it.
_FUNCTION = re.compile(
    r"^CREATE (?:OR REPLACE )?FUNCTION workpump\.(\w+)\((?:(?!^CREATE ).)*?^\$\$;$",
    re.MULTILINE | re.DOTALL,
)

# Every migration that creates or restores functions ends with this (schema v6 on).
PIN_SEARCH_PATH = "SELECT workpump.pin_search_path();"


def read(path: str) -> str:
    """Return the text of one SQL source, e.g. ``read("v1/claim.sql")``."""
    return (files(__package__) / path).read_text(encoding="utf-8")


def function_definitions(path: str, names: list[str]) -> list[str]:
    """Return the ``CREATE FUNCTION`` statements of ``names`` in one SQL source, in order.

    A migration that replaces functions restores their earlier versions with these on
    reverse, so released SQL is never copied or edited.
    """
    found = {m.group(1): m.group(0) for m in _FUNCTION.finditer(read(path))}
    missing = [name for name in names if name not in found]
    if missing:
        raise ValueError(f"{path} defines no function {', '.join(missing)}.")
    return [found[name] for name in names]


def replacing_definitions(path: str, names: list[str]) -> list[str]:
    """``function_definitions`` as ``CREATE OR REPLACE`` statements (a reverse migration)."""
    return [
        definition.replace("CREATE FUNCTION", "CREATE OR REPLACE FUNCTION", 1)
        for definition in function_definitions(path, names)
    ]


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
