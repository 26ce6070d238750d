"""The outbox changelist in a real browser: Debian's headless Chromium, driven by Selenium.

Served by pytest-django's live server (its ``LiveServer`` helper) with the test settings,
which install the admin: the rows are made with the factories in the test database the
server reads, with no second database, subprocess or migration run, and a module fixture
points STATIC_URL/STATIC_ROOT at the admin's own static files so the page has its CSS.

Logs in, opens the outbox changelist with leased, orphaned and dead rows, reads the
state, lease-expiry, attempts and heartbeat-age columns, runs "retry now" on a scheduled
row and sees it turn pending, and saves a screenshot under the test's temp dir.

Skips with a message when /usr/bin/chromium, /usr/bin/chromedriver or selenium is
missing; with WORKPUMP_REQUIRE_BROWSER=1 (CI) a missing piece fails the test instead.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import django.contrib.admin
import pytest
from django.contrib.auth.models import User
from django.test.utils import override_settings
from pytest_django.live_server_helper import LiveServer

from django_workpump import models
from django_workpump.admin import display
from tests import factories
from tests.helpers import scalar

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
ADMIN_STATIC = Path(django.contrib.admin.__file__).parent / "static"
# The page is read a few seconds after the rows were made (the clock runs on): ages and
# remaining times are checked within this many seconds of their value at creation.
SLACK_SECONDS = 60

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]


def _require_browser() -> None:
    missing = [path for path in (CHROMIUM, CHROMEDRIVER) if not os.access(path, os.X_OK)]
    try:
        import selenium  # noqa: F401
    except ImportError:
        missing.append("the selenium package")
    if missing:
        message = (
            f"The admin browser test needs {', '.join(missing)}: "
            "`apt-get install chromium chromium-driver` and `pip install selenium`."
        )
        if os.environ.get("WORKPUMP_REQUIRE_BROWSER") == "1":
            pytest.fail(message)
        pytest.skip(message)


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    """Headless Chromium at /usr/bin/chromium through /usr/bin/chromedriver (no downloads)."""
    _require_browser()
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for argument in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--disable-extensions",
        "--no-first-run",
        "--window-size=2100,1000",
    ):
        options.add_argument(argument)
    driver = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=options)
    driver.set_page_load_timeout(30)
    try:
        yield driver
    finally:
        driver.quit()


@pytest.fixture(scope="module")
def admin_server(django_db_setup: None) -> Iterator[LiveServer]:
    """A live server of the test settings, serving the admin's static files too."""
    with override_settings(
        STATIC_URL="/static/",
        STATIC_ROOT=str(ADMIN_STATIC),
        ALLOWED_HOSTS=["127.0.0.1", "localhost", "testserver"],
    ):
        server = LiveServer("127.0.0.1:0")
        try:
            yield server
        finally:
            server.stop()


def seconds(text: str) -> int:
    """``4m 12s`` -> 252 (the inverse of display.duration)."""
    sizes = {"d": 86400, "h": 3600, "m": 60, "s": 1}
    return sum(int(n) * sizes[unit] for n, unit in re.findall(r"(\d+)([dhms])", text))


