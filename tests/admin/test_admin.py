"""The Django admin of the work pump (django_workpump/admin/), through Django's test client.

Covers: every page renders for a staff user with the right permissions and is refused
without them; the changelist columns (state, lease expiry absolute and relative,
attempts, renewals, owner, owner heartbeat age, short error); the state and stuck
filters; search and the owner filter; the detail page (formatted payload, full error,
the stream's neighbours) and a change form that exposes no lease column; each action
changing exactly its rows and refusing the rest, gated by its own per-model permission;
the instances page (heartbeat colour, alive-lock from pg_locks, listener, rows held)
and eviction; stream ownership; the summary matching ``workpump_status --json``; and
pinned query counts. Each test runs in one transaction, so ``now()`` (the clock every
annotation uses) is fixed and rows are made relative to it.
"""

from __future__ import annotations

import io
import json
import re
import uuid
from datetime import datetime, timedelta
from typing import Any

import pytest
from django.contrib.auth.models import Permission, User
from django.contrib.contenttypes.models import ContentType
from django.contrib.messages import get_messages
from django.core.management import call_command
from django.db import connection
from django.test import Client, override_settings
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

import django_workpump as workpump
from django_workpump import models
from django_workpump.admin import display, work_actions
from tests import factories
from tests.helpers import scalar

pytestmark = pytest.mark.django_db

ALIVE_NAMESPACE = 1464877377  # workpump.lock_namespace('alive')
WORK_MODELS = [models.Outbox, models.Inbox, models.PerspectiveEvent, models.ReceptorProcessing]
OPERATOR_CODENAMES = [
    "retry_work",
    "release_work_lease",
    "force_release_work_lease",
    "dead_letter_work",
    "requeue_work",
    "cancel_work",
]
VIEWABLE = [*WORK_MODELS, models.ServiceInstance, models.Eviction, models.ActiveStream]
OUTBOX_URL = "/admin/workpump/outbox/"
INBOX_URL = "/admin/workpump/inbox/"
INSTANCES_URL = "/admin/workpump/serviceinstance/"
SUMMARY_URL = "/admin/workpump/serviceinstance/summary/"
STREAMS_URL = "/admin/workpump/activestream/"
LIST_URLS = [
    OUTBOX_URL,
    INBOX_URL,
    "/admin/workpump/perspectiveevent/",
    "/admin/workpump/receptorprocessing/",
    INSTANCES_URL,
    "/admin/workpump/eviction/",
    STREAMS_URL,
    SUMMARY_URL,
    "/admin/workpump/",
]

# Queries of one page, pinned (see test_..._query_count_...): session + user, then the
# page's own. They do not grow with the number of rows shown.
OUTBOX_CHANGELIST_QUERIES = 7  # session, user, SET LOCAL jit, count, page, topic and owner filters
OPERATOR_EXTRA_QUERIES = 3  # user perms, group perms, per-model workpump perms (non-superuser)
INSTANCES_CHANGELIST_QUERIES = 7  # session, user, SET LOCAL jit, count, page, service, host
STREAMS_CHANGELIST_QUERIES = 6  # session, user, SET LOCAL jit, count, page, category filter
SUMMARY_QUERIES = 12  # session, user, SET LOCAL jit and status.collect()'s nine
DETAIL_QUERIES = 7  # session, user, SET LOCAL jit, row, neighbours before and after, logs


# -- helpers -------------------------------------------------------------------------------


@pytest.fixture
def now() -> datetime:
    """The database clock of this test's transaction (what every annotation uses)."""
    return scalar("SELECT now()")  # type: ignore[no-any-return]


def secs(value: float) -> timedelta:
    return timedelta(seconds=value)


def perm(model: type[Any], codename: str) -> Permission:
    content_type = ContentType.objects.get_for_model(model)
    return Permission.objects.get(content_type=content_type, codename=codename)


def staff(username: str, *grants: tuple[type[Any], str]) -> User:
    user = User.objects.create_user(username, password="pw", is_staff=True)
    user.user_permissions.add(*(perm(model, codename) for model, codename in grants))
    return user


def client_for(user: User) -> Client:
    client = Client()
    client.force_login(user)
    return client


def view_all() -> list[tuple[type[Any], str]]:
    return [(model, f"view_{model._meta.model_name}") for model in VIEWABLE]


def row_cells(html: str, key: Any) -> dict[str, dict[str, str]]:
    """``{column: {"html": ..., "text": ...}}`` of the changelist row whose id is ``key``."""
    rows = re.findall(r"<tr>.*?</tr>", html, re.S)
    mine = [row for row in rows if f'title="{key}"' in row]
    assert len(mine) == 1, f"{key} is not on the page exactly once"
    cells = {}
    for name, inner in re.findall(r'<t[dh] class="field-(\w+)">(.*?)</t[dh]>', mine[0], re.S):
        text = " ".join(re.sub(r"<[^>]+>", " ", inner).split())
        cells[name] = {"html": inner, "text": text}
    return cells


def listed_keys(html: str) -> set[str]:
    """Ids of the rows on a work changelist page."""
    return set(re.findall(r'<th class="field-work_id_cell"><a [^>]*><span title="([^"]+)"', html))


def messages_of(response: Any) -> list[str]:
    return [str(m.message) for m in get_messages(response.wsgi_request)]


def run_action(client: Client, url: str, action: str, rows: list[Any], **extra: str) -> Any:
    data = {"action": action, "_selected_action": [row.pk for row in rows], "index": 0}
    return client.post(url, {**data, **extra})


def action_names(response: Any) -> set[str]:
    form = response.context["action_form"]  # None when no action is allowed
    return {name for name, _ in form.fields["action"].choices if name} if form else set()


def refresh(row: Any) -> Any:
    return type(row)._default_manager.get(pk=row.pk)


# -- the world: instances and outbox rows, one of each kind ---------------------------------


