"""The admin console on real PostgreSQL: the overview, its live fragment, the topic and
instance pages, who may see them, and the chart and quantile helpers they use.

The rows are claimed and completed through the SQL functions in the test's transaction,
so the counters the pages read are the ones the counting trigger wrote for them.
"""

from __future__ import annotations

import re
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from django.contrib.auth.models import Permission, User
from django.contrib.contenttypes.models import ContentType
from django.test import Client

import django_workpump as workpump
from django_workpump import models
from django_workpump.admin import console_data
from django_workpump.admin.console_charts import Line, line_chart, nice_ceiling
from tests import factories
from tests.helpers import current_tokens, enroll, run_sql, scalar

pytestmark = pytest.mark.django_db

CONSOLE_URL = "/admin/workpump/serviceinstance/console/"
TOPIC_URL = "/admin/workpump/serviceinstance/console/topic/"
VIEWABLE = [
    models.Outbox,
    models.Inbox,
    models.PerspectiveEvent,
    models.ReceptorProcessing,
    models.ServiceInstance,
]
TOPIC = "console.reports"
A = uuid.UUID("00000000-0000-0000-0000-0000000000c1")


def viewer(username: str = "viewer", models_: list[Any] = VIEWABLE) -> Client:
    user = User.objects.create_user(username, password="pw", is_staff=True)
    for model in models_:
        content_type = ContentType.objects.get_for_model(model)
        user.user_permissions.add(
            Permission.objects.get(
                content_type=content_type, codename=f"view_{model._meta.model_name}"
            )
        )
    client = Client()
    client.force_login(user)
    return client


def make(n: int) -> list[uuid.UUID]:
    return [
        factories.OutboxFactory(topic=TOPIC, created_at=scalar("SELECT now()")).work_id
        for _ in range(n)
    ]


def claim(limit: int = 100) -> list[uuid.UUID]:
    enroll(A, scalar("SELECT now()"))
    rows = run_sql(
        "SELECT * FROM workpump.claim_work(p_instance_id => %s, p_max_rows => %s)", [A, limit]
    )
    return [r["work_id"] for r in rows if r["lease_token"] is not None]


def complete(ids: list[uuid.UUID]) -> None:
    run_sql(
        "SELECT * FROM workpump.complete_work(%s, 'outbox', %s::uuid[], %s::uuid[])",
        [A, ids, current_tokens("outbox", ids)],
    )


def fail(ids: list[uuid.UUID], error: str) -> None:
    run_sql(
        "SELECT * FROM workpump.fail_work(%s, 'outbox', %s::uuid[], %s::uuid[], %s::text[])",
        [A, ids, current_tokens("outbox", ids), [error] * len(ids)],
    )


def topic_cell(html: str, outcome: str) -> int:
    row = re.search(rf'<tr class="wp-topic" data-topic="{TOPIC}".*?</tr>', html, re.S)
    assert row, "the topic is not in the overview's table"
    cell = re.search(rf'data-outcome="{outcome}">(\d+)<', row.group(0))
    assert cell
    return int(cell.group(1))


def test_the_overview_draws_its_charts_for_a_viewer_and_refuses_others() -> None:
    make(3)
    claimed = claim()
    complete(claimed[:2])
    fail(claimed[2:], "ValueError: no such report")
    scalar("SELECT workpump.console_sample()")

    response = viewer().get(CONSOLE_URL)
    assert response.status_code == 200
    html = response.content.decode()
    for chart in (
        "throughput-hour",
        "throughput-day",
        "topics-done",
        "topics-failed",
        "topics-dead",
        "latency",
        "backlog",
        "oldest",
        "instances",
        "heartbeats",
    ):
        assert f'data-chart="{chart}"' in html, chart
    # the hour's throughput: a line per outcome over 60 points (zeros where nothing ran)
    hour = re.search(r'<figure[^>]*data-chart="throughput-hour".*?</figure>', html, re.S)
    assert hour and 'data-points="60"' in hour.group(0)
    assert '<polyline class="wp-line" data-series="done"' in hour.group(0)
    assert topic_cell(html, "done") == 2
    assert topic_cell(html, "failed") == 1
    assert topic_cell(html, "claimed") == 3
    assert 'id="wp-console-live"' in html and "fetch(" in html  # the live refresh
    # nothing is loaded from elsewhere: no script, style or image of another origin
    assert not re.search(r'(src|href)="(https?:)?//', html)

    partial = viewer("partial", VIEWABLE[:3])
    assert partial.get(CONSOLE_URL).status_code == 403
    assert partial.get(f"{TOPIC_URL}?category=outbox&topic={TOPIC}").status_code == 403
    anonymous = Client().get(CONSOLE_URL)
    assert anonymous.status_code == 302 and anonymous["Location"].startswith("/admin/login/")