def test_outbox_changelist_shows_leases_and_retry_now_changes_the_state(
    browser: Any, admin_server: LiveServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _require_browser()
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions
    from selenium.webdriver.support.ui import Select, WebDriverWait

    User.objects.create_superuser("admin", "admin@example.com", "admin-pw")
    now = scalar("SELECT now()")
    live = factories.ServiceInstanceFactory(
        service_name="mailer",
        host_name="web-1",
        process_id=4242,
        started_at=now - timedelta(hours=1),
        last_heartbeat_at=now - timedelta(seconds=5),
    )
    stale = factories.ServiceInstanceFactory(
        service_name="mailer",
        host_name="web-2",
        process_id=77,
        started_at=now - timedelta(hours=2),
        last_heartbeat_at=now - timedelta(seconds=100),
    )
    leased = factories.OutboxFactory(
        stream="b-leased",
        created_at=now - timedelta(minutes=2),
        instance_id=live.instance_id,
        lease_expiry=now + timedelta(seconds=270),
        lease_renewals=1,
        claimed_at=now - timedelta(seconds=30),
        attempts=2,
    )
    factories.OutboxFactory(
        stream="b-orphaned",
        created_at=now - timedelta(minutes=10),
        instance_id=stale.instance_id,
        lease_expiry=now - timedelta(seconds=185),
        claimed_at=now - timedelta(seconds=485),
        attempts=3,
        last_error="TimeoutError: smtp.example.com did not answer",
    )
    factories.OutboxFactory(
        stream="b-dead",
        created_at=now - timedelta(hours=1),
        attempts=10,
        dead_lettered_at=now - timedelta(minutes=1),
        failure_reason="handler_error",
        last_error="KeyError: 'user'\nTraceback (most recent call last): ...",
    )
    scheduled = factories.OutboxFactory(
        stream="b-retry",
        created_at=now - timedelta(minutes=5),
        attempts=1,
        scheduled_for=now + timedelta(hours=1),
        last_error="ConnectionError: refused",
    )

    wait = WebDriverWait(browser, 20)
    browser.get(f"{admin_server.url}/admin/login/?next=/admin/workpump/outbox/")
    browser.find_element(By.NAME, "username").send_keys("admin")
    browser.find_element(By.NAME, "password").send_keys("admin-pw")
    browser.find_element(By.CSS_SELECTOR, "input[type=submit]").click()
    wait.until(expected_conditions.presence_of_element_located((By.ID, "result_list")))

    def row(stream: str) -> Any:
        xpath = f"//tr[td[contains(@class, 'field-stream') and normalize-space()='{stream}']]"
        return browser.find_element(By.XPATH, xpath)

    def cell(stream: str, column: str) -> Any:
        return row(stream).find_element(By.CSS_SELECTOR, f".field-{column}")

    # The leased row: lease expiry absolute and "in 4m …", attempts, renewals, fresh heartbeat.
    assert cell("b-leased", "state").text == "leased"
    absolute, relative = cell("b-leased", "lease_expires").text.split("\n")
    assert absolute == display.when(leased.lease_expiry)
    assert relative.startswith("in 4m")
    assert 270 - SLACK_SECONDS < seconds(relative) <= 270
    assert cell("b-leased", "attempts_of_max").text == "2/10"
    assert cell("b-leased", "renewals").text == "1/6"
    assert cell("b-leased", "owner").text == "mailer@web-1:4242"
    heartbeat = cell("b-leased", "owner_heartbeat")
    assert 5 <= seconds(heartbeat.text) < 5 + SLACK_SECONDS
    assert heartbeat.find_element(By.CSS_SELECTOR, ".wp-heartbeat").get_attribute("class") == (
        "wp-heartbeat wp-fresh"
    )

    # The orphaned row: its lease ran out 3 minutes ago under a stale holder.
    assert cell("b-orphaned", "state").text == "orphaned stuck"
    relative = cell("b-orphaned", "lease_expires").text.split("\n")[1]
    assert relative.startswith("expired 3m")
    assert 185 <= seconds(relative) < 185 + SLACK_SECONDS
    assert cell("b-orphaned", "attempts_of_max").text == "3/10"
    assert cell("b-orphaned", "owner").text == "mailer@web-2:77 (stale)"
    stale_heartbeat = cell("b-orphaned", "owner_heartbeat")
    assert stale_heartbeat.text.startswith("1m")
    assert 100 <= seconds(stale_heartbeat.text) < 100 + SLACK_SECONDS
    assert "wp-stale" in stale_heartbeat.find_element(By.CSS_SELECTOR, "span").get_attribute(
        "class"
    )

    # The dead row: no lease, all attempts used, the first line of its error.
    assert cell("b-dead", "state").text == "dead"
    assert cell("b-dead", "lease_expires").text == "—"
    assert cell("b-dead", "attempts_of_max").text == "10/10"
    assert cell("b-dead", "error").text == "KeyError: 'user'"

    # Retry the scheduled row now: it turns pending.
    assert cell("b-retry", "state").text == "scheduled"
    row("b-retry").find_element(By.CSS_SELECTOR, "input.action-select").click()
    Select(browser.find_element(By.NAME, "action")).select_by_value("retry_now")
    browser.find_element(By.NAME, "index").click()
    wait.until(expected_conditions.presence_of_element_located((By.CSS_SELECTOR, ".messagelist")))
    assert browser.find_element(By.CSS_SELECTOR, ".messagelist").text == (
        "Retried 1 outbox message now."
    )
    assert cell("b-retry", "state").text == "pending"
    assert cell("b-retry", "scheduled").text == "—"
    assert models.Outbox.objects.get(pk=scheduled.pk).scheduled_for is None
    assert cell("b-leased", "state").text == "leased"

    screenshot = tmp_path / "outbox-changelist.png"
    assert browser.save_screenshot(str(screenshot))
    assert screenshot.stat().st_size > 10_000
    with capsys.disabled():  # shown in CI's output even though the test passed
        print(f"\nadmin browser test screenshot: {screenshot}")
