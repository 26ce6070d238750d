"""Bulk actions on a changelist's search result (django_workpump/admin/work_bulk.py):
counted and shown first, capped, run in chunks the page posts, fenced like the single-row
actions, and only for users with the action's permission."""

from __future__ import annotations

import re
from datetime import datetime, timedelta
from typing import Any

import pytest
from django.contrib.auth.models import Permission, User
from django.contrib.contenttypes.models import ContentType
from django.test import Client

from django_workpump import models
from django_workpump.admin import work_bulk, work_search
from tests import factories
from tests.helpers import scalar

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