class World:
    """Instances (live, stale, evicted, gone) and outbox rows of every state and stuck kind."""

    def __init__(self, now: datetime) -> None:
        self.now = now
        self.live = factories.ServiceInstanceFactory(
            service_name="mailer",
            host_name="web-1",
            process_id=4242,
            started_at=now - secs(3600),
            last_heartbeat_at=now - secs(5),
        )
        self.stale = factories.ServiceInstanceFactory(
            service_name="mailer",
            host_name="web-2",
            process_id=77,
            started_at=now - secs(7200),
            last_heartbeat_at=now - secs(100),
        )
        self.evicted_id = uuid.UUID("00000000-0000-0000-0000-0000000e0001")
        factories.EvictionFactory(instance_id=self.evicted_id, evicted_at=now - secs(50))
        self.gone_id = uuid.UUID("00000000-0000-0000-0000-00000000a0e0")
        self.rows: dict[str, models.Outbox] = {}

        held = {"claimed_at": now - secs(60)}
        self.add("pending", created_at=now - secs(90))
        self.add(
            "leased_live",
            instance_id=self.live.instance_id,
            lease_expiry=now + secs(252),
            lease_renewals=3,
            attempts=2,
            last_error="ValueError: boom\nTraceback (most recent call last):\n  ...",
            **held,
        )
        self.add(
            "leased_stale",
            instance_id=self.stale.instance_id,
            lease_expiry=now + secs(200),
            attempts=1,
            **held,
        )
        self.add(
            "leased_evicted",
            instance_id=self.evicted_id,
            lease_expiry=now + secs(200),
            attempts=1,
            **held,
        )
        self.add(
            "leased_gone",
            instance_id=self.gone_id,
            lease_expiry=now + secs(200),
            attempts=1,
            **held,
        )
        self.add(
            "lease_expired",
            instance_id=self.live.instance_id,
            lease_expiry=now - secs(180),
            attempts=3,
            **held,
        )
        self.add("evicted_unclaimed", attempts=1, failure_reason="instance_evicted", **held)
        self.add("attempts_half", attempts=5, scheduled_for=now + secs(600))
        self.add("attempts_below_half", attempts=4, scheduled_for=now + secs(600))
        self.add("first_of_two", attempts=1, max_attempts=2, scheduled_for=now + secs(600))
        self.add(
            "dead",
            attempts=10,
            dead_lettered_at=now - secs(30),
            failure_reason="handler_error",
            last_error="KeyError: 'x'",
        )
        self.add("done", attempts=1, done_at=now - secs(10))
        # s-dead: a dead head holds back two rows
        self.add("dead_head", stream="s-dead", attempts=10, dead_lettered_at=now - secs(30))
        self.add("behind_dead_1", stream="s-dead")
        self.add("behind_dead_2", stream="s-dead")
        # s-retry: a head waiting for its retry holds back one row
        self.add("retry_head", stream="s-retry", attempts=1, scheduled_for=now + secs(60))
        self.add("behind_retry", stream="s-retry")
        # s-deferred: a deferred first attempt is the producer's choice, not a blockage
        self.add("deferred_head", stream="s-deferred", scheduled_for=now + secs(60))
        self.add("behind_deferred", stream="s-deferred")
        # s-ok: a head leased by a live instance
        self.add(
            "ok_head",
            stream="s-ok",
            instance_id=self.live.instance_id,
            lease_expiry=now + secs(100),
            attempts=1,
            **held,
        )
        self.add("behind_ok", stream="s-ok")

    def add(self, name: str, **fields: Any) -> None:
        fields.setdefault("created_at", self.now - secs(300))
        self.rows[name] = factories.OutboxFactory(topic=f"topic.{name}", **fields)

    def key(self, name: str) -> str:
        return str(self.rows[name].work_id)

    def keys(self, *names: str) -> set[str]:
        return {self.key(name) for name in names}


STUCK = {
    "leased_stale",
    "leased_evicted",
    "leased_gone",
    "lease_expired",
    "evicted_unclaimed",
    "attempts_half",
    "behind_dead_1",
    "behind_dead_2",
    "behind_retry",
}


@pytest.fixture
def world(now: datetime) -> World:
    return World(now)


def factories_for(model: type[Any]) -> Any:
    return {
        models.Outbox: factories.OutboxFactory,
        models.Inbox: factories.InboxFactory,
        models.PerspectiveEvent: factories.PerspectiveEventFactory,
        models.ReceptorProcessing: factories.ReceptorProcessingFactory,
    }[model]()


# -- pages and permissions ------------------------------------------------------------------


def test_every_page_renders_for_a_staff_user_with_view_permissions(world: World) -> None:
    client = client_for(staff("viewer", *view_all()))
    for url in [*LIST_URLS, f"{OUTBOX_URL}?_facets=True&state=stuck"]:
        assert client.get(url).status_code == 200, url
    for model in WORK_MODELS:
        row = factories_for(model)
        url = f"/admin/workpump/{model._meta.model_name}/{row.pk}/change/"
        assert client.get(url).status_code == 200, url
    url = f"{INSTANCES_URL}{world.live.pk}/change/"
    assert client.get(url).status_code == 200


def test_pages_are_refused_without_permissions(world: World) -> None:
    outsider = client_for(staff("outsider"))
    row_url = f"{OUTBOX_URL}{world.rows['pending'].pk}/change/"
    for url in [*LIST_URLS[:-1], row_url]:
        assert outsider.get(url).status_code == 403, url
    # The app index of an app the user has no permission in is a 404 in Django's admin.
    assert outsider.get("/admin/workpump/").status_code == 404

    anonymous = Client()
    for url in [*LIST_URLS, row_url]:
        response = anonymous.get(url)
        assert response.status_code == 302, url
        assert response["Location"].startswith("/admin/login/")


def test_the_summary_needs_view_permission_on_every_category_and_instances() -> None:
    partial = client_for(staff("partial", *view_all()[:3]))
    assert partial.get(SUMMARY_URL).status_code == 403
    assert client_for(staff("full", *view_all())).get(SUMMARY_URL).status_code == 200


def test_the_app_index_links_to_the_summary_and_stream_ownership(admin_client: Client) -> None:
    html = admin_client.get("/admin/workpump/").content.decode()
    assert f'href="{SUMMARY_URL}"' in html
    assert f'href="{STREAMS_URL}"' in html
    changelist = admin_client.get(OUTBOX_URL).content.decode()
    assert f'href="{SUMMARY_URL}"' in changelist
    assert 'href="?state=stuck"' in changelist
    instances = admin_client.get(INSTANCES_URL).content.decode()
    assert '<a href="/admin/workpump/eviction/">Tombstones</a>' in instances


