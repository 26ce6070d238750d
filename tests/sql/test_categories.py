"""The category facts are defined once in Python and once in SQL: both must agree."""

from __future__ import annotations

import pytest
from django.apps import apps

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
            " AND proname LIKE 'claim\\_%%' AND proname NOT IN ('claim_work', 'claim_topics')"
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