def test_the_dead_chart_draws_the_topics_with_dead_rows_busy_or_not() -> None:
    client = viewer()
    make(2)
    complete(claim())
    html = client.get(CONSOLE_URL).content.decode()
    dead = re.search(r'<figure[^>]*data-chart="topics-dead".*?</figure>', html, re.S)
    assert dead and 'data-lines="0"' in dead.group(0)
    assert "No topic has dead rows in the last hour." in dead.group(0)

    # a quiet topic whose one row died (its only attempt failed), beside the busy topic
    # that has none
    factories.OutboxFactory(
        topic="console.quiet", max_attempts=1, created_at=scalar("SELECT now()")
    )
    fail(claim(), "ValueError: bad invoice")
    html = client.get(CONSOLE_URL).content.decode()
    dead = re.search(r'<figure[^>]*data-chart="topics-dead".*?</figure>', html, re.S)
    assert dead and 'data-lines="1"' in dead.group(0)
    assert 'data-series="console.quiet (outbox)"' in dead.group(0)
    assert "console.quiet (outbox)</a>" in dead.group(0)  # linked to its topic page
    assert TOPIC not in dead.group(0)


def test_the_live_fragment_reflects_newly_completed_work() -> None:
    client = viewer()
    make(5)
    claimed = claim()
    complete(claimed[:1])
    first = client.get(f"{CONSOLE_URL}?fragment=1")
    assert first.status_code == 200 and "no-store" in first["Cache-Control"]
    html = first.content.decode()
    assert "<html" not in html and "<script" not in html
    assert topic_cell(html, "done") == 1

    complete(claimed[1:])
    assert topic_cell(client.get(f"{CONSOLE_URL}?fragment=1").content.decode(), "done") == 5


def test_the_app_index_links_to_the_console() -> None:
    html = viewer().get("/admin/workpump/").content.decode()
    assert f'href="{CONSOLE_URL}"' in html


def test_the_topic_page_shows_rates_failure_reasons_and_links_its_rows() -> None:
    make(4)
    claimed = claim()
    complete(claimed[:1])
    fail(claimed[1:3], "KeyError: 'customer'\nTraceback (most recent call last): ...")
    fail(claimed[3:], "TimeoutError: warehouse did not answer")
    html = viewer().get(f"{TOPIC_URL}?category=outbox&topic={TOPIC}").content.decode()

    assert 'data-chart="outcomes"' in html and 'data-chart="latency"' in html
    done = re.search(r'<tr data-outcome="done"><th scope="row">done</th><td>(\d+)<', html)
    failed = re.search(r'<tr data-outcome="failed"><th scope="row">failed</th><td>(\d+)<', html)
    assert done and int(done.group(1)) == 1
    assert failed and int(failed.group(1)) == 3
    (reason,) = re.findall(r'<tr class="wp-failure" data-reason="([^"]+)">(.*?)</tr>', html, re.S)
    assert reason[0] == "handler_error"
    assert "<td>3</td>" in reason[1]
    # the newest error of the reason, its headline first
    assert "TimeoutError: warehouse did not answer" in reason[1]
    assert f'href="/admin/workpump/outbox/?topic={TOPIC}"' in html
    assert f'href="/admin/workpump/outbox/?topic={TOPIC}&amp;state=dead"' in html


def test_the_topic_page_needs_a_category_and_a_topic() -> None:
    client = viewer()
    assert client.get(f"{TOPIC_URL}?category=nope&topic=x").status_code == 404
    assert client.get(f"{TOPIC_URL}?category=outbox").status_code == 404


def test_the_instance_page_shows_its_counts_rows_in_flight_and_heartbeats() -> None:
    make(3)
    claimed = claim()
    complete(claimed[:1])
    scalar("SELECT workpump.console_sample()")
    html = viewer().get(f"{CONSOLE_URL}instance/{A}/").content.decode()

    # a claim counts when its attempt ends: the two still running are its rows in flight
    claims = re.search(r'<tr data-outcome="claimed"><th scope="row">claimed</th><td>(\d+)<', html)
    assert claims and int(claims.group(1)) == 1
    held = re.findall(r'<tr class="wp-held">(.*?)</tr>', html, re.S)
    assert len(held) == 2
    assert all(any(str(i) in row for i in claimed[1:]) for row in held)
    assert len(re.findall(r'class="wp-heartbeat-sample"', html)) == 1
    assert 'data-chart="heartbeat"' in html
    assert f'href="/admin/workpump/outbox/?owner={A}"' in html


# -- the helpers ---------------------------------------------------------------------------


def test_quantiles_interpolate_inside_their_bucket() -> None:
    bounds = [1.0, 10.0]
    assert console_data.quantile([0, 0, 0], bounds, 0.5) is None
    assert console_data.quantile([10, 0, 0], bounds, 0.5) == pytest.approx(0.5)
    assert console_data.quantile([0, 10, 0], bounds, 0.5) == pytest.approx(5.5)
    assert console_data.quantile([5, 4, 1], bounds, 0.95) == 10.0  # the open bucket: its bound


def test_a_grid_places_minutes_and_rates_are_per_minute() -> None:
    now = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)
    day = console_data.grid("day", now)
    end = now - timedelta(minutes=1)  # the last complete minute
    assert len(day.points) == 144 and day.end == end and day.until == now
    assert day.index(end) == 143 and day.index(end - timedelta(minutes=1440)) is None
    assert day.index(now) is None  # the minute still running is left out of the charts
    rows = [{"minute": end, "outcome": "done", "n": 50}]
    assert console_data.rates(rows, day)["done"][143] == 5.0  # 50 in 10 minutes


