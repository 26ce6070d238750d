"""Bulk actions on a changelist's search result (django_workpump/admin/work_bulk.py):
counted and shown first, capped, run in chunks the page posts, fenced like the single-row
actions, and only for users with the action's permission."""

from __future__ import annotations

import re
import threading
from datetime import datetime, timedelta
from typing import Any

import pytest
from django.contrib.auth.models import Permission, User
from django.contrib.contenttypes.models import ContentType
from django.contrib.messages import get_messages
from django.db import connection
from django.test import Client

from django_workpump import models
from django_workpump.admin import work_bulk, work_search
from tests import factories
from tests.helpers import run_sql, scalar, wait_until

pytestmark = pytest.mark.django_db

BULK = "/admin/workpump/outbox/bulk/"


@pytest.fixture
def now() -> datetime:
    return scalar("SELECT now()")  # type: ignore[no-any-return]


def client_with(*codenames: str) -> Client:
    user = User.objects.create_user("op", password="pw", is_staff=True)
    content_type = ContentType.objects.get_for_model(models.Outbox)
    user.user_permissions.add(
        *Permission.objects.filter(content_type=content_type, codename__in=codenames)
    )
    client = Client()
    client.force_login(user)
    return client


def scheduled(now: datetime, n: int, topic: str = "bulk.mail") -> list[models.Outbox]:
    return [
        factories.OutboxFactory(topic=topic, scheduled_for=now + timedelta(hours=1), attempts=1)
        for _ in range(n)
    ]


def leased(now: datetime, heartbeat_age: float, topic: str = "bulk.mail") -> models.Outbox:
    holder = factories.ServiceInstanceFactory(
        last_heartbeat_at=now - timedelta(seconds=heartbeat_age)
    )
    return factories.OutboxFactory(
        topic=topic,
        instance_id=holder.instance_id,
        lease_expiry=now + timedelta(seconds=200),
        claimed_at=now - timedelta(seconds=10),
        attempts=1,
    )


def follow(client: Client, url: str, data: dict[str, Any]) -> tuple[Any, int]:
    """Post the first chunk, then each next chunk the page posts; the last response and
    how many requests it took."""
    response = client.post(url, data)
    requests = 1
    while response.status_code == 200 and b'id="wp-bulk-next"' in response.content:
        fields = dict(
            re.findall(rb'<input type="hidden" name="(\w+)" value="([^"]*)">', response.content)
        )
        data = {k.decode(): v.decode() for k, v in fields.items() if k != b"csrfmiddlewaretoken"}
        response = client.post(url, data)
        requests += 1
    return response, requests


def reload(rows: list[models.Outbox]) -> list[models.Outbox]:
    return [models.Outbox.objects.get(pk=row.pk) for row in rows]


def test_the_page_counts_the_search_result_and_names_the_running_rows(admin_client, now):
    scheduled(now, 3)
    running = leased(now, heartbeat_age=2)
    leased(now, heartbeat_age=3600)  # its holder is not live: not running
    scheduled(now, 2, topic="bulk.other")  # outside the search

    html = admin_client.get(f"{BULK}cancel/?topic=bulk.mail").content.decode()

    assert re.search(r"<strong>5</strong> outbox messages match this search", html), html
    assert "<strong>1</strong> of them run now" in html
    assert str(running.work_id) in html


def test_the_page_of_a_payload_search_says_once_that_it_was_narrowed(
    admin_client, now, monkeypatch
):
    monkeypatch.setattr(work_search, "PAYLOAD_SCAN_ROWS", 1)
    factories.OutboxFactory(topic="bulk.mail", payload={"tenant": "acme"}, created_at=now)
    factories.OutboxFactory(topic="bulk.mail", payload={"tenant": "acme"}, created_at=now)

    html = admin_client.get(f"{BULK}retry/?q=tenant%3Dacme").content.decode()

    assert re.search(r"<strong>1</strong> outbox message", html), html
    assert html.count("The payload search read the newest 1 rows only") == 1


def test_a_bulk_retry_changes_only_the_scheduled_rows_of_the_search(admin_client, now):
    mine, other = scheduled(now, 4), scheduled(now, 2, topic="bulk.other")
    done = factories.OutboxFactory(topic="bulk.mail", done_at=now)

    response, _ = follow(admin_client, f"{BULK}retry/?topic=bulk.mail", {"cursor": "0"})

    assert response.status_code == 302 and "topic=bulk.mail" in response["Location"]
    assert all(row.scheduled_for is None for row in reload(mine))
    assert all(row.scheduled_for is not None for row in reload(other))
    assert reload([done])[0].done_at is not None


