"""The admin of flow rules and a work row's flow-control line (docs/flow-control.md).

Covers: the rules page shows each rule's limits, rows held, tokens left and rows
waiting; pause and resume are offered only with the ``pause_flow`` permission and go
through set_flow_rule; an operator's limit saved on the change page; a waiting row's
page says why it waits.
"""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from django.test import Client

import django_workpump as workpump
from django_workpump import models
from tests.admin.test_admin import client_for, staff
from tests.helpers import enroll, run_sql

pytestmark = pytest.mark.django_db

RULES_URL = "/admin/workpump/flowrule/"


def claim(max_rows: int = 10) -> list[dict[str, Any]]:
    instance = uuid.UUID("00000000-0000-0000-0000-0000000000aa")
    enroll(instance)
    return run_sql("SELECT work_id FROM workpump.claim_work(%s, %s)", [instance, max_rows])


def test_the_rules_page_shows_how_each_rule_stands(admin_client: Client) -> None:
    workpump.set_limit(topic="partner.call", category="outbox", concurrency=2, rate="50/s")
    for _ in range(5):
        workpump.send("partner.call", {})
    assert len(claim()) == 2
    html = admin_client.get(RULES_URL).content.decode()
    assert "outbox topic partner.call" in html
    assert "2 at once, 50/s, burst 50" in html
    assert '<td class="field-in_flight">2</td>' in html
    assert '<td class="field-tokens_left">48</td>' in html
    assert '<td class="field-waiting">3</td>' in html


def test_pause_and_resume_need_their_own_permission(admin_client: Client) -> None:
    workpump.set_limit(key="partner:acme", concurrency=5)
    rule = models.FlowRule.objects.get()
    viewer = client_for(staff("viewer", (models.FlowRule, "view_flowrule")))
    assert 'value="pause"' not in viewer.get(RULES_URL).content.decode()
    pauser = client_for(
        staff("pauser", (models.FlowRule, "view_flowrule"), (models.FlowRule, "pause_flow"))
    )
    assert 'value="pause"' in pauser.get(RULES_URL).content.decode()
    pauser.post(RULES_URL, {"action": "pause", "_selected_action": [rule.pk]})
    rule.refresh_from_db()
    assert rule.paused
    admin_client.post(RULES_URL, {"action": "resume", "_selected_action": [rule.pk]})
    rule.refresh_from_db()
    assert not rule.paused


def test_an_operator_limit_saved_on_the_change_page_goes_through_set_flow_rule(
    admin_client: Client,
) -> None:
    workpump.set_limit(topic="partner.call", category="outbox", concurrency=2)
    rule = models.FlowRule.objects.get()
    response = admin_client.post(
        f"{RULES_URL}{rule.pk}/change/",
        {"override_concurrency": "7", "weight": "1"},
    )
    assert response.status_code == 302, response.content.decode()[:2000]
    rule.refresh_from_db()
    assert rule.override_concurrency == 7


def test_a_waiting_rows_page_says_why_it_waits(admin_client: Client) -> None:
    workpump.set_limit(key="partner:acme", concurrency=1)
    workpump.send("partner.call", {}, concurrency_key="partner:acme")
    second = workpump.send("partner.call", {}, concurrency_key="partner:acme")
    assert len(claim()) == 1
    row = models.Outbox.objects.get(work_id=second)
    html = admin_client.get(f"/admin/workpump/outbox/{row.pk}/change/").content.decode()
    assert "concurrency key partner:acme; waiting: concurrency cap partner:acme 1/1" in html