# -- the changelist columns -----------------------------------------------------------------


def test_changelist_shows_lease_expiry_attempts_renewals_owner_and_heartbeat_age(
    admin_client: Client, world: World
) -> None:
    html = admin_client.get(OUTBOX_URL).content.decode()

    leased = row_cells(html, world.key("leased_live"))
    assert leased["state"]["text"] == "leased"
    assert leased["topic"]["text"] == "topic.leased_live"
    assert leased["attempts_of_max"]["text"] == "2/10"
    absolute = timezone.localtime(world.now + secs(252)).strftime("%Y-%m-%d %H:%M:%S")
    assert leased["lease_expires"]["text"] == f"{absolute} in 4m 12s"
    assert leased["renewals"]["text"] == "3/6"
    assert leased["owner"]["text"] == "mailer@web-1:4242"
    assert leased["owner_heartbeat"]["text"] == "5s ago"
    assert "wp-fresh" in leased["owner_heartbeat"]["html"]
    assert leased["error"]["text"] == "ValueError: boom"

    expired = row_cells(html, world.key("lease_expired"))
    assert expired["state"]["text"] == "orphaned stuck"
    assert expired["lease_expires"]["text"].endswith("expired 3m ago")

    stale = row_cells(html, world.key("leased_stale"))
    assert stale["state"]["text"] == "leased stuck"
    assert stale["owner"]["text"] == "mailer@web-2:77 (stale)"
    assert stale["owner_heartbeat"]["text"] == "1m 40s ago"
    assert "wp-stale" in stale["owner_heartbeat"]["html"]

    evicted = row_cells(html, world.key("leased_evicted"))
    assert evicted["owner"]["text"] == "00000000 (evicted)"
    assert evicted["owner_heartbeat"]["text"] == "evicted"

    pending = row_cells(html, world.key("pending"))
    assert pending["state"]["text"] == "pending"
    assert pending["lease_expires"]["text"] == "—"
    assert pending["renewals"]["text"] == "—"
    assert pending["owner"]["text"] == "—"

    dead = row_cells(html, world.key("dead"))
    assert dead["state"]["text"] == "dead"
    assert dead["attempts_of_max"]["text"] == "10/10"

    scheduled = row_cells(html, world.key("attempts_below_half"))
    assert scheduled["state"]["text"] == "scheduled"
    when = timezone.localtime(world.now + secs(600)).strftime("%Y-%m-%d %H:%M:%S")
    assert scheduled["scheduled"]["text"] == when


def test_state_filter_selects_rows_by_workpump_state_of(admin_client: Client, world: World) -> None:
    expected = {
        "pending": {
            "pending",
            "behind_dead_1",
            "behind_dead_2",
            "behind_retry",
            "behind_deferred",
            "behind_ok",
        },
        "scheduled": {
            "attempts_half",
            "attempts_below_half",
            "first_of_two",
            "retry_head",
            "deferred_head",
        },
        "leased": {"leased_live", "leased_stale", "leased_evicted", "leased_gone", "ok_head"},
        "orphaned": {"lease_expired", "evicted_unclaimed"},
        "done": {"done"},
        "dead": {"dead", "dead_head"},
    }
    for state, names in expected.items():
        html = admin_client.get(OUTBOX_URL, {"state": state}).content.decode()
        assert listed_keys(html) == world.keys(*names), state


def test_stuck_filter_selects_exactly_the_stuck_rows(admin_client: Client, world: World) -> None:
    html = admin_client.get(OUTBOX_URL, {"state": "stuck"}).content.decode()
    assert listed_keys(html) == world.keys(*STUCK)
    assert set(world.rows) - STUCK, "the fixture has rows that are not stuck"


def test_a_stuck_row_says_why_on_its_detail_page(admin_client: Client, world: World) -> None:
    reasons = {
        "leased_stale": "stuck: holder stale",
        "leased_evicted": "stuck: holder evicted",
        "lease_expired": "stuck: orphaned",
        "attempts_half": "stuck: attempts high",
        "behind_retry": "stuck: stream blocked by its head",
    }
    for name, reason in reasons.items():
        html = admin_client.get(f"{OUTBOX_URL}{world.rows[name].pk}/change/").content.decode()
        assert reason in html, name


def test_search_finds_rows_by_id_topic_and_stream(admin_client: Client, world: World) -> None:
    def found(term: str) -> set[str]:
        return listed_keys(admin_client.get(OUTBOX_URL, {"q": term}).content.decode())

    assert found(world.key("dead")) == world.keys("dead")
    assert found("leased_gone") == world.keys("leased_gone")
    assert found("s-retry") == world.keys("retry_head", "behind_retry")


def test_owner_and_topic_filters(admin_client: Client, world: World) -> None:
    def listed(**params: str) -> set[str]:
        return listed_keys(admin_client.get(OUTBOX_URL, params).content.decode())

    assert listed(owner=str(world.live.instance_id)) == world.keys(
        "leased_live", "lease_expired", "ok_head"
    )
    assert listed(owner="not-live") == world.keys("leased_stale", "leased_evicted", "leased_gone")
    assert world.keys("pending", "dead") <= listed(owner="none")
    assert listed(topic="topic.done") == world.keys("done")


# -- query counts ---------------------------------------------------------------------------


def count_queries(client: Client, url: str, params: dict[str, str] | None = None) -> int:
    with CaptureQueriesContext(connection) as queries:
        response = client.get(url, params or {})
    assert response.status_code == 200
    return len(queries)


def test_outbox_changelist_query_count_is_fixed_whatever_the_page_size(
    admin_client: Client, world: World
) -> None:
    operator = client_for(staff("operator", *view_all(), (models.Outbox, "retry_work")))
    few = count_queries(admin_client, OUTBOX_URL)
    few_operator = count_queries(operator, OUTBOX_URL)
    factories.OutboxFactory.create_batch(
        60,
        instance_id=world.live.instance_id,
        lease_expiry=world.now + secs(100),
        claimed_at=world.now,
        attempts=1,
    )
    assert few == count_queries(admin_client, OUTBOX_URL) == OUTBOX_CHANGELIST_QUERIES
    assert few_operator == count_queries(operator, OUTBOX_URL)
    assert few_operator == OUTBOX_CHANGELIST_QUERIES + OPERATOR_EXTRA_QUERIES
    # A filter costs nothing extra (show_full_result_count is off).
    assert count_queries(admin_client, OUTBOX_URL, {"state": "stuck"}) == OUTBOX_CHANGELIST_QUERIES


