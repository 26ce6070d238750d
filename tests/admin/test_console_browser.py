"""The console in a real browser: Debian's headless Chromium, driven by Selenium, against
pytest-django's live server (the fixtures of test_admin_browser.py).

Seeds a day of series for a few topics and instances (the counters, backlog and instance
samples the console reads), logs in, opens the overview and sees its SVG charts drawn,
then completes new work through the SQL functions and sees the page's own refresh (no
reload) show it; opens a topic page from the chart legend. Runs a bulk retry from a
changelist search and sees the rows change. Screenshots go under the
test's temp dir, and into docs/images when WORKPUMP_DOCS_SCREENSHOTS=1.

Skips without /usr/bin/chromium, /usr/bin/chromedriver or selenium, unless
WORKPUMP_REQUIRE_BROWSER=1 (CI), which fails instead.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from django.contrib.auth.models import User
from pytest_django.live_server_helper import LiveServer

import django_workpump as workpump
from tests import factories
from tests.admin.test_admin_browser import _require_browser, admin_server, browser  # noqa: F401
from tests.helpers import ROOT, current_tokens, enroll, run_sql, scalar

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

LIVE_TOPIC = "reports.nightly"
INSTANCES = [uuid.UUID(f"00000000-0000-0000-0000-0000000000e{i}") for i in range(3)]

# A day of minutes for three topics: a rate that swells and ebbs, failures, a few dead.
SEED_COUNTS = """
INSERT INTO workpump_console_count (minute, category, topic, outcome, instance_id, n, latency)
SELECT m.minute, t.category, t.topic, o.outcome, i.id,
       CASE WHEN o.outcome = 'dead'
            THEN ((m.k + t.phase::int * 7) %% 23 < 2)::int * (1 + floor(random() * 2))
            ELSE greatest(0, round(t.rate * o.share * (1.2 + sin(m.k / 45.0 + t.phase))
                                   * (0.8 + random() * 0.4) / 3))
       END::bigint,
       CASE WHEN o.outcome = 'claimed' THEN ARRAY[
           round(t.rate * 4)::int, round(t.rate * 2 * (1.5 + sin(m.k / 30.0)))::int,
           round(t.rate)::int, round(t.rate / 2)::int,
           round(t.rate / 4 * (1 + sin(m.k / 20.0)))::int,
           1, 0, 0, 0, 0] END
FROM (SELECT date_trunc('minute', now()) - make_interval(mins => k) AS minute, k
      FROM generate_series(1, 1439) k) m
CROSS JOIN (VALUES ('outbox', 'emails.welcome', 40.0, 0.0),
                   ('inbox', 'billing.stripe_webhook', 25.0, 2.0),
                   ('perspective_event', 'orders.summary', 12.0, 4.0))
    AS t(category, topic, rate, phase)
CROSS JOIN (VALUES ('claimed', 1.06), ('done', 1.0), ('failed', 0.05), ('dead', 0.0),
                   ('renewed', 0.3)) o(outcome, share)
CROSS JOIN unnest(%(instances)s::uuid[]) i(id)
"""
SEED_BACKLOG = """
INSERT INTO workpump_console_backlog
    (minute, category, topic, pending, scheduled, leased, oldest_pending_seconds)
SELECT date_trunc('minute', now()) - make_interval(mins => k), 'outbox', 'emails.welcome',
       round(200 + 150 * sin(k / 40.0) + 80 * random()), round(30 + 20 * sin(k / 25.0)), 9,
       round(4 + 3 * sin(k / 35.0) + random() * 2)
FROM generate_series(1, 1439) k
"""
SEED_INSTANCES = """
INSERT INTO workpump_console_instance
    (minute, instance_id, service_name, host_name, process_id, heartbeat_age_seconds, alive,
     in_flight)
SELECT date_trunc('minute', now()) - make_interval(mins => k), i.id, 'shop', 'web-' || i.n,
       4000 + i.n, CASE WHEN i.n = 2 AND k < 20 THEN 4 + (20 - k) ELSE random() * 5 END, true,
       round(6 + 3 * sin(k / 15.0 + i.n) + random() * 2)
