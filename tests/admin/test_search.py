"""The work changelists' search (django_workpump/admin/work_search.py): ids and id
prefixes, time windows, payload content, the narrowing of payload searches, and clear
messages for terms that mean nothing."""

from __future__ import annotations

import io
import re
import uuid
from datetime import timedelta

import pytest
from django.contrib.messages import get_messages
from django.db import connection, transaction
from django.utils import timezone

from django_workpump import db, models
from django_workpump.admin import work_search
from tests import factories

pytestmark = pytest.mark.django_db

OUTBOX = "/admin/workpump/outbox/"


def listed(admin_client, query: dict[str, str]) -> tuple[set[str], list[str]]:
    response = admin_client.get(OUTBOX, query)
    html = response.content.decode()
    ids = set(re.findall(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}", html))
    return ids, [str(m) for m in get_messages(response.wsgi_request)]


def test_a_payload_search_by_key_value_and_by_json_finds_the_rows_that_contain_it(
    admin_client, monkeypatch
):
    monkeypatch.setattr(work_search, "PAYLOAD_SCAN_ROWS", 3)
    now = timezone.now()
    # older than the newest 3 rows: a payload search without the index does not read it
    older = factories.OutboxFactory(topic="s.mail", payload={"user_id": 7}, created_at=now)
    seven = factories.OutboxFactory(
        topic="s.mail", payload={"user_id": 7, "plan": {"tier": "pro"}}, created_at=now
    )
    eight = factories.OutboxFactory(topic="s.mail", payload={"user_id": 8}, created_at=now)
    text = factories.OutboxFactory(topic="s.mail", payload={"user_id": "7"}, created_at=now)

    found, notes = listed(admin_client, {"q": "user_id=7"})
    assert str(seven.work_id) in found and str(eight.work_id) not in found
    assert str(text.work_id) not in found  # 7 is JSON: the number, not the text
    assert any("read the newest 3 rows only" in n for n in notes), notes
    assert str(older.work_id) not in found
    # with the topic filter too: still the newest rows (there is no index on the topic)
    found, notes = listed(admin_client, {"q": "user_id=7", "topic": "s.mail"})
    assert str(older.work_id) not in found and notes
    # a table of no more rows than that (by seq: other tests' rows took numbers) is
    # read whole, with no note
    monkeypatch.setattr(work_search, "PAYLOAD_SCAN_ROWS", 10**12)
    found, notes = listed(admin_client, {"q": "user_id=7"})
    assert str(older.work_id) in found and not notes

    found, _ = listed(admin_client, {"q": 'user_id="7"'})
    assert str(text.work_id) in found and str(seven.work_id) not in found
    found, _ = listed(admin_client, {"q": '{"plan": {"tier": "pro"}}', "topic": "s.mail"})
    assert found >= {str(seven.work_id)} and str(eight.work_id) not in found
    found, _ = listed(admin_client, {"q": "plan.tier=pro user_id=7"})
    assert str(seven.work_id) in found


def test_an_id_prefix_finds_its_row_and_a_time_window_bounds_creation(admin_client):
    row = factories.OutboxFactory(created_at=timezone.now())
    other = factories.OutboxFactory(created_at=timezone.now())
    old = factories.OutboxFactory(created_at=timezone.now() - timedelta(days=3))
    prefix = str(row.work_id)[:8]
    found, _ = listed(admin_client, {"q": f"id:{prefix}"})
    assert str(row.work_id) in found and str(other.work_id) not in found

    since = (timezone.now() - timedelta(days=1)).strftime("%Y-%m-%dT%H:%M")
    found, _ = listed(admin_client, {"q": f"after:{since}"})
    assert str(row.work_id) in found and str(old.work_id) not in found


@pytest.mark.parametrize(
    ("term", "says"),
    [
        ("id:xyz", "an id prefix is 4 to 32 hex digits"),
        ("after:yesterday", "not a time"),
        ("=7", "a payload term is key=value"),
        ('{"user_id": ', "is not valid JSON"),
        ('{"a": 1} x', "is not valid JSON"),
    ],
)
def test_bad_terms_get_a_clear_message_and_no_rows(admin_client, term, says):
    factories.OutboxFactory()
    found, notes = listed(admin_client, {"q": term})
    assert found == set()
    assert any(n.startswith("Search: ") and says in n for n in notes), notes


def explain(queryset) -> str:
    sql, params = queryset.query.sql_with_params()
    with connection.cursor() as cursor:
        cursor.execute("SET LOCAL enable_seqscan = off")
        cursor.execute(f"EXPLAIN {sql}", params)
        return "\n".join(row[0] for row in cursor.fetchall())


def test_explain_an_id_prefix_is_a_range_of_the_work_id_index_and_a_payload_search_is_narrowed():
    prefix, _ = work_search.condition(
        work_search.parse("id:3f2a9c"), payload_field="payload", newest_seq=None
    )
    plan = explain(models.Outbox.objects.filter(prefix))
    assert "workpump_outbox_work_id" in plan and "Index" in plan, plan
    assert "3f2a9c00-0000-0000-0000-000000000000" in plan, plan

    payload, note = work_search.condition(
        work_search.parse("user_id=7"), payload_field="payload", newest_seq=10**7
    )
    assert note is not None
    plan = explain(models.Outbox.objects.filter(payload))
    # the newest rows only: a range of the primary key, then the containment
    assert "workpump_outbox_pkey" in plan and "seq > 9900000" in plan, plan
    assert "payload @>" in plan, plan


def test_a_uuid_search_still_finds_the_exact_row(admin_client):
    row = factories.OutboxFactory()
    found, _ = listed(admin_client, {"q": str(row.work_id)})
    assert str(row.work_id) in found
    assert uuid.UUID(str(row.work_id))


@pytest.mark.django_db(transaction=True)
def test_the_opt_in_payload_index_serves_a_payload_search_over_the_whole_table():
    from django.core.management import call_command

    search, _ = work_search.condition(
        work_search.parse("user_id=7"), payload_field="payload", newest_seq=None
    )
    assert not db.payload_index_ready("wp_outbox_payload")
    call_command("workpump_payload_index", stdout=io.StringIO())
    try:
        # the admin then searches the whole table: no narrowing, no note
        assert db.payload_index_ready("wp_outbox_payload")
        assert db.payload_index_ready("wp_event_payload")
        with transaction.atomic():
            plan = explain(models.Outbox.objects.filter(search))
        assert "wp_outbox_payload" in plan, plan
        # A perspective's payload is its event's. On tables this small the planner may
        # reach the event through another index, so the containment is planned alone, with
        # only bitmap scans allowed: only an index built for @> can serve it.
        with transaction.atomic(), connection.cursor() as cursor:
            cursor.execute("SET LOCAL enable_indexscan = off")
            plan = explain(models.Event.objects.filter(payload__contains={"user_id": 7}))
        assert "wp_event_payload" in plan, plan
    finally:
        call_command("workpump_payload_index", "--drop", stdout=io.StringIO())
    with transaction.atomic():
        assert "wp_outbox_payload" not in explain(models.Outbox.objects.filter(search))