def test_other_pages_run_a_fixed_number_of_queries(admin_client: Client, world: World) -> None:
    factories.ActiveStreamFactory(stream="s-ok", owner_instance_id=world.live.instance_id)
    detail = f"{OUTBOX_URL}{world.rows['behind_ok'].pk}/change/"
    pages = {
        INSTANCES_URL: INSTANCES_CHANGELIST_QUERIES,
        STREAMS_URL: STREAMS_CHANGELIST_QUERIES,
        SUMMARY_URL: SUMMARY_QUERIES,
        detail: DETAIL_QUERIES,
    }
    for url in pages:  # a first visit in the process also fills the content-type cache
        count_queries(admin_client, url)
    before = {url: count_queries(admin_client, url) for url in pages}
    for n in range(20):
        instance = factories.ServiceInstanceFactory(last_heartbeat_at=world.now)
        factories.OutboxFactory(
            stream="s-ok", instance_id=instance.instance_id, lease_expiry=world.now, attempts=1
        )
        factories.ActiveStreamFactory(stream=f"more-{n}", owner_instance_id=instance.instance_id)
    after = {url: count_queries(admin_client, url) for url in pages}
    assert before == after == pages


# -- detail page and change form ------------------------------------------------------------


def test_detail_page_shows_formatted_payload_full_error_and_stream_neighbours(
    admin_client: Client, now: datetime
) -> None:
    head = factories.OutboxFactory(stream="s-n", payload={"user": {"id": 7}, "b": [1, 2]})
    middle = factories.OutboxFactory(
        stream="s-n",
        payload={"user": {"id": 8}},
        last_error="RuntimeError: down\nTraceback line 1\nTraceback line 2",
    )
    tail = factories.OutboxFactory(stream="s-n")
    factories.OutboxFactory(stream="other")
    html = admin_client.get(f"{OUTBOX_URL}{middle.pk}/change/").content.decode()

    pretty = json.dumps({"user": {"id": 8}}, indent=2)
    assert pretty.replace('"', "&quot;") in html
    assert "Traceback line 2" in html
    neighbours = re.search(r'<table class="wp-neighbours">.*?</table>', html, re.S)
    assert neighbours is not None
    table = neighbours.group(0)
    assert re.findall(r"<tr><td>(\d+)</td>", table) == [str(head.pk), str(middle.pk), str(tail.pk)]
    assert "(this row)" in table
    assert f'href="{OUTBOX_URL}{head.pk}/change/"' in table


@pytest.mark.parametrize("model", WORK_MODELS, ids=lambda m: m._meta.model_name)
def test_a_work_id_url_leads_to_the_row_page_which_shows_the_whole_id(
    admin_client: Client, model: type[Any]
) -> None:
    row = factories_for(model)
    work_id = str(row.work_id)
    base = f"/admin/workpump/{model._meta.model_name}/"
    page = f"{base}{row.pk}/change/"
    for url in (f"{base}{work_id}/", f"{base}{work_id}/change/"):
        response = admin_client.get(url)
        assert (response.status_code, response["Location"]) == (302, page), url
    # the changelist's filters ride along, as on any change page
    filtered = admin_client.get(f"{base}{work_id}/change/", {"_changelist_filters": "state=dead"})
    assert filtered["Location"] == f"{page}?_changelist_filters=state%3Ddead"

    html = admin_client.get(page).content.decode()
    assert f'<code class="wp-id" style="user-select:all">{work_id}</code>' in html
    changelist = admin_client.get(base).content.decode()
    cell = r'<th class="field-work_id_cell"><a [^>]*>(?:<span [^>]*>)?([^<]+)<'
    ids = re.findall(cell, changelist)
    assert ids == [work_id]  # in full, not its first 8 characters


def test_the_id_send_returns_opens_its_outbox_row_and_an_unknown_id_says_so(
    admin_client: Client,
) -> None:
    message_id = workpump.send("admin.by_id", {"n": 1})
    response = admin_client.get(f"{OUTBOX_URL}{message_id}/change/", follow=True)
    assert response.status_code == 200
    assert response.context["original"].work_id == message_id

    unknown = uuid.uuid4()
    response = admin_client.get(f"{OUTBOX_URL}{unknown}/change/", follow=True)
    assert response.redirect_chain == [(OUTBOX_URL, 302)]
    assert messages_of(response) == [
        f"No outbox message has the id {unknown}: check the id, or retention may have "
        "removed the row."
    ]
    outsider = client_for(staff("outsider"))
    assert outsider.get(f"{OUTBOX_URL}{message_id}/").status_code == 403


def test_perspective_detail_shows_the_event_payload(admin_client: Client) -> None:
    event = factories.EventFactory(payload={"order_id": 42}, event_type="order.placed")
    row = factories.PerspectiveEventFactory(event=event)
    html = admin_client.get(f"/admin/workpump/perspectiveevent/{row.pk}/change/").content.decode()
    assert "&quot;order_id&quot;: 42" in html
    assert f"order.placed {event.event_id}" in html


def test_change_form_exposes_no_lease_column_and_saves_only_the_priority(
    admin_client: Client, world: World
) -> None:
    row = world.rows["leased_live"]
    url = f"{OUTBOX_URL}{row.pk}/change/"
    html = admin_client.get(url).content.decode()
    inputs = set(re.findall(r'<(?:input|textarea|select)[^>]*name="(\w+)"', html))
    assert inputs & {f.name for f in models.Outbox._meta.fields} == {"priority"}
    assert admin_client.get(f"{OUTBOX_URL}add/").status_code == 403

    # A claim renews the lease after the form was loaded: saving must not write it back.
    renewed = world.now + secs(900)
    models.Outbox.objects.filter(pk=row.pk).update(lease_expiry=renewed, lease_renewals=4)
    response = admin_client.post(
        url,
        {
            "priority": "5",
            "lease_expiry": "2000-01-01 00:00:00",
            "instance_id": str(uuid.uuid4()),
            "payload": "{}",
            "_save": "Save",
        },
    )
    assert response.status_code == 302
    saved = refresh(row)
    assert saved.priority == 5
    assert saved.lease_expiry == renewed
    assert saved.lease_renewals == 4
    assert saved.instance_id == world.live.instance_id
    assert saved.payload == row.payload