def test_an_idle_stretch_carries_the_last_sample_while_the_heartbeat_shows_a_beat() -> None:
    # an hour window to 12:59; samples at 11:30 (before it) and 12:10; the pump idled in
    # between and after (console_sample wrote nothing); B's heartbeat row stops at 12:40
    now = datetime(2026, 1, 1, 13, 0, tzinfo=UTC)
    hour = console_data.grid("hour", now)
    b = uuid.UUID("00000000-0000-0000-0000-0000000000c2")

    def row(minute: datetime, instance: uuid.UUID, alive: bool, beat: datetime | None) -> dict:
        return {
            "minute": minute, "instance_id": instance, "service_name": "s", "host_name": "h",
            "process_id": 1, "heartbeat_age_seconds": 3.0, "alive": alive, "in_flight": 0,
            "beat_until": beat,
        }  # fmt: skip

    at_1130, at_1210 = now - timedelta(minutes=90), now - timedelta(minutes=50)
    rows = [
        row(at_1130, A, True, now - timedelta(seconds=20)),
        row(at_1210, A, True, now - timedelta(seconds=20)),
        row(at_1210, b, True, now - timedelta(minutes=20)),
    ]
    totals, each = console_data.instances(rows, hour)

    alive = totals["alive"]
    assert alive[:10] == [1.0] * 10  # 12:00-12:09: the 11:30 sample, A only
    assert alive[10] == 2.0  # sampled
    assert alive[11:41] == [2.0] * 30  # 12:11-12:40: B's heartbeat row shows a beat
    assert alive[41:] == [1.0] * 19  # then A alone
    series = {s.instance_id: s for s in each}
    assert series[A].heartbeat_age[10] == 3.0 and series[A].heartbeat_age[11] is None
    assert series[b].in_flight[40] == 0.0 and series[b].in_flight[41] is None
    assert series[A].latest_age == 20.0  # from its beat to the current minute

    # an instance gone from the table is carried no further than its last sample
    gone = [row(at_1210, A, True, None)]
    totals, _ = console_data.instances(gone, hour)
    assert totals["alive"][10] == 1.0 and totals["alive"][11] is None


def test_a_chart_breaks_its_line_at_gaps_and_escapes_names() -> None:
    minutes = [datetime(2026, 1, 1, 12, i, tzinfo=UTC) for i in range(5)]
    svg = str(
        line_chart(
            "t", "T", minutes, [Line("<b>x</b>", [1.0, 2.0, None, 4.0, 5.0], href="/x?a=1&b=2")]
        )
    )
    assert svg.count("<polyline") == 2
    assert "<b>x</b>" not in svg and "&lt;b&gt;x&lt;/b&gt;" in svg
    assert 'href="/x?a=1&amp;b=2"' in svg
    assert nice_ceiling(7) == 10 and nice_ceiling(0) == 1 and nice_ceiling(230) == 250


def flow_rows(html: str) -> dict[str, str]:
    rows = re.findall(r'<tr class="wp-flow-rule" data-kind="(\w+)".*?</tr>', html, re.S)
    whole = re.findall(r'<tr class="wp-flow-rule".*?</tr>', html, re.S)
    return dict(zip(rows, whole, strict=True))


def test_the_topic_page_shows_the_limits_and_pauses_that_hold_it_back() -> None:
    page = f"{TOPIC_URL}?category=outbox&topic={TOPIC}"
    client = viewer()
    html = client.get(page).content.decode()
    assert "No flow rule names this topic or its category" in html
    assert 'Now: <span class="wp-held-back">nothing holds its rows back</span>' in html

    workpump.set_limit(topic=TOPIC, category="outbox", concurrency=2, rate="50/s")
    workpump.set_limit(topic="console.other", category="outbox", concurrency=1)
    make(5)
    assert len(claim()) == 2
    html = client.get(page).content.decode()
    rules = flow_rows(html)
    assert list(rules) == ["topic"]  # not the other topic's rule
    cells = re.findall(r"<td>([^<]*)</td>", rules["topic"])
    # paused, concurrency, in flight, cap per key, rate, burst, tokens left, waiting
    assert cells == ["no", "2", "2", "-", "50", "50", "48", "3"]
    assert f"waiting: concurrency cap {TOPIC} 2/2" in html
    # a console viewer without the rules' view permission sees no link to them
    assert "/admin/workpump/flowrule/" not in html

    workpump.pause(category="outbox")
    html = viewer("rules_viewer", [*VIEWABLE, models.FlowRule]).get(page).content.decode()
    rules = flow_rows(html)
    assert sorted(rules) == ["category", "topic"]
    assert 'data-paused="yes"' in rules["category"]
    # a category rule has no limits of its own: every cell is there, dashed
    assert re.findall(r"<td>([^<]*)</td>", rules["category"]) == ["paused", *["-"] * 7]
    assert "waiting: category outbox paused" in html
    assert 'href="/admin/workpump/flowrule/"' in html