def test_it_is_capped_and_runs_in_batches_of_one_transaction_each_over_several_requests(
    admin_client, now, monkeypatch
):
    monkeypatch.setattr(work_bulk, "BULK_MAX_ROWS", 5)
    monkeypatch.setattr(work_bulk, "BULK_BATCH_ROWS", 2)
    monkeypatch.setattr(work_bulk, "BULK_REQUEST_SECONDS", 0.0)  # one batch per request
    rows = scheduled(now, 7)

    html = admin_client.get(f"{BULK}retry/?topic=bulk.mail").content.decode()
    assert "more than 5: only the first 5 (oldest first) are acted on" in html
    response, requests = follow(admin_client, f"{BULK}retry/?topic=bulk.mail", {"cursor": "0"})

    assert response.status_code == 302
    assert requests == 3  # 2 + 2 + 1 rows
    assert [row.scheduled_for is None for row in reload(rows)] == [True] * 5 + [False] * 2


def test_a_live_holders_lease_is_not_released_without_the_force_permission(now):
    running = leased(now, heartbeat_age=2)
    orphan = leased(now, heartbeat_age=3600)
    client = client_with("view_outbox", "release_work_lease")

    # without force: the live holder keeps its row; the dead holder's is released
    response, _ = follow(client, f"{BULK}release/", {"cursor": "0"})
    assert response.status_code == 302
    running_now, orphan_now = reload([running, orphan])
    assert running_now.instance_id == running.instance_id
    assert orphan_now.instance_id is None
    # asking for force without the permission is refused, and changes nothing
    assert client.post(f"{BULK}release/", {"cursor": "0", "force": "yes"}).status_code == 403
    assert reload([running])[0].instance_id == running.instance_id


def test_force_releases_a_live_holders_lease_for_a_user_with_the_permission(now):
    running = leased(now, heartbeat_age=2)
    client = client_with("view_outbox", "release_work_lease", "force_release_work_lease")
    response, _ = follow(client, f"{BULK}release/", {"cursor": "0", "force": "yes"})
    assert response.status_code == 302
    assert reload([running])[0].instance_id is None


def test_cancel_leaves_running_rows_alone_unless_ticked(admin_client, now):
    running, waiting = leased(now, heartbeat_age=2), scheduled(now, 1)[0]
    follow(admin_client, f"{BULK}cancel/", {"cursor": "0"})
    assert reload([running])[0].end_state is None
    assert reload([waiting])[0].end_state == "cancelled"
    follow(admin_client, f"{BULK}cancel/", {"cursor": "0", "force": "yes"})
    assert reload([running])[0].end_state == "cancelled"


def test_a_bulk_dead_letter_parks_the_undone_rows_of_the_search_in_the_admins_name(
    admin_client, now, caplog, django_capture_on_commit_callbacks
):
    mine, other = scheduled(now, 2), scheduled(now, 1, topic="bulk.other")
    running = leased(now, heartbeat_age=2)
    orphan = leased(now, heartbeat_age=3600)  # its holder is not live: parked like the rest
    done = factories.OutboxFactory(topic="bulk.mail", done_at=now)

    with django_capture_on_commit_callbacks(execute=True):
        response, _ = follow(admin_client, f"{BULK}dead-letter/?topic=bulk.mail", {"cursor": "0"})

    assert response.status_code == 302
    assert [str(m.message) for m in get_messages(response.wsgi_request)] == [
        "Dead-letter: went through 5 outbox messages; changed 3, left 2 as they were (only "
        "undone rows change; 1 running on a live instance was left alone)."
    ]
    parked = reload([*mine, orphan])
    assert all(row.dead_lettered_at is not None for row in parked)
    assert {row.failure_reason for row in parked} == {"dead-lettered in the admin by admin"}
    assert parked[-1].instance_id is None  # the orphan's stale lease went with it
    running_now, done_now, other_now = reload([running, done, *other])
    assert (running_now.dead_lettered_at, running_now.instance_id) == (None, running.instance_id)
    assert done_now.dead_lettered_at is None and other_now.dead_lettered_at is None
    # one ERROR line per parked row, naming the user and that it was a bulk action
    errors = [r for r in caplog.records if getattr(r, "action", None) == "dead_lettered"]
    assert sorted(r.workpump_id for r in errors) == sorted(str(row.work_id) for row in parked)
    assert {r.workpump_by for r in errors} == {"'admin' in the admin (bulk)"}
    assert all(
        r.levelname == "ERROR" and "by 'admin' in the admin" in r.getMessage() for r in errors
    )


def test_a_bulk_dead_letter_parks_a_running_row_only_when_ticked(admin_client, now):
    running = leased(now, heartbeat_age=2)

    follow(admin_client, f"{BULK}dead-letter/", {"cursor": "0"})
    assert reload([running])[0].dead_lettered_at is None

    follow(admin_client, f"{BULK}dead-letter/", {"cursor": "0", "force": "yes"})
    parked = reload([running])[0]
    # parked, and the live holder's lease taken from it (its outcome will be fenced out)
    assert parked.dead_lettered_at is not None and parked.instance_id is None