def test_a_viewer_gets_a_read_only_detail_page_and_no_actions(world: World) -> None:
    viewer = client_for(staff("viewer", *view_all()))
    html = viewer.get(f"{OUTBOX_URL}{world.rows['pending'].pk}/change/").content.decode()
    assert 'name="priority"' not in html
    assert action_names(viewer.get(OUTBOX_URL)) == set()


# -- actions --------------------------------------------------------------------------------


def test_retry_now_makes_only_scheduled_rows_pending(admin_client: Client, world: World) -> None:
    chosen = [world.rows[n] for n in ("attempts_half", "retry_head", "leased_live", "pending")]
    before = {row.pk: refresh(row) for row in chosen}
    response = run_action(admin_client, OUTBOX_URL, "retry_now", chosen)
    assert response.status_code == 302
    assert messages_of(response) == [
        "Retried 2 outbox messages now.",
        "2 outbox messages left as they were: only scheduled rows (waiting for a retry or a "
        "deferral; not leased, done or dead) can be retried now.",
    ]
    for name in ("attempts_half", "retry_head"):
        row = refresh(world.rows[name])
        assert row.scheduled_for is None
        assert row.attempts == before[row.pk].attempts
    leased = refresh(world.rows["leased_live"])
    assert leased.lease_expiry == before[leased.pk].lease_expiry
    html = admin_client.get(OUTBOX_URL, {"state": "scheduled"}).content.decode()
    assert world.key("retry_head") not in listed_keys(html)


def test_release_lease_refuses_rows_held_by_a_live_instance(
    admin_client: Client, world: World
) -> None:
    chosen = [world.rows[n] for n in ("leased_live", "leased_stale", "lease_expired", "pending")]
    response = run_action(admin_client, OUTBOX_URL, "release_lease", chosen)
    assert messages_of(response) == [
        "Released the leases of 1 outbox message; they can be claimed again.",
        "2 outbox messages not released: held by a live instance, which may still be running "
        "them. Use “Force-release lease” if that instance is hung.",
        "1 outbox message had no lease to release.",
    ]
    stale = refresh(world.rows["leased_stale"])
    assert (stale.instance_id, stale.lease_expiry, stale.failure_reason) == (
        None,
        None,
        "operator_released",
    )
    # The live holder keeps both of its rows, the expired one too: it may still run it.
    for name in ("leased_live", "lease_expired"):
        assert refresh(world.rows[name]).instance_id == world.live.instance_id


def test_force_release_asks_first_then_takes_the_lease_from_a_live_holder(
    admin_client: Client, world: World
) -> None:
    row = world.rows["leased_live"]
    asked = run_action(admin_client, OUTBOX_URL, "force_release_lease", [row])
    assert asked.status_code == 200
    page = asked.content.decode()
    assert "may still be running these rows" in page
    assert "held by mailer@web-1:4242" in page
    assert refresh(row).instance_id == world.live.instance_id

    confirmed = admin_client.post(
        OUTBOX_URL,
        {"action": "force_release_lease", "_selected_action": [row.pk], "post": "yes"},
    )
    assert confirmed.status_code == 302
    released = refresh(row)
    assert released.instance_id is None
    assert released.failure_reason == "operator_released"
    assert messages_of(confirmed) == [
        "Released the leases of 1 outbox message; they can be claimed again."
    ]


def test_force_release_needs_its_own_permission(world: World) -> None:
    releaser = client_for(staff("releaser", *view_all(), (models.Outbox, "release_work_lease")))
    assert action_names(releaser.get(OUTBOX_URL)) == {"release_lease"}

    row = world.rows["leased_live"]
    response = releaser.post(
        OUTBOX_URL,
        {"action": "force_release_lease", "_selected_action": [row.pk], "post": "yes"},
    )
    assert messages_of(response) == ["No action selected."]
    assert refresh(row).instance_id == world.live.instance_id


def test_dead_letter_asks_first_for_rows_a_live_instance_holds(
    admin_client: Client, world: World
) -> None:
    row = world.rows["leased_live"]
    asked = run_action(admin_client, OUTBOX_URL, "dead_letter", [row, world.rows["pending"]])
    assert asked.status_code == 200
    assert "may be running them now" in asked.content.decode()
    assert refresh(row).dead_lettered_at is None

    confirmed = admin_client.post(
        OUTBOX_URL, {"action": "dead_letter", "_selected_action": [row.pk], "post": "yes"}
    )
    assert confirmed.status_code == 302
    parked = refresh(row)
    assert parked.dead_lettered_at is not None and parked.instance_id is None


