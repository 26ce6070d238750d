"""A row's attempt logs on its admin page, beside its last error."""

from __future__ import annotations

import re
import uuid
from datetime import timedelta

import pytest
from django.test import Client
from django.utils import timezone

from django_workpump import models
from tests import factories

pytestmark = pytest.mark.django_db


def log(
    row: models.Outbox, attempt: int, message: str, *, category: str = "outbox", level: int = 30
) -> None:
    models.AttemptLog.objects.create(
        category=category,
        work_id=row.work_id,
        attempt=attempt,
        lease_token=uuid.uuid4(),
        logged_at=timezone.now() + timedelta(seconds=attempt),
        level=level,
        logger="shop.emails",
        message=message,
    )


def test_the_row_page_shows_its_attempt_logs_latest_attempt_first_and_escaped(
    admin_client: Client,
) -> None:
    row = factories.OutboxFactory(last_error="RuntimeError: smtp down")
    other = factories.OutboxFactory()
    log(row, 1, "first try: <script>alert(1)</script>", level=40)
    log(row, 2, "second try: still down")
    log(row, 2, "second try: giving up")
    log(row, 1, "an inbox row's record", category="inbox")  # same id, other table
    log(other, 1, "another row's record")

    html = admin_client.get(f"/admin/workpump/outbox/{row.pk}/change/").content.decode()

    table = re.search(r'<table class="wp-attempt-logs">.*?</table>', html, re.S)
    assert table is not None
    cells = re.findall(r"<tr><td>(\d+)</td><td>[^<]*</td><td>(\w+)</td>", table.group(0))
    assert cells == [("2", "WARNING"), ("2", "WARNING"), ("1", "ERROR")]
    messages = re.findall(r'<pre class="wp-error"[^>]*>(.*?)</pre>', table.group(0), re.S)
    assert messages == [
        "second try: still down",
        "second try: giving up",
        "first try: &lt;script&gt;alert(1)&lt;/script&gt;",
    ]
    # beside the error it explains
    assert html.index("RuntimeError: smtp down") < html.index('class="wp-attempt-logs"')


def test_a_row_without_logs_says_so(admin_client: Client) -> None:
    row = factories.OutboxFactory()
    html = admin_client.get(f"/admin/workpump/outbox/{row.pk}/change/").content.decode()
    assert "none: its handler logged nothing at ATTEMPT_LOG_LEVEL or above" in html
