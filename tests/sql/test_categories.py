"""The category facts are defined once in Python and once in SQL: both must agree."""

from __future__ import annotations

import pytest
from django.apps import apps

import django_workpump.sql as sql_package
from django_workpump import registry
from django_workpump.admin import work
from django_workpump.categories import BY_NAME, CATEGORIES, NAMES, Category, category
from tests.helpers import run_sql, scalar

pytestmark = pytest.mark.django_db

ADMINS = {
    "outbox": work.OutboxAdmin,
    "inbox": work.InboxAdmin,
    "perspective_event": work.PerspectiveEventAdmin,
    "receptor": work.ReceptorProcessingAdmin,
}


@pytest.mark.parametrize("facts", CATEGORIES, ids=NAMES)
def test_sql_work_table_returns_the_same_facts(facts: Category):
    [row] = run_sql("SELECT * FROM workpump.work_table(%s)", [facts.name])
    assert row == {
        "tbl": facts.table,
        "key_col": "work_id",
        "done_col": "done_at",
        "topic_col": "topic",
        "scope_col": "topic" if facts.topic_scopes_streams else None,
    }


def test_sql_knows_exactly_these_categories():
    for name in NAMES:
        assert scalar("SELECT workpump.check_category(%s)", [name]) == name
    hint = run_sql(
        "SELECT p.prosrc FROM pg_proc p WHERE p.pronamespace = 'workpump'::regnamespace"
        " AND p.proname = 'check_category'"
    )[0]["prosrc"]
    assert f"Valid categories: {', '.join(NAMES)}." in hint
    claims = {
        r["proname"]
        for r in run_sql(
            "SELECT proname FROM pg_proc WHERE pronamespace = 'workpump'::regnamespace"
            " AND proname LIKE 'claim\\_%%' AND proname <> 'claim_work'"
        )
    }
    assert claims == {f"claim_{name}" for name in NAMES}


@pytest.mark.parametrize("facts", CATEGORIES, ids=NAMES)
def test_the_model_has_the_named_table_and_the_shared_column_names(facts: Category):
    model = apps.get_model("workpump", facts.model)
    assert model._meta.db_table == facts.table
    for name in ("work_id", "topic", "done_at"):
        assert model._meta.get_field(name).column == name
    own_payload = any(f.name == "payload" for f in model._meta.concrete_fields)
    assert own_payload == facts.payload_on_row


@pytest.mark.parametrize("facts", CATEGORIES, ids=NAMES)
def test_registry_and_admin_derive_from_the_categories(facts: Category):
    assert registry.TOPIC_NOUNS[facts.name] == facts.topic_noun
    spec = ADMINS[facts.name].spec
    assert (spec.category, spec.scoped) == (facts.name, facts.topic_scopes_streams)


def test_the_public_names_keep_their_values():
    assert registry.CATEGORIES == ("outbox", "inbox", "perspective_event", "receptor")
    assert list(BY_NAME) == list(registry.CATEGORIES)


def test_an_unknown_category_is_refused_by_name():
    with pytest.raises(ValueError, match="Unknown workpump category 'bogus'; valid categories"):
        category("bogus")


@pytest.mark.parametrize("facts", CATEGORIES, ids=NAMES)
def test_the_index_prefix_names_the_models_partial_indexes(facts: Category):
    model = apps.get_model("workpump", facts.model)
    names = {index.name for index in model._meta.indexes}
    assert {f"{facts.index_prefix}_ready", f"{facts.index_prefix}_done"} <= names


def test_a_query_part_written_once_is_repeated_for_each_category_in_order():
    body = (
        "SELECT 1\n-- each category, joined by UNION ALL\n"
        "SELECT '{category}', '{table}', '{index_prefix}_done', {topic_scopes_streams}\n"
        "-- end each"
    )
    lines = sql_package._each_category(body).splitlines()
    assert lines[0] == "SELECT 1"
    copies = [line for line in lines[1:] if line != "UNION ALL"]
    assert copies == [
        f"SELECT '{c.name}', '{c.table}', '{c.index_prefix}_done',"
        f" {str(c.topic_scopes_streams).lower()}"
        for c in CATEGORIES
    ]
    assert lines.count("UNION ALL") == len(CATEGORIES) - 1


def test_an_unclosed_category_part_is_refused():
    with pytest.raises(ValueError, match="end each"):
        sql_package._each_category("SELECT 1\n-- each category, joined by ,\nSELECT 2")


def test_the_status_report_reads_every_table():
    text = sql_package.named_queries("status.sql")["state_counts"]
    assert "{" + "table}" not in text
    for facts in CATEGORIES:
        assert f"FROM {facts.table} t" in text
        assert f"holders_{facts.name} AS (" in text