def test_an_action_over_too_many_rows_is_refused_with_a_message(
    admin_client: Client, world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(work_actions, "MAX_ACTION_ROWS", 2)
    chosen = [world.rows[n] for n in ("pending", "leased_stale", "dead")]
    for action in ("retry_now", "release_lease", "dead_letter", "requeue_dead"):
        response = run_action(admin_client, OUTBOX_URL, action, chosen)
        assert set(messages_of(response)) == {
            "More than 2 outbox messages selected: an action changes at most 2 at a time. "
            "Narrow the selection with the filters, or use manage.py workpump_action for "
            "bulk changes."
        }, action
    assert refresh(world.rows["pending"]).dead_lettered_at is None
    assert refresh(world.rows["dead"]).dead_lettered_at is not None


def test_dead_letter_parks_undone_rows_and_leaves_done_ones(
    admin_client: Client, world: World
) -> None:
    chosen = [world.rows[n] for n in ("pending", "leased_stale", "done", "dead")]
    response = run_action(admin_client, OUTBOX_URL, "dead_letter", chosen)
    assert messages_of(response) == [
        "Dead-lettered 2 outbox messages; they are never claimed again until re-queued.",
        "2 outbox messages left as they were: already done or dead.",
    ]
    for name in ("pending", "leased_stale"):
        row = refresh(world.rows[name])
        assert row.dead_lettered_at == world.now
        assert row.failure_reason == "dead-lettered in the admin by admin"
        assert row.instance_id is None
    assert refresh(world.rows["done"]).dead_lettered_at is None
    dead = refresh(world.rows["dead"])
    assert dead.failure_reason == "handler_error"


def test_dead_letter_by_a_long_username_fits_the_reason_and_logs_each_row(
    client: Client,
    world: World,
    caplog: pytest.LogCaptureFixture,
    django_capture_on_commit_callbacks: Any,
) -> None:
    username = "o" * 150  # Django's longest username
    client.force_login(User.objects.create_superuser(username, "o@example.com", "x"))
    chosen = [world.rows[n] for n in ("pending", "leased_stale")]

    with django_capture_on_commit_callbacks(execute=True):
        response = run_action(client, OUTBOX_URL, "dead_letter", chosen)

    assert response.status_code == 302
    for row in chosen:
        stored = refresh(row).failure_reason
        assert len(stored) == 40 and stored.startswith("dead-lettered in the admin by ooo")
        assert stored.endswith("…")
    errors = [r for r in caplog.records if getattr(r, "action", None) == "dead_lettered"]
    ids = sorted(str(row.work_id) for row in chosen)
    assert sorted(r.workpump_id for r in errors) == ids  # one each
    for record in errors:
        message = record.getMessage()
        assert record.levelname == "ERROR" and username in message
        assert f"manage.py workpump_action requeue {record.workpump_id}" in message


def test_requeue_resets_attempts_of_dead_rows_and_keeps_their_error(
    admin_client: Client, world: World
) -> None:
    chosen = [world.rows[n] for n in ("dead", "dead_head", "pending")]
    response = run_action(admin_client, OUTBOX_URL, "requeue_dead", chosen)
    assert messages_of(response) == [
        "Re-queued 2 outbox messages: attempts reset to 0, last error kept.",
        "1 outbox message left as they were: only dead rows can be re-queued.",
    ]
    dead = refresh(world.rows["dead"])
    assert (dead.dead_lettered_at, dead.attempts, dead.last_error) == (None, 0, "KeyError: 'x'")
    html = admin_client.get(OUTBOX_URL, {"state": "pending"}).content.decode()
    assert world.keys("dead", "dead_head") <= listed_keys(html)


def test_each_action_needs_its_own_permission_on_its_own_model(world: World) -> None:
    # change_outbox is not enough for anything; retry_work on outbox is not retry on inbox.
    retrier = client_for(
        staff(
            "retrier",
            *view_all(),
            (models.Outbox, "change_outbox"),
            (models.Outbox, "retry_work"),
        )
    )
    assert action_names(retrier.get(OUTBOX_URL)) == {"retry_now"}
    assert action_names(retrier.get(INBOX_URL)) == set()

    row = world.rows["pending"]
    response = run_action(retrier, OUTBOX_URL, "dead_letter", [row])
    assert refresh(row).dead_lettered_at is None
    assert messages_of(response) == ["No action selected."]

    operator = client_for(
        staff(
            "operator",
            *view_all(),
            *((models.Outbox, codename) for codename in OPERATOR_CODENAMES),
        )
    )
    assert action_names(operator.get(OUTBOX_URL)) == {
        "retry_now",
        "release_lease",
        "force_release_lease",
        "dead_letter",
        "requeue_dead",
        "cancel",
    }


def test_cancel_needs_its_own_permission_asks_first_for_held_rows_and_shows_the_state(
    world: World,
) -> None:
    canceller = client_for(staff("canceller", *view_all(), (models.Outbox, "cancel_work")))
    assert action_names(canceller.get(OUTBOX_URL)) == {"cancel"}
    assert action_names(canceller.get(INBOX_URL)) == set()
    held, pending, done = (world.rows[n] for n in ("leased_live", "pending", "done"))

    asked = run_action(canceller, OUTBOX_URL, "cancel", [held, pending])
    assert asked.status_code == 200
    assert "told to stop at once" in asked.content.decode()
    assert refresh(held).end_state is None

    response = run_action(canceller, OUTBOX_URL, "cancel", [held, pending, done], post="yes")
    assert messages_of(response) == [
        "Cancelled 2 outbox messages; they never run again and their streams move on.",
        "1 outbox message left as they were: already ended (done, cancelled or discarded).",
    ]
    for row in (held, pending):
        after = refresh(row)
        assert (after.end_state, after.instance_id) == ("cancelled", None)
    html = canceller.get(OUTBOX_URL, {"state": "cancelled"}).content.decode()
    assert listed_keys(html) == world.keys("leased_live", "pending")
    assert "cancelled" in canceller.get(OUTBOX_URL).content.decode()


# -- instances, tombstones, streams ---------------------------------------------------------


def test_instances_page_shows_heartbeat_colour_alive_lock_listener_and_rows_held(
    admin_client: Client, world: World, now: datetime, raw_connect: Any
) -> None:
    dead = factories.ServiceInstanceFactory(
        service_name="mailer", host_name="web-3", last_heartbeat_at=now - secs(400)
    )
    factories.InboxFactory(
        instance_id=world.live.instance_id, lease_expiry=now + secs(60), claimed_at=now
    )
    lock = raw_connect(application_name=f"workpump-{world.live.instance_id}")
    lock.execute("SELECT pg_advisory_lock(%s, %s)", (ALIVE_NAMESPACE, world.live.alive_lock_key))
    # the lock counts in the session recorded as its holder
    models.ServiceInstance.objects.filter(pk=world.live.pk).update(
        alive_lock_pid=lock.info.backend_pid
    )

    html = admin_client.get(INSTANCES_URL).content.decode()
    live = row_cells(html, world.live.instance_id)
    assert live["heartbeat"]["text"] == "5s ago"
    assert "wp-fresh" in live["heartbeat"]["html"]
    assert (live["live"]["text"], live["alive_lock"]["text"], live["listening"]["text"]) == (
        "yes",
        "yes",
        "yes",
    )
    assert live["held_outbox"]["text"] == "3"  # leased_live, lease_expired, ok_head
    assert f"{OUTBOX_URL}?owner={world.live.instance_id}" in live["held_outbox"]["html"]
    assert live["held_inbox"]["text"] == "1"
    assert live["held_receptor"]["text"] == "0"

    stale = row_cells(html, world.stale.instance_id)
    assert stale["heartbeat"]["text"] == "1m 40s ago"
    assert "wp-stale" in stale["heartbeat"]["html"]
    assert (stale["live"]["text"], stale["alive_lock"]["text"]) == ("no", "no")
    assert stale["held_outbox"]["text"] == "1"

    gone = row_cells(html, dead.instance_id)
    assert gone["heartbeat"]["text"] == "6m 40s ago"
    assert "wp-dead" in gone["heartbeat"]["html"]
    assert (gone["service_name"]["text"], gone["process_id"]["text"]) == (
        "mailer",
        str(dead.process_id),
    )


def test_a_stale_instance_with_its_alive_lock_held_is_live(
    admin_client: Client, world: World, raw_connect: Any
) -> None:
    lock = raw_connect()
    lock.execute("SELECT pg_advisory_lock(%s, %s)", (ALIVE_NAMESPACE, world.stale.alive_lock_key))
    # the lock counts in the session recorded as its holder
    models.ServiceInstance.objects.filter(pk=world.stale.pk).update(
        alive_lock_pid=lock.info.backend_pid
    )
    html = admin_client.get(INSTANCES_URL).content.decode()
    stale = row_cells(html, world.stale.instance_id)
    assert (stale["live"]["text"], stale["alive_lock"]["text"]) == ("yes", "yes")
    # ... and its rows stop being stuck for that reason.
    listed = listed_keys(admin_client.get(OUTBOX_URL, {"state": "stuck"}).content.decode())
    assert world.key("leased_stale") not in listed


@pytest.mark.parametrize(
    ("age", "locked", "mode", "expected"),
    [
        # holding its alive-lock it beats every 60 s: 45 s is on time, not stale
        (45, True, "advisory_lock_when_available", "fresh"),
        (45, False, "advisory_lock_when_available", "stale"),  # it beats every 10 s
        # late for the slow cadence: one interval plus the fast cadence's 20 s margin
        (85, True, "advisory_lock_when_available", "stale"),
        (45, True, "heartbeat_table_only", "stale"),  # no lock source: always 10 s
        (400, True, "advisory_lock_when_available", "dead"),
    ],
    ids=["locked-slow-beat", "unlocked", "locked-late", "table-only", "past-dead"],
)
def test_the_heartbeat_colour_follows_the_instance_cadence_and_alive_lock(
    admin_client: Client,
    now: datetime,
    raw_connect: Any,
    age: int,
    locked: bool,
    mode: str,
    expected: str,
) -> None:
    instance = factories.ServiceInstanceFactory(last_heartbeat_at=now - secs(age))
    row = factories.OutboxFactory(
        instance_id=instance.instance_id, lease_expiry=now + secs(200), claimed_at=now, attempts=1
    )
    if locked:
        lock = raw_connect()
        lock.execute("SELECT pg_advisory_lock(%s, %s)", (ALIVE_NAMESPACE, instance.alive_lock_key))
        # the lock counts in the session recorded as its holder
        models.ServiceInstance.objects.filter(pk=instance.pk).update(
            alive_lock_pid=lock.info.backend_pid
        )
    colour = f"wp-{expected}"
    with override_settings(WORKPUMP={"LIVENESS_SOURCE_MODE": mode}):
        instances = admin_client.get(INSTANCES_URL).content.decode()
        assert colour in row_cells(instances, instance.instance_id)["heartbeat"]["html"]
        outbox = admin_client.get(OUTBOX_URL).content.decode()
        assert colour in row_cells(outbox, row.work_id)["owner_heartbeat"]["html"]
        summary = admin_client.get(SUMMARY_URL).content.decode()
        [line] = [r for r in summary.split("<tr") if str(instance.instance_id) in r]
        assert colour in line


def test_evict_asks_first_then_tombstones_the_instance_and_releases_its_rows(
    world: World,
) -> None:
    client = client_for(staff("evictor", *view_all(), (models.ServiceInstance, "evict_instance")))
    target = world.live
    asked = run_action(client, INSTANCES_URL, "evict", [target])
    assert asked.status_code == 200
    assert "its next heartbeat is refused" in asked.content.decode()
    assert "(live), 3 rows held" in asked.content.decode()
    assert models.ServiceInstance.objects.filter(pk=target.pk).exists()

    done = client.post(
        INSTANCES_URL, {"action": "evict", "_selected_action": [target.pk], "post": "yes"}
    )
    assert messages_of(done) == ["Evicted 1 instance; 3 rows released, claimable again."]
    assert not models.ServiceInstance.objects.filter(pk=target.pk).exists()
    tombstone = models.Eviction.objects.get(pk=target.pk)
    assert tombstone.reason == "evicted in the admin by evictor"
    for name in ("leased_live", "lease_expired", "ok_head"):
        row = refresh(world.rows[name])
        assert (row.instance_id, row.failure_reason) == (None, "instance_evicted")
    # the stale instance was not selected and keeps its row
    assert refresh(world.rows["leased_stale"]).instance_id == world.stale.instance_id

    html = client.get("/admin/workpump/eviction/").content.decode()
    assert "evicted in the admin by evictor" in html


def test_evict_needs_the_evict_instance_permission(world: World) -> None:
    viewer = client_for(staff("viewer", *view_all()))
    assert action_names(viewer.get(INSTANCES_URL)) == set()
    viewer.post(
        INSTANCES_URL,
        {"action": "evict", "_selected_action": [world.live.pk], "post": "yes"},
    )
    assert models.ServiceInstance.objects.filter(pk=world.live.pk).exists()


def test_stream_ownership_shows_owner_stream_lease_and_pending_rows(
    admin_client: Client, world: World, now: datetime
) -> None:
    factories.ActiveStreamFactory(
        stream="s-ok",
        owner_instance_id=world.live.instance_id,
        lease_expiry=now + secs(90),
    )
    factories.ActiveStreamFactory(stream="s-dead")
    event = factories.EventFactory(stream="order-1")
    factories.PerspectiveEventFactory(event=event, topic="totals")
    factories.PerspectiveEventFactory(event=factories.EventFactory(stream="order-1"))
    factories.ActiveStreamFactory(
        category="perspective_event",
        scope="totals",
        stream="order-1",
        owner_instance_id=world.stale.instance_id,
        lease_expiry=now - secs(20),
    )
    html = admin_client.get(STREAMS_URL).content.decode()
    rows = {
        " ".join(re.sub(r"<[^>]+>", " ", row).split()): row
        for row in re.findall(r"<tr>.*?</tr>", html, re.S)
        if "field-stream" in row
    }
    texts = sorted(rows)
    ok = next(t for t in texts if "s-ok" in t)
    assert "mailer@web-1:4242" in ok
    assert "in 1m 30s" in ok
    assert "5s ago" in ok
    assert re.search(r"in 1m 30s 2 ", ok)  # ok_head and behind_ok are undone
    dead = next(t for t in texts if "s-dead" in t)
    assert re.search(r"— — — 3 ", dead)  # no owner; the dead head and two rows behind it
    order = next(t for t in texts if "order-1" in t)
    assert "mailer@web-2:77 (stale)" in order
    assert "expired 20s ago 1 " in order  # only the "totals" perspective's row


# -- summary --------------------------------------------------------------------------------


def test_summary_shows_the_same_numbers_as_workpump_status(
    admin_client: Client, world: World, now: datetime
) -> None:
    factories.InboxFactory(created_at=now - secs(42))
    factories.ReceptorProcessingFactory(attempts=10, dead_lettered_at=now)
    html = admin_client.get(SUMMARY_URL).content.decode()
    out = io.StringIO()
    call_command("workpump_status", "--json", stdout=out)
    report = json.loads(out.getvalue())

    cells = re.findall(r'data-category="(\w+)" data-state="(\w+)">(?:<a [^>]*>)?(\d+)', html)
    shown = {(category, state): int(count) for category, state, count in cells}
    for category, numbers in report["categories"].items():
        for state, count in numbers["counts"].items():
            assert shown[(category, state)] == count, (category, state)
        assert shown[(category, "total")] == numbers["total"]
        oldest = re.search(rf'data-category="{category}" data-oldest="([^"]*)"', html)
        assert oldest is not None
        expected = numbers["oldest_pending_age_seconds"]
        assert (float(oldest.group(1)) if oldest.group(1) else None) == (
            pytest.approx(expected) if expected is not None else None
        )
    assert shown[("outbox", "dead")] == 2
    assert shown[("receptor", "dead")] == 1

    def headline(name: str) -> int:
        found = re.search(rf'data-summary="{name}">(\d+)<', html)
        assert found is not None, name
        return int(found.group(1))

    assert headline("dead") == sum(report["dead_counts"].values()) == 3
    # s-dead and s-retry of the outbox, and the dead receptor row's stream
    assert headline("blocked") == report["blocked_streams"]["total"] == 3
    live = sum(1 for instance in report["instances"] if instance["live"])
    assert headline("live") == live == 1
    assert headline("instances") == len(report["instances"]) == 2
    unhandled = sum(topic["rows"] for topic in report["no_live_handler"])
    assert headline("unhandled") == unhandled
    vacuum = re.findall(
        r'<tr class="wp-vacuum"><td>(\w+)</td><td>(\d+)</td><td>(\d+)</td>.*?<td>(on|<strong>off)',
        html,
    )
    assert vacuum == [
        (
            t["table_name"],
            str(t["live_versions"]),
            str(t["dead_versions"]),
            "on" if t["autovacuum"] else "<strong>off",
        )
        for t in report["vacuum"]["tables"]
    ]
    assert len(vacuum) == 4


# -- formatting -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (0, "0s"),
        (45.9, "45s"),
        (180, "3m"),
        (252, "4m 12s"),
        (3600, "1h"),
        (3720, "1h 2m"),
        (93784, "1d 2h"),
        (-185, "3m 5s"),
    ],
)
def test_durations_show_the_two_largest_units(seconds: float, text: str) -> None:
    assert display.duration(seconds) == text


