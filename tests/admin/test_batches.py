"""The read-only batch admin shows each batch's progress per outcome."""

from __future__ import annotations

import pytest
from django.test import Client

import django_workpump as workpump
from tests.helpers import run_sql

pytestmark = pytest.mark.django_db

BATCHES_URL = "/admin/workpump/batch/"


def test_the_batch_list_shows_progress_and_filters_open_and_finished(admin_client: Client):
    with workpump.batch(on_complete=("reports.ready", {})) as running:
        ids = [workpump.send("jobs.step", {}) for _ in range(3)]
    run_sql("SELECT * FROM workpump.cancel_work('outbox', %s::uuid[])", [ids[:1]])
    with workpump.batch() as finished:
        pass

    html = admin_client.get(BATCHES_URL).content.decode()
    assert str(running.id) in html and str(finished.id) in html
    assert "1/3" in html
    assert "0 dead, 0 discarded, 1 cancelled" in html

    open_only = admin_client.get(BATCHES_URL, {"finished": "no"}).content.decode()
    assert str(running.id) in open_only and str(finished.id) not in open_only
    detail = admin_client.get(f"{BATCHES_URL}{running.id}/change/")
    assert detail.status_code == 200
    assert admin_client.get(f"{BATCHES_URL}add/").status_code == 403
