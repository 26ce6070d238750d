"""Docs rendered from the code cannot drift: the SQL API page from the installed functions,
the README's settings table from ``conf.SETTINGS``."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from django.db import connection

pytestmark = pytest.mark.django_db

DOCS = Path(__file__).resolve().parent.parent / "docs"


def load(name: str):
    """Import ``docs/<name>.py``, a script rather than a module of a package."""
    spec = importlib.util.spec_from_file_location(name, DOCS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_sql_api_page_matches_the_installed_functions():
    spec = importlib.util.spec_from_file_location("sql_api", DOCS / "sql_api.py")
    assert spec is not None and spec.loader is not None
    sql_api = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sql_api)
    with connection.cursor() as cursor:
        rendered = sql_api.render(cursor)
    assert "### `observe_alive_locks`" in rendered
    assert (DOCS / "sql-api.md").read_text(encoding="utf-8") == rendered, (
        "docs/sql-api.md is out of date: DATABASE_URL=... python docs/sql_api.py > docs/sql-api.md"
    )


def test_the_readme_settings_table_matches_conf_settings():
    settings_table = load("settings_table")
    readme = settings_table.README.read_text(encoding="utf-8")
    assert "| `LEASE_SECONDS` | 300 | a claimed row is held this long unless renewed |" in (
        settings_table.render()
    )
    assert settings_table.splice(readme) == readme, (
        "README.md's settings table differs from django_workpump.conf.SETTINGS: "
        "run python docs/settings_table.py"
    )


def test_the_settings_table_has_a_row_per_setting():
    from django_workpump.conf import DEFAULTS

    rows = load("settings_table").render().splitlines()[2:]
    assert [row.split("`")[1] for row in rows] == list(DEFAULTS)