FROM generate_series(1, 1439) k
CROSS JOIN unnest(%(instances)s::uuid[]) WITH ORDINALITY i(id, n)
"""


@pytest.fixture
def seeded_series() -> Iterator[None]:
    run_sql(SEED_COUNTS, {"instances": INSTANCES})
    run_sql(SEED_BACKLOG)
    run_sql(SEED_INSTANCES, {"instances": INSTANCES})
    yield


def complete_new_work(count: int) -> None:
    """Make, claim and complete ``count`` outbox rows of LIVE_TOPIC (committed at once)."""
    now = scalar("SELECT now()")
    ids = [factories.OutboxFactory(topic=LIVE_TOPIC, created_at=now).work_id for _ in range(count)]
    enroll(INSTANCES[0], now)
    run_sql(
        "SELECT * FROM workpump.claim_work(p_instance_id => %s, p_max_rows => %s)",
        [INSTANCES[0], count],
    )
    run_sql(
        "SELECT * FROM workpump.complete_work(%s, 'outbox', %s::uuid[], %s::uuid[])",
        [INSTANCES[0], ids, current_tokens("outbox", ids)],
    )


def save(driver: Any, tmp_path: Path, name: str) -> Path:
    path = tmp_path / name
    assert driver.save_screenshot(str(path))
    assert path.stat().st_size > 10_000
    if os.environ.get("WORKPUMP_DOCS_SCREENSHOTS") == "1":
        (ROOT / "docs" / "images").mkdir(exist_ok=True)
        (ROOT / "docs" / "images" / name).write_bytes(path.read_bytes())
    return path


def test_the_overview_draws_its_charts_and_its_refresh_shows_new_completions(
    browser: Any,  # noqa: F811
    admin_server: LiveServer,  # noqa: F811
    seeded_series: None,
    tmp_path: Path,
) -> None:
    _require_browser()
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions
    from selenium.webdriver.support.ui import WebDriverWait

    User.objects.create_superuser("admin", "admin@example.com", "admin-pw")
    for n, instance in enumerate(INSTANCES):
        enroll(instance, scalar("SELECT now()"))
        run_sql(
            "UPDATE workpump_service_instance SET service_name = 'shop', host_name = %s,"
            " process_id = %s WHERE instance_id = %s",
            [f"web-{n + 1}", 4001 + n, instance],
        )
    factories.OutboxFactory(
        topic="emails.welcome",
        attempts=3,
        scheduled_for=scalar("SELECT now() + interval '5 minutes'"),
        failure_reason="handler_error",
        last_error="SMTPServerDisconnected: Connection unexpectedly closed\nTraceback ...",
    )
    factories.OutboxFactory(
        topic="emails.welcome",
        attempts=10,
        dead_lettered_at=scalar("SELECT now() - interval '3 minutes'"),
        failure_reason="max_attempts",
        last_error="KeyError: 'first_name'\nTraceback (most recent call last): ...",
    )
    complete_new_work(2)
    workpump.set_limit(topic="emails.welcome", category="outbox", concurrency=5, rate="20/s")

    browser.set_window_size(1500, 2300)
    # the page's refresh replaces its parts: an element read as it does is tried again
    wait = WebDriverWait(browser, 30, ignored_exceptions=(StaleElementReferenceException,))
    browser.get(f"{admin_server.url}/admin/login/?next=/admin/workpump/serviceinstance/console/")
    browser.find_element(By.NAME, "username").send_keys("admin")
    browser.find_element(By.NAME, "password").send_keys("admin-pw")
    browser.find_element(By.CSS_SELECTOR, "input[type=submit]").click()
    wait.until(expected_conditions.presence_of_element_located((By.ID, "wp-console-live")))

    def charts(b: Any) -> dict[str, tuple[int, int]]:
        """Each chart's lines and height, read in one go (a refresh mid-read: again)."""
        return {
            f.get_attribute("data-chart"): (
                len(f.find_elements(By.CSS_SELECTOR, "svg polyline")),
                f.find_element(By.TAG_NAME, "svg").size["height"],
            )
            for f in b.find_elements(By.CSS_SELECTOR, "figure")
        }

    drawn = wait.until(charts)
    assert {"throughput-hour", "throughput-day", "topics-done", "latency", "backlog",
            "oldest", "instances", "heartbeats"} <= set(drawn)  # fmt: skip
    for name in ("throughput-hour", "topics-done", "latency", "backlog", "heartbeats"):
        lines, height = drawn[name]
        assert lines, f"{name} drew no line"
        assert height > 100

    def done_of(topic: str) -> int | None:
        cells = browser.find_elements(
            By.CSS_SELECTOR, f'tr.wp-topic[data-topic="{topic}"] td[data-outcome="done"]'
        )
        return int(cells[0].text) if cells else None

    assert wait.until(lambda b: done_of(LIVE_TOPIC)) == 2
    save(browser, tmp_path, "console-overview.png")

    # New work completes: the page's refresh shows it, with no reload.
    marker = browser.execute_script("window.wpNotReloaded = true; return window.wpNotReloaded")
    assert marker is True
    complete_new_work(5)
    wait.until(lambda b: done_of(LIVE_TOPIC) == 7)
    assert browser.execute_script("return window.wpNotReloaded") is True
    live = browser.find_element(By.ID, "wp-console-live")
    assert int(live.get_attribute("data-refreshed")) >= 1
    assert live.get_attribute("data-refresh-error") is None

    # The topic page, from the legend of the per-topic chart.
    legend = browser.find_element(
        By.CSS_SELECTOR, '#wp-chart-topics-done .wp-legend a[href*="emails.welcome"]'
    )
    legend.click()
    wait.until(expected_conditions.presence_of_element_located((By.ID, "wp-failures")))
    reasons = {
        r.get_attribute("data-reason"): r.text
        for r in browser.find_elements(By.CSS_SELECTOR, "tr.wp-failure")
    }
    assert set(reasons) == {"handler_error", "max_attempts"}
    assert "KeyError: 'first_name'" in reasons["max_attempts"]
    assert browser.find_elements(By.CSS_SELECTOR, "#wp-chart-outcomes svg polyline")
    (rule,) = browser.find_elements(By.CSS_SELECTOR, "tr.wp-flow-rule")
    assert rule.get_attribute("data-kind") == "topic" and "outbox emails.welcome" in rule.text
    save(browser, tmp_path, "console-topic.png")