def test_relative_lease_times() -> None:
    assert display.relative(252) == "in 4m 12s"
    assert display.relative(-180) == "expired 3m ago"
    assert display.relative(0) == "expired 0s ago"


# -- the pump's database --------------------------------------------------------------------


@pytest.mark.django_db(transaction=True, databases=["default", "second"])
def test_the_admin_reads_and_acts_on_the_database_the_pump_uses(admin_client: Client) -> None:
    """With ``DATABASE_ALIAS`` naming another database (and no router), the pages show
    that database's rows and the actions change them there, as the pump and the summary
    see them."""

    def on_second(**fields: Any) -> models.Outbox:
        fields.setdefault("created_at", timezone.now())
        return models.Outbox.objects.using("second").create(
            work_id=uuid.uuid4(), topic="shard.topic", payload={}, **fields
        )

    pending = on_second()
    waiting = on_second(attempts=1, scheduled_for=timezone.now() + timedelta(hours=1))
    factories.OutboxFactory(topic="default.topic")

    with override_settings(WORKPUMP={"DATABASE_ALIAS": "second"}):
        html = admin_client.get(OUTBOX_URL).content.decode()
        assert listed_keys(html) == {str(pending.work_id), str(waiting.work_id)}
        html = admin_client.get(OUTBOX_URL, {"state": "pending"}).content.decode()
        assert listed_keys(html) == {str(pending.work_id)}
        detail = admin_client.get(f"{OUTBOX_URL}{waiting.pk}/change/")
        assert detail.status_code == 200
        assert str(waiting.work_id) in detail.content.decode()

        response = run_action(admin_client, OUTBOX_URL, "retry_now", [waiting])
        assert messages_of(response) == ["Retried 1 outbox message now."]
        assert models.Outbox.objects.using("second").get(pk=waiting.pk).scheduled_for is None

    # Back on the default database, its own row is the only one shown.
    html = admin_client.get(OUTBOX_URL).content.decode()
    assert len(listed_keys(html)) == 1


def test_a_rows_page_says_how_long_its_claim_waited_after_it_was_due(
    admin_client: Client, now: datetime
) -> None:
    row = factories.OutboxFactory(
        claimed_at=now - secs(30), claim_due_at=now - secs(42.5), attempts=1
    )
    quick = factories.OutboxFactory(claimed_at=now, claim_due_at=now - secs(0.004), attempts=1)
    html = admin_client.get(f"{OUTBOX_URL}{row.pk}/change/").content.decode()
    assert "(12s after it was due)" in html
    html = admin_client.get(f"{OUTBOX_URL}{quick.pk}/change/").content.decode()
    assert "(4 ms after it was due)" in html
