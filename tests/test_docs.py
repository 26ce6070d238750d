"""The SQL API page is rendered from the installed functions, so it cannot drift."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from django.db import connection

pytestmark = pytest.mark.django_db

DOCS = Path(__file__).resolve().parent.parent / "docs"


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