def test_a_bulk_retry_from_a_search_result_changes_its_rows(
    browser: Any,  # noqa: F811
    admin_server: LiveServer,  # noqa: F811
    tmp_path: Path,
) -> None:
    _require_browser()
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions
    from selenium.webdriver.support.ui import WebDriverWait

    now = scalar("SELECT now()")  # a payload search reads the last day's rows
    later = scalar("SELECT now() + interval '1 hour'")

    def retrying(topic: str, payload: dict[str, Any]) -> uuid.UUID:
        """A row waiting an hour for its retry, created now (a payload search reads it)."""
        row = factories.OutboxFactory(
            topic=topic, payload=payload, created_at=now, scheduled_for=later, attempts=2
        )
        return row.work_id  # type: ignore[no-any-return]

    waiting = [retrying("emails.welcome", {"tenant": "acme", "n": n}) for n in range(3)]
    other_tenant = retrying("emails.welcome", {"tenant": "globex"})
    other_topic = retrying("billing.invoice", {"tenant": "acme"})
    User.objects.create_superuser("bulk", "bulk@example.com", "bulk-pw")

    browser.set_window_size(1300, 640)
    wait = WebDriverWait(browser, 30)
    browser.get(f"{admin_server.url}/admin/login/?next=/admin/workpump/outbox/")
    browser.find_element(By.NAME, "username").send_keys("bulk")
    browser.find_element(By.NAME, "password").send_keys("bulk-pw")
    browser.find_element(By.CSS_SELECTOR, "input[type=submit]").click()
    # The operator searches the changelist: a topic word and a payload term.
    search = wait.until(expected_conditions.presence_of_element_located((By.NAME, "q")))
    search.send_keys("welcome tenant=acme")
    search.submit()
    wait.until(lambda b: "q=" in b.current_url)
    shown = {
        cell.get_attribute("title")  # the whole id; the cell shows its start
        for cell in browser.find_elements(
            By.CSS_SELECTOR, "#result_list th.field-work_id_cell span"
        )
    }
    assert shown == {str(work_id) for work_id in waiting}

    # "Retry now…" acts on that search result: counted first, then confirmed.
    browser.find_element(By.CSS_SELECTOR, ".object-tools a[href^='bulk/retry/']").click()
    count = wait.until(
        expected_conditions.presence_of_element_located((By.CSS_SELECTOR, ".wp-bulk-count"))
    )
    assert count.text.startswith("3 outbox messages match this search"), count.text
    save(browser, tmp_path, "bulk-retry.png")
    browser.find_element(By.CSS_SELECTOR, "input[type=submit][value^='Yes']").click()
    wait.until(lambda b: "/bulk/" not in b.current_url)

    due = {
        row["work_id"]: row["due"]
        for row in run_sql(
            "SELECT work_id, scheduled_for IS NULL AS due FROM workpump_outbox"
            " WHERE work_id = ANY(%s)",
            ([*waiting, other_tenant, other_topic],),
        )
    }
    assert [due[work_id] for work_id in waiting] == [True, True, True]
    assert (due[other_tenant], due[other_topic]) == (False, False)