def dead(now: datetime, topic: str = "bulk.mail") -> models.Outbox:
    return factories.OutboxFactory(
        topic=topic,
        attempts=5,
        max_attempts=5,
        claimed_at=now - timedelta(minutes=1),
        dead_lettered_at=now,
        failure_reason="handler_error",
        last_error="KeyError: 'x'",
    )


def test_a_bulk_requeue_puts_the_dead_rows_of_the_search_back_to_pending(admin_client, now):
    mine, other = [dead(now), dead(now)], dead(now, topic="bulk.other")
    waiting = scheduled(now, 1)[0]  # in the search but not dead: left as it was

    response, _ = follow(admin_client, f"{BULK}requeue/?topic=bulk.mail", {"cursor": "0"})

    assert response.status_code == 302
    for row in reload(mine):
        # requeue_dead: a fresh set of attempts, due now, the last error kept for history
        assert row.dead_lettered_at is None and row.scheduled_for is None
        assert row.claimed_at is None
        assert (row.attempts, row.last_error) == (0, "KeyError: 'x'")
    other_now, waiting_now = reload([other, waiting])
    assert (other_now.dead_lettered_at, other_now.attempts) == (now, 5)
    assert (waiting_now.scheduled_for, waiting_now.attempts) == (waiting.scheduled_for, 1)
    # pending: a claim now leases exactly the re-queued rows (the rest is dead or not due)
    instance = factories.ServiceInstanceFactory(last_heartbeat_at=now)
    claimed = run_sql(
        "SELECT work_id, lease_token"
        " FROM workpump.claim_work(p_instance_id => %s, p_max_rows => 10)",
        [instance.instance_id],
    )
    # with a lease token: leased to run, not parked for having no attempts left
    assert {r["work_id"] for r in claimed if r["lease_token"]} == {row.work_id for row in mine}
    assert len(claimed) == 2


def test_a_viewer_sees_the_page_but_cannot_act(now):
    rows = scheduled(now, 2)
    viewer = client_with("view_outbox")
    page = viewer.get(f"{BULK}retry/")
    assert page.status_code == 200
    assert b"You may see these rows but not retry now them" in page.content
    assert b"Yes, retry now these rows" not in page.content
    assert viewer.post(f"{BULK}retry/", {"cursor": "0"}).status_code == 403
    assert all(row.scheduled_for is not None for row in reload(rows))


def test_an_unknown_action_or_a_user_without_view_permission_is_refused(admin_client):
    assert admin_client.get(f"{BULK}explode/").status_code == 403
    assert client_with().get(f"{BULK}retry/").status_code == 403


@pytest.mark.django_db(transaction=True)
def test_a_row_claimed_while_a_batch_waits_for_its_lock_is_seen_as_running(raw_connect):
    # A claim leases the row but has not committed when the batch first reads the search
    # result (the row looks pending then). The batch's lock waits for the claim's commit;
    # what it decides must come from the row as it is once locked, or a cancel without
    # "also the running rows" would end a row a live instance is running.
    now = scalar("SELECT now()")
    row = factories.OutboxFactory(topic="bulk.race", created_at=now - timedelta(seconds=5))
    instance = factories.ServiceInstanceFactory(last_heartbeat_at=now)
    User.objects.create_superuser("racer", password="pw")
    client = Client()
    client.force_login(User.objects.get(username="racer"))

    claimer = raw_connect()
    claimer.execute("BEGIN")
    (claimed,) = claimer.execute(
        "SELECT work_id FROM workpump.claim_work(%s, 10) WHERE lease_token IS NOT NULL",
        [instance.instance_id],
    ).fetchall()
    assert claimed["work_id"] == row.work_id

    done: dict[str, Any] = {}

    def cancel() -> None:
        try:
            done["response"] = follow(client, f"{BULK}cancel/?q=bulk.race", {"cursor": "0"})[0]
        finally:
            connection.close()  # this thread's own

    worker = threading.Thread(target=cancel)
    worker.start()
    watcher = raw_connect()
    # the batch has read the row and now waits for the claim's row lock
    assert wait_until(
        lambda: (
            watcher.execute(
                "SELECT count(*) AS n FROM pg_stat_activity WHERE datname = current_database()"
                " AND wait_event_type = 'Lock' AND query LIKE %s",
                ["%FOR UPDATE%"],
            ).fetchone()["n"]
            == 1
        )
    )
    claimer.execute("COMMIT")
    worker.join(timeout=30)
    assert not worker.is_alive() and done["response"].status_code in (200, 302)

    row = models.Outbox.objects.get(pk=row.pk)
    assert row.end_state is None and row.instance_id == instance.instance_id
